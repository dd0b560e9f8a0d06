"""The fast tier's speculation filter on the stack's real engines: a sampled fast request is served
by the standard engine without speculation, priced and recorded as standard; a greedy one is
speculated on the fast engine and priced as fast (docs/routing.md#speculation).

An in-process gateway with its own price list and data dir fronts the stack's two engines.
"""

from __future__ import annotations

import re

import httpx
import msgspec
import pytest

from test_economics_billing import clean_redis, economics_config, wait_for_record
from yieldgate.pricing import PriceBook, Usage
from yieldgate.serving.config import TierConfig


@pytest.fixture(scope="module")
def spec_gw(stack, redis_url, tmp_path_factory):
    from conftest import InProcessGateway

    config = economics_config(stack, tmp_path_factory.mktemp("spec"), redis_url)
    standard, fast = config.fleet.replicas
    fleet = msgspec.structs.replace(
        config.fleet, replicas=[standard, msgspec.structs.replace(fast, speculative=True)],
        tiers={"standard": TierConfig(), "fast": TierConfig(policy="speculation_aware", plain_tier="standard")})
    config = msgspec.structs.replace(config, fleet=fleet)
    gw = InProcessGateway(config)
    gw.book = PriceBook(config.pricing)
    yield gw
    gw.stop()
    clean_redis(redis_url, config.pricing.limits.prefix)


def drafts(engine: str) -> float:
    """The fast engine's vllm:spec_decode_num_drafts_total: it moves only when a request speculates."""
    text = httpx.get(engine + "/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} (\S+)$", text, re.M))


def ask(gw, **sampling) -> httpx.Response:
    resp = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": "demo:fast", "max_tokens": 24, "ignore_eos": True, **sampling,
        "messages": [{"role": "user", "content": "Repeat: def f(x): return x + 1\n" * 4}]})
    assert resp.status_code == 200, resp.text
    return resp


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {}], ids=["temperature-1", "engine-default"])
def test_a_sampled_fast_request_is_served_without_speculation_and_priced_as_standard(spec_gw, stack, sampling):
    before = drafts(stack.engines["fast"])
    resp = ask(spec_gw, **sampling)
    assert drafts(stack.engines["fast"]) == before  # nothing was drafted for it
    h, body = resp.headers, resp.json()
    assert (h["x-yieldgate-replica"], h["x-yieldgate-tier"], h["x-yieldgate-requested-tier"]) == (
        "standard-0", "standard", "fast")
    assert body["service_tier"] == "default"
    u = body["usage"]
    expected = spec_gw.book.cost("demo", "standard", Usage(
        u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"]))
    assert h["x-yieldgate-cost-usd"] == expected.header_value()
    row, = wait_for_record(spec_gw.url, h["x-request-id"])
    assert (row["tier"], row["requested_tier"], row["replica"]) == ("standard", "fast", "standard-0")


def test_a_greedy_fast_request_still_speculates_and_is_priced_as_fast(spec_gw, stack):
    before = drafts(stack.engines["fast"])
    resp = ask(spec_gw, temperature=0)
    assert drafts(stack.engines["fast"]) > before
    h, u = resp.headers, resp.json()["usage"]
    assert (h["x-yieldgate-replica"], h["x-yieldgate-tier"]) == ("fast-0", "fast")
    assert "x-yieldgate-requested-tier" not in h and resp.json()["service_tier"] == "priority"
    expected = spec_gw.book.cost("demo", "fast", Usage(
        u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"]))
    assert h["x-yieldgate-cost-usd"] == expected.header_value()


def test_the_dashboard_shows_each_class_price_multiple_as_billed(spec_gw):
    """Sampled fast requests were served on the plain replica: their class's price multiple is 1;
    greedy ones were sped up and pay the fast price (docs/economics.md#the-fast-tier)."""
    ask(spec_gw, temperature=0)
    ask(spec_gw, temperature=1.0)
    rows = {r["class"]: r for r in httpx.get(spec_gw.url + "/dashboard/data", timeout=10).json()["fast_speedup"]}
    assert rows["chat, sampled"]["served_fast"] == 0 and rows["chat, sampled"]["price_multiple"] == 1.0
    assert rows["chat, greedy"]["served_fast"] == 1 and rows["chat, greedy"]["price_multiple"] > 1.5
