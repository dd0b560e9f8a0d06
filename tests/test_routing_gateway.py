"""Cache-aware routing through real gateways onto a tier made of both demo engines."""

from __future__ import annotations

import asyncio
import secrets
import time

import httpx
import pytest
import redis

from yieldgate.gateway.config import Config, ServerConfig
from yieldgate.serving.config import FleetConfig, ReplicaConfig, TierConfig


@pytest.fixture
def names(redis_url):
    """Replica names unique to this test: the gateways share Redis DB 15 (and its `yg:prefix:demo`
    keys) with every other gateway under test, so only our own keys are deleted afterwards."""
    tag = "rg" + secrets.token_hex(3)
    yield [f"{tag}-0", f"{tag}-1"]
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"yg:prefix:demo:r:{tag}-*"))
    if keys:
        r.delete(*keys)
    r.hdel("yg:prefix:demo:capacity", *[f"{tag}-0", f"{tag}-1"])
    r.close()


def both_engines_one_tier(stack, redis_url: str, names: list[str], kv_events: bool = True) -> Config:
    # The fast engine publishes no KV events in dev: the index learns it from routing alone.
    replicas = [
        ReplicaConfig(name=names[0], tier="standard", url=stack.engines["standard"],
                      kv_events_endpoint=stack.kv_events_endpoint if kv_events else ""),
        ReplicaConfig(name=names[1], tier="standard", url=stack.engines["fast"]),
    ]
    return Config(server=ServerConfig(redis_url=redis_url),
                  fleet=FleetConfig(model="demo", model_path=str(stack.model_dir), replicas=replicas,
                                    tiers={"standard": TierConfig(policy="cache_aware")}, health_interval_s=0.5))


def prefix_text(words: int = 700) -> str:
    """A fresh system prompt (~1,500 demo tokens): no engine has cached it yet."""
    salt = secrets.token_hex(8)
    return f"[{salt}] " + " ".join(f"rule {i} of tenant {salt[:4]} says cache blocks well" for i in range(words // 8))


def ask(url: str, system: str, question: str, max_tokens: int = 2) -> httpx.Response:
    resp = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "demo", "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert resp.status_code == 200, resp.text
    return resp


def cached_tokens(resp: httpx.Response) -> int:
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_repeated_prefix_lands_on_one_replica_and_prediction_matches_usage(stack, gateway_factory, redis_url, names):
    gw = gateway_factory(both_engines_one_tier(stack, redis_url, names))
    time.sleep(0.5)  # let the KV-event subscriber join before the first event
    system = prefix_text()
    first = ask(gw.url, system, "first question")
    second = ask(gw.url, system, "a different second question")
    assert first.headers["x-yieldgate-replica"] == second.headers["x-yieldgate-replica"]
    assert int(first.headers["x-yieldgate-predicted-cached-tokens"]) == 0
    predicted = int(second.headers["x-yieldgate-predicted-cached-tokens"])
    assert predicted >= 1024
    assert predicted == cached_tokens(second)
    # Both answered: no prefill is still counted as queued on either replica.
    assert not any(gw.gateway.routing.routers["standard"].pending.blocks.values())


def test_hot_prefix_spills_to_the_other_replica(stack, gateway_factory, redis_url, names):
    gw = gateway_factory(both_engines_one_tier(stack, redis_url, names))
    # ~650 tokens = 20 cached blocks: on two replicas (overlap_weight 2, queued_request_blocks 2)
    # worth about 20 queued requests in the router's cost, so the cost alone would keep the whole
    # burst home; the hot-spot guard spills it once home carries more than twice the other's load
    # and more than 5 requests more.
    system = prefix_text(300)
    home = ask(gw.url, system, "warm up").headers["x-yieldgate-replica"]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(gw.url + "/v1/chat/completions", json={
                "model": "demo", "max_tokens": 96, "stream": False,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]})
                for i in range(24)))

    results = asyncio.run(burst())
    assert all(r.status_code == 200 for r in results)
    where = [r.headers["x-yieldgate-replica"] for r in results]
    other = names[1] if home == names[0] else names[0]
    # The prefix's home takes the first requests; once it runs well above the fleet, the rest spill.
    assert where.count(home) >= 4
    assert where.count(other) >= 1
    # The spilled requests taught the index: the prefix now lives on both replicas. (Other
    # gateways on the same engine and Redis DB may add their own replica names for it.)
    routing = gw.gateway.routing
    hashes = routing.routers["standard"].hasher.hashes(
        routing.tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "x"}]))
    assert set(names) <= set(routing.index.match(hashes))


def test_two_gateways_sharing_redis_agree_on_the_replica(stack, gateway_factory, redis_url, names):
    one = gateway_factory(both_engines_one_tier(stack, redis_url, names))
    # The second gateway gets no KV events at all: what it knows about the prefix comes from Redis.
    two = gateway_factory(both_engines_one_tier(stack, redis_url, names, kv_events=False))
    system = prefix_text()
    first = ask(one.url, system, "via gateway one")
    home = first.headers["x-yieldgate-replica"]
    tok = two.gateway.routing.tokenizer
    hashes = two.gateway.routing.routers["standard"].hasher.hashes(
        tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "q"}]))
    deadline = time.monotonic() + 10
    while home not in two.gateway.routing.index.match(hashes) and time.monotonic() < deadline:
        time.sleep(0.1)
    second = ask(two.url, system, "via gateway two")
    assert second.headers["x-yieldgate-replica"] == home
    assert int(second.headers["x-yieldgate-predicted-cached-tokens"]) >= 1024
    assert int(second.headers["x-yieldgate-predicted-cached-tokens"]) == cached_tokens(second)
