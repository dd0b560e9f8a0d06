"""The fast tier's premium follows the speed it delivers: a workload class pays the fast price only
once the gateway has measured, on enough requests of each tier, a speed-up at or above the floor.

The two "engines" are benchmarks/fake_upstream.py processes answering at set token rates: what is
under test is the gateway's pricing rule, which needs speeds it can set (a real speculating engine's
speed-up depends on the text).
"""

from __future__ import annotations

from decimal import Decimal

import httpx
import pytest

from conftest import fake_upstream_process
from yieldgate.gateway.config import Config, ServerConfig
from yieldgate.pricing.config import PricingConfig, TierPrice
from yieldgate.serving.config import FleetConfig, ReplicaConfig

TOKENS = 16
STANDARD_IN, FAST_IN = Decimal("0.50"), Decimal("1.00")


def _gateway(gateway_factory, tmp_path, redis_url: str, standard_url: str, fast_url: str):
    pricing = PricingConfig(models={"default": {"standard": TierPrice(input=STANDARD_IN), "fast": TierPrice(input=FAST_IN)}},
                            fast_min_speedup=1.5, fast_min_samples=3)
    pricing.ledger.journal_dir = str(tmp_path / "journal")
    return gateway_factory(Config(
        server=ServerConfig(redis_url=redis_url, data_dir=str(tmp_path / "data")),
        fleet=FleetConfig(model="demo", health_interval_s=0.5, replicas=[
            ReplicaConfig(name="standard-0", tier="standard", url=standard_url),
            ReplicaConfig(name="fast-0", tier="fast", url=fast_url)]),
        pricing=pricing))


def _ask(url: str, model: str) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def _input_price(r: httpx.Response) -> Decimal:
    """USD per 1M uncached input tokens this answer was billed at."""
    usage = r.json()["usage"]
    uncached = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    return Decimal(str(usage["cost"]["uncached_input"])) * 1_000_000 / uncached


@pytest.mark.parametrize("fast_itl_ms, premium_after_proof", [(2.5, True), (10.0, False)])
def test_the_premium_is_billed_only_for_a_measured_speed_up(gateway_factory, tmp_path, redis_url,
                                                            fast_itl_ms, premium_after_proof):
    with fake_upstream_process("--itl-ms", "10", "--tokens", str(TOKENS)) as standard, \
            fake_upstream_process("--itl-ms", str(fast_itl_ms), "--tokens", str(TOKENS)) as fast:
        gw = _gateway(gateway_factory, tmp_path, redis_url, standard, fast)
        # Unproven: the class has no standard-tier requests yet, so fast pays the standard price,
        # labelled as such, and is still served by the fast replica.
        first = _ask(gw.url, "demo:fast")
        assert first.headers["x-yieldgate-replica"] == "fast-0"
        assert first.headers["x-yieldgate-tier"] == "fast"
        assert first.headers["x-yieldgate-priced-tier"] == "standard"
        assert _input_price(first) == STANDARD_IN
        for _ in range(3):
            _ask(gw.url, "demo")
            _ask(gw.url, "demo:fast")
        proven = _ask(gw.url, "demo:fast")
        if premium_after_proof:  # 4x the standard tier's tokens per second: the premium is earned
            assert "x-yieldgate-priced-tier" not in proven.headers
            assert _input_price(proven) == FAST_IN
        else:  # as fast as standard: never the premium
            assert proven.headers["x-yieldgate-priced-tier"] == "standard"
            assert _input_price(proven) == STANDARD_IN
        # The dashboard shows the measured speed-up next to the price multiple billed.
        (row,) = [r for r in httpx.get(gw.url + "/dashboard/data", timeout=30).json()["fast_speedup"]
                  if r["class"] == "chat, greedy"]
        assert (row["speedup"] >= 1.5) is premium_after_proof
        assert 1.0 <= row["price_multiple"] < 2.0 if premium_after_proof else row["price_multiple"] == 1.0
