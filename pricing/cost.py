"""Usage (token counts) and Cost (its exact USD price breakdown)."""

from __future__ import annotations

from decimal import Decimal

import msgspec

from .errors import InvalidUsage

ZERO = Decimal(0)
# Display precision for headers: 1e-10 USD is far below any single-token price.
DISPLAY_QUANTUM = Decimal("1e-10")
WIRE_ENCODER = msgspec.json.Encoder(decimal_format="number")


def _plain(value: Decimal) -> Decimal:
    """Drop trailing zeros (0.000012500 -> 0.0000125) without switching to 1E+2 notation."""
    value = value.normalize()
    return value.quantize(1) if value.as_tuple().exponent > 0 else value  # type: ignore[operator]


class Usage(msgspec.Struct, frozen=True):
    """Token counts of one request; cached_tokens is the part of prompt_tokens served from cache."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.cached_tokens < 0 or self.completion_tokens < 0:
            raise InvalidUsage(f"token counts must be >= 0: {self!r}")
        if self.cached_tokens > self.prompt_tokens:
            raise InvalidUsage(
                f"cached_tokens ({self.cached_tokens}) > prompt_tokens ({self.prompt_tokens})")

    @classmethod
    def reported(cls, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Usage:
        """Counts as an engine reported them, made billable: a negative count is 0 and the cached
        part never exceeds the prompt."""
        prompt = max(prompt_tokens, 0)
        return cls(prompt, min(max(cached_tokens, 0), prompt), max(completion_tokens, 0))

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.prompt_tokens + other.prompt_tokens,
                     self.cached_tokens + other.cached_tokens,
                     self.completion_tokens + other.completion_tokens)


class Cost(msgspec.Struct, frozen=True):
    """Exact USD cost of a request; Decimals are never rounded here, only in header_value()."""

    uncached_input: Decimal = ZERO
    cached_input: Decimal = ZERO
    output: Decimal = ZERO

    @property
    def total(self) -> Decimal:
        return self.uncached_input + self.cached_input + self.output

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.uncached_input + other.uncached_input,
                    self.cached_input + other.cached_input,
                    self.output + other.output)

    def to_wire(self) -> dict[str, Decimal]:
        """The `usage.cost` object; encode with WIRE_ENCODER so Decimals become JSON numbers."""
        return {"currency": "USD", "uncached_input": _plain(self.uncached_input),  # type: ignore[dict-item]
                "cached_input": _plain(self.cached_input), "output": _plain(self.output),
                "total": _plain(self.total)}

    def header_value(self) -> str:
        """Value of the x-yieldgate-cost-usd header, fixed-point, e.g. "0.0000125000"."""
        return format(self.total.quantize(DISPLAY_QUANTUM), "f")
