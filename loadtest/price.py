"""Client-side price table, used when a response carries no `usage.cost.total`."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec


class Price(msgspec.Struct, frozen=True, kw_only=True):
    """USD per 1M tokens. Cached input defaults to the uncached price (no cache discount)."""

    input: float = 0.0
    output: float = 0.0
    cached_input: float | None = None

    def cost(self, prompt_tokens: int, cached_tokens: int | None, completion_tokens: int) -> float:
        cached = min(cached_tokens or 0, prompt_tokens)
        cached_price = self.input if self.cached_input is None else self.cached_input
        return ((prompt_tokens - cached) * self.input + cached * cached_price
                + completion_tokens * self.output) / 1_000_000


class PriceTable(msgspec.Struct, kw_only=True):
    """Prices by target label or model name; "*" is the fallback."""

    prices: dict[str, Price] = {}

    def for_target(self, label: str, model: str) -> Price | None:
        return self.prices.get(label) or self.prices.get(model) or self.prices.get("*")

    @classmethod
    def load(cls, path: str | Path) -> "PriceTable":
        """TOML or JSON: `[prices."demo:fast"] input = 0.6 ...` or {"prices": {...}} or a bare mapping."""
        p = Path(path)
        raw = tomllib.loads(p.read_text()) if p.suffix == ".toml" else msgspec.json.decode(p.read_bytes())
        if "prices" not in raw:
            raw = {"prices": raw}
        return msgspec.convert(raw, cls)

    @classmethod
    def parse_cli(cls, items: list[str]) -> "PriceTable":
        """`--price input=0.5,output=1.5,cached_input=0.05` or `--price demo:fast:input=0.6,output=2`.

        A prefix before the last ':' preceding the first '=' names the model/target; none means "*".
        """
        prices: dict[str, Price] = {}
        for item in items:
            head, sep, _ = item.partition("=")
            key, fields = "*", item
            if sep and ":" in head:
                key, _, first = head.rpartition(":")
                fields = first + item[len(head):]
            values: dict[str, float] = {}
            for part in fields.split(","):
                name, eq, val = part.partition("=")
                if not eq:
                    raise ValueError(f"bad --price item {part!r} (want name=value)")
                values[name.strip().replace("-", "_")] = float(val)
            base = msgspec.to_builtins(prices.get(key, Price()))
            prices[key] = msgspec.convert({**base, **values}, Price)
        return cls(prices=prices)
