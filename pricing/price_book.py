"""PriceBook: list prices per (model, tier) and the exact cost of a request."""

from __future__ import annotations

from decimal import Decimal

from .config import AdapterPrice, CACHED_INPUT_RATIO, OUTPUT_RATIO, PricingConfig, ResolvedTierPrice, TierPrice
from .cost import Cost, Usage
from .errors import InvalidPrice

DEFAULT_MODEL = "default"
STANDARD = "standard"
# The deadline-tolerant lanes: priced off the standard tier unless a model lists them itself.
BATCH = "batch"
FLEX = "flex"
# Per-1M prices with at most 12 significant digits keep tokens*price (tokens < 1e15) inside the
# default 28-digit Decimal context, so every cost is exact and costs add up exactly.
MAX_PRICE_DIGITS = 12


def _check(price: Decimal, what: str) -> Decimal:
    if not price.is_finite() or price < 0:
        raise InvalidPrice(f"{what}: price must be a finite number >= 0, got {price}")
    if len(price.normalize().as_tuple().digits) > MAX_PRICE_DIGITS:
        raise InvalidPrice(f"{what}: more than {MAX_PRICE_DIGITS} significant digits: {price}")
    return price


def resolve(price: TierPrice, what: str = "price") -> ResolvedTierPrice:
    base = _check(price.input, what + ".input")
    cached = price.cached_input if price.cached_input is not None else base * CACHED_INPUT_RATIO
    output = price.output if price.output is not None else base * OUTPUT_RATIO
    return ResolvedTierPrice(base, _check(cached, what + ".cached_input"), _check(output, what + ".output"))


class PriceBook:
    """Looks up the list price of (model, tier); unknown models fall back to the "default" entry."""

    def __init__(self, config: PricingConfig | None = None) -> None:
        config = config or PricingConfig()
        self._prices: dict[tuple[str, str], ResolvedTierPrice] = {}
        for model, tiers in config.models.items():
            for tier, price in tiers.items():
                self._prices[(model, tier)] = resolve(price, f"pricing.models.{model}.{tier}")
        for (model, tier), price in list(self._prices.items()):
            if tier != STANDARD:
                continue
            for lane, share in ((BATCH, config.lanes.batch), (FLEX, config.lanes.flex)):
                what = f"pricing.lanes.{lane}"
                _check(share, what)
                self._prices.setdefault((model, lane), ResolvedTierPrice(
                    *(_check(p * share, what) for p in (price.input, price.cached_input, price.output))))
        self._default_tiers = {t for (m, t) in self._prices if m == DEFAULT_MODEL}
        # (model, tier, adapter) -> price, resolved here so that a bad surcharge fails at start-up.
        self._adapters = config.adapters
        self._adapter_prices: dict[tuple[str, str, str], ResolvedTierPrice] = {}
        for adapter, entry in config.adapters.items():
            for (model, tier), price in self._prices.items():
                self._adapter_prices[(model, tier, adapter)] = _surcharged(price, entry, f"pricing.adapters.{adapter}")

    def price(self, model: str, tier: str, adapter: str = "") -> ResolvedTierPrice:
        """The list price of (model, tier), or of LoRA adapter `adapter` of that model."""
        if adapter and self._adapters:
            key = adapter if adapter in self._adapters else DEFAULT_MODEL
            if key in self._adapters:
                found = self._adapter_prices.get((model, tier, key)) or self._adapter_prices.get((DEFAULT_MODEL, tier, key))
                if found is not None:
                    return found
        found = self._prices.get((model, tier))
        if found is None:
            found = self._prices.get((DEFAULT_MODEL, tier))
        if found is None:
            raise KeyError(f"no price for model {model!r} tier {tier!r} and no default.{tier} entry")
        return found

    def cost(self, model: str, tier: str, usage: Usage, adapter: str = "") -> Cost:
        p = self.price(model, tier, adapter)
        # scaleb(-6) divides by 1M exactly (exponent shift, no rounding).
        return Cost(
            uncached_input=(p.input * usage.uncached_tokens).scaleb(-6),
            cached_input=(p.cached_input * usage.cached_tokens).scaleb(-6),
            output=(p.output * usage.completion_tokens).scaleb(-6),
        )

    def max_cost(self, model: str, tier: str, prompt_tokens: int, max_completion_tokens: int,
                 adapter: str = "") -> Cost:
        """Upper bound of a request's cost (nothing cached, every allowed token generated): the
        amount a budget reserves before the request goes upstream."""
        return self.cost(model, tier, Usage(prompt_tokens, 0, max_completion_tokens), adapter)

    def tiers(self, model: str) -> list[str]:
        own = {t for (m, t) in self._prices if m == model}
        return sorted(own | self._default_tiers)


def _surcharged(price: ResolvedTierPrice, entry: AdapterPrice, what: str) -> ResolvedTierPrice:
    factor = 1 + _check(entry.surcharge, what + ".surcharge")
    return ResolvedTierPrice(*(_check(p * factor, what) for p in (price.input, price.cached_input, price.output)))
