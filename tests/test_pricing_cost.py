"""Price book, exact costs and fleet yield."""

from decimal import Decimal

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yieldgate.pricing.config import ResolvedTierPrice
from yieldgate.pricing import (FleetCostMeter, InvalidPrice, InvalidUsage, PriceBook, PricingConfig, TierPrice,
                     Usage, WIRE_ENCODER)

TOML = b'''
[models.default.standard]
input = "0.50"
[models.default.fast]
input = "1.00"
[models.demo.standard]
input = "0.40"
cached_input = "0.04"
output = "1.60"
[replicas.std-0]
hourly_usd = "3.60"
[ledger]
journal_dir = "/tmp/yg-ledger"
store = "redis"
[limits]
on_redis_error = "closed"
'''


def test_defaults_follow_common_practice():
    book = PriceBook()
    std = book.price("anything", "standard")
    assert (std.input, std.cached_input, std.output) == (Decimal("0.50"), Decimal("0.050"), Decimal("2.00"))
    assert book.price("anything", "fast").input == 2 * std.input


def test_toml_config_and_default_fallback():
    book = PriceBook(msgspec.toml.decode(TOML, type=PricingConfig))
    assert book.price("demo", "standard").output == Decimal("1.60")
    # demo has no fast entry: the default model's fast price applies
    assert book.price("demo", "fast").output == Decimal("4.00")
    assert book.price("other-model", "standard").input == Decimal("0.50")
    # batch and flex: half of each model's standard price unless the model lists them (pricing.lanes)
    assert book.tiers("demo") == ["batch", "fast", "flex", "standard"]
    assert book.price("demo", "batch") == book.price("demo", "flex") == ResolvedTierPrice(
        *(p / 2 for p in (book.price("demo", "standard").input, book.price("demo", "standard").cached_input,
                          book.price("demo", "standard").output)))
    config = msgspec.toml.decode(TOML, type=PricingConfig)
    assert (config.ledger.store, config.limits.on_redis_error) == ("redis", "closed")
    with pytest.raises(msgspec.ValidationError):
        msgspec.toml.decode(b'[limits]\non_redis_error = "maybe"', type=PricingConfig)


def test_cost_breakdown_is_exact():
    book = PriceBook()
    c = book.cost("demo", "standard", Usage(prompt_tokens=1000, cached_tokens=600, completion_tokens=50))
    assert c.uncached_input == Decimal("0.0002")       # 400 * 0.50 / 1M
    assert c.cached_input == Decimal("0.00003")        # 600 * 0.05 / 1M
    assert c.output == Decimal("0.0001")               # 50 * 2.00 / 1M
    assert c.total == Decimal("0.00033")


def test_wire_and_header_formats():
    c = PriceBook().cost("demo", "standard", Usage(25, 0, 0))
    assert WIRE_ENCODER.encode({"cost": c.to_wire()}) == (
        b'{"cost":{"currency":"USD","uncached_input":0.0000125,"cached_input":0,"output":0,'
        b'"total":0.0000125}}')
    assert msgspec.json.decode(WIRE_ENCODER.encode(c.to_wire()))["total"] == pytest.approx(1.25e-5)
    assert c.header_value() == "0.0000125000"


def test_cached_above_prompt_is_rejected():
    with pytest.raises(InvalidUsage):
        Usage(prompt_tokens=10, cached_tokens=11, completion_tokens=0)
    with pytest.raises(InvalidUsage):
        Usage(prompt_tokens=-1)


def test_bad_prices_are_rejected():
    with pytest.raises(InvalidPrice):
        PriceBook(PricingConfig(models={"default": {"standard": msgspec.convert({"input": "-1"}, type=TierPrice)}}))


def test_adapters_cost_their_base_models_price_plus_their_surcharge():
    config = msgspec.toml.decode(TOML + b'''
[adapters.support]
surcharge = "0.25"
[adapters.default]
surcharge = "0.10"
''', type=PricingConfig)
    book = PriceBook(config)
    usage = Usage(prompt_tokens=1000, cached_tokens=600, completion_tokens=50)
    base = book.cost("demo", "standard", usage)
    assert book.cost("demo", "standard", usage, "support").total == base.total * Decimal("1.25")
    assert book.cost("demo", "standard", usage, "unlisted").total == base.total * Decimal("1.10")
    assert book.price("other", "fast", "support").input == Decimal("1.00") * Decimal("1.25")
    assert PriceBook().cost("demo", "standard", usage, "any").total == PriceBook().cost("demo", "standard", usage).total
    with pytest.raises(InvalidPrice):
        PriceBook(msgspec.convert({"adapters": {"x": {"surcharge": "-2"}}}, type=PricingConfig))


usages = st.builds(
    lambda p, frac, c: Usage(p, p * frac // 100, c),
    st.integers(0, 10**9), st.integers(0, 100), st.integers(0, 10**9))
prices = st.decimals(min_value=0, max_value=1000, places=6, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(usages, min_size=1, max_size=20), prices, prices, prices)
def test_cost_is_linear_and_non_negative(batch, p_in, p_cached, p_out):
    from yieldgate.pricing import TierPrice
    book = PriceBook(PricingConfig(models={"default": {"standard": TierPrice(p_in, p_cached, p_out)}}))
    costs = [book.cost("m", "standard", u) for u in batch]
    total_usage = batch[0]
    for u in batch[1:]:
        total_usage = total_usage + u
    summed = sum(costs[1:], costs[0])
    assert summed == book.cost("m", "standard", total_usage)
    assert summed.total == sum(c.total for c in costs)
    assert all(c.uncached_input >= 0 and c.cached_input >= 0 and c.output >= 0 for c in costs)


@settings(deadline=None)  # a loaded machine may stall one example past hypothesis's 200 ms
@given(st.integers(0, 10**6), st.integers(0, 10**6))
def test_cached_never_exceeds_prompt(prompt, cached):
    if cached > prompt:
        with pytest.raises(InvalidUsage):
            Usage(prompt, cached, 0)
    else:
        assert Usage(prompt, cached, 0).uncached_tokens == prompt - cached


def test_fleet_cost_meter_yield_and_margin():
    now = [0]
    config = msgspec.toml.decode(TOML, type=PricingConfig)
    meter = FleetCostMeter(config, clock_ns=lambda: now[0])
    book = PriceBook(config)
    u = Usage(prompt_tokens=900_000, cached_tokens=0, completion_tokens=100_000)
    meter.observe("std-0", "demo", "standard", u, book.cost("demo", "standard", u), busy_ns=900 * 10**9)
    now[0] = 3600 * 10**9  # one hour: the replica cost $3.60 and served 1M tokens
    report = meter.report()
    (rep,) = report.replicas
    assert rep.cost_usd == Decimal("3.60")
    assert rep.cost_per_mtok == Decimal("3.60")
    assert rep.utilization == Decimal("0.25")
    (tier,) = report.tiers
    assert tier.list_revenue_usd == Decimal("0.36") + Decimal("0.16")
    assert tier.margin_usd == tier.list_revenue_usd - Decimal("3.60")
    assert tier.margin_ratio < 0  # an idle-ish replica at demo prices loses money
