"""API keys, budgets and rate limits against real Redis (DB 14; each test uses its own prefix)."""

import asyncio
import os
import random
import socket
import uuid
from decimal import Decimal

import pytest
import redis.asyncio as aioredis

from yieldgate.pricing import (BudgetEnforcer, InsufficientQuota, InvalidApiKey, KeyNotFound, KeyStore,
                     LimiterUnavailable, PriceBook, RateLimited, RateLimiter, Usage)

# Fixtures live on the session loop (pyproject: asyncio_default_fixture_loop_scope); so do tests.
pytestmark = pytest.mark.asyncio(loop_scope="session")
REDIS_URL = os.environ.get("YG_TEST_REDIS_URL", "redis://127.0.0.1:6379/14")


@pytest.fixture
async def env():
    """Two Redis clients = two gateways sharing one Redis; every key under a unique prefix."""
    prefix = f"yg-test-limits:{uuid.uuid4().hex[:8]}:"
    a, b = aioredis.Redis.from_url(REDIS_URL), aioredis.Redis.from_url(REDIS_URL)
    yield prefix, a, b
    keys = [k async for k in a.scan_iter(match=prefix + "*")]
    if keys:
        await a.delete(*keys)
    await a.aclose()
    await b.aclose()


def _dead_redis() -> aioredis.Redis:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=0.5)


async def test_key_lifecycle(env):
    prefix, a, b = env
    gw1 = KeyStore(a, pepper="pepper", prefix=prefix, cache_ttl_s=0)
    gw2 = KeyStore(b, pepper="pepper", prefix=prefix, cache_ttl_s=0)
    created = await gw1.create("team-a", name="ci", budget_usd="5.00", rpm=60, tpm=10_000)
    assert created.secret.startswith("yg-" + created.key.id + "-")
    stored = await a.hgetall(f"{prefix}key:{created.key.id}")
    assert created.secret.encode() not in b"".join(stored.values())  # only the HMAC is kept
    key = await gw2.authenticate(created.secret)  # another gateway sees it
    assert (key.team, key.budget_usd, key.rpm) == ("team-a", Decimal("5.00"), 60)
    for bad in ("nope", created.secret + "x", "yg-" + created.key.id + "-guess", "yg-000000000000-x"):
        with pytest.raises(InvalidApiKey):
            await gw2.authenticate(bad)
    # A gateway with a different pepper cannot validate secrets.
    with pytest.raises(InvalidApiKey):
        await KeyStore(a, pepper="other", prefix=prefix).authenticate(created.secret)
    await gw1.create("team-b")
    assert [k.team for k in await gw1.list("team-a")] == ["team-a"]
    assert len(await gw1.list()) == 2
    updated = await gw1.update(created.key.id, rpm=120)
    assert (await gw2.authenticate(created.secret)).rpm == updated.rpm == 120
    await gw1.revoke(created.key.id)
    with pytest.raises(InvalidApiKey):
        await gw2.authenticate(created.secret)
    with pytest.raises(KeyNotFound):
        await gw1.revoke("missing")



async def test_a_cached_key_skips_the_hmac_only_for_the_secret_it_verified(env, monkeypatch):
    prefix, a, _ = env
    clock = [0.0]
    store = KeyStore(a, pepper="p", prefix=prefix, cache_ttl_s=5, clock=lambda: clock[0])
    created = await store.create("t")
    digests = []
    real = store.digest
    monkeypatch.setattr(store, "digest", lambda s: digests.append(s) or real(s))
    for _ in range(3):
        assert (await store.authenticate(created.secret)).id == created.key.id
    assert digests == [created.secret]  # verified once, then recognised
    # ... by a fingerprint: the cache holds no secret, not even the random part of one.
    cached = repr(store._cache)
    random_part = created.secret.split("-", 2)[2]  # token_urlsafe: may itself hold "-"
    assert len(random_part) == 32 and random_part not in cached
    assert random_part.encode() not in b"".join(
        v for entry in store._cache.values() for v in entry if isinstance(v, bytes))
    for bad in (created.secret[:-1] + "!", created.secret + "x", "yg-" + created.key.id + "-guess"):
        with pytest.raises(InvalidApiKey):
            await store.authenticate(bad)
    assert (await store.authenticate(created.secret)).id == created.key.id
    await KeyStore(a, pepper="p", prefix=prefix).revoke(created.key.id)  # another gateway revokes
    clock[0] = 6.0  # past the cache TTL: Redis is read again, and the revocation seen
    with pytest.raises(InvalidApiKey, match="revoked"):
        await store.authenticate(created.secret)

async def test_key_cache_survives_redis_blip_only_when_open(env):
    prefix, a, _ = env
    store = KeyStore(a, pepper="p", prefix=prefix, cache_ttl_s=0)
    created = await store.create("t")
    await store.authenticate(created.secret)  # now cached (expired immediately: ttl 0)
    store.redis = _dead_redis()
    assert (await store.authenticate(created.secret)).id == created.key.id
    store.on_redis_error = "closed"
    with pytest.raises(LimiterUnavailable):
        await store.authenticate(created.secret)


async def test_hard_budget_under_50_concurrent_requests_from_two_gateways(env):
    prefix, a, b = env
    keys = KeyStore(a, pepper="p", prefix=prefix)
    budget = Decimal("0.01")
    key = (await keys.create("t", budget_usd=budget, budget_kind="hard", budget_period="daily")).key
    gateways = [BudgetEnforcer(a, prefix=prefix), BudgetEnforcer(b, prefix=prefix)]
    book = PriceBook()
    rng = random.Random(7)
    max_cost = book.max_cost("demo", "standard", prompt_tokens=2000, max_completion_tokens=500)
    assert max_cost.total == Decimal("0.002")
    admitted, rejected = [], 0

    async def request(i: int) -> None:
        nonlocal rejected
        gw = gateways[i % 2]
        try:
            res = await gw.reserve(key, max_cost)
        except InsufficientQuota as e:
            rejected += 1
            assert e.requested_usd == max_cost.total
            return
        await asyncio.sleep(rng.random() * 0.01)  # upstream time
        actual = book.cost("demo", "standard", Usage(2000, rng.randint(0, 2000), rng.randint(1, 500)))
        admitted.append(actual.total)
        await gw.settle(key, res, actual)

    await asyncio.gather(*(request(i) for i in range(50)))
    status = await gateways[0].status(key)
    assert status.reserved_usd == 0
    spent_exact = sum(admitted, Decimal(0))
    assert status.spent_usd >= spent_exact  # nano-dollar ceil rounding only ever rounds up
    assert status.spent_usd <= budget + max_cost.total  # overshoot at most one request
    assert status.spent_usd <= budget  # in fact none: we reserve the maximum
    assert rejected == 50 - len(admitted) and rejected > 0
    # once spent + reserved leave room, the same key is admitted again
    assert len(admitted) >= 5


async def test_soft_budget_flags_but_never_rejects(env):
    prefix, a, _ = env
    key = (await KeyStore(a, pepper="p", prefix=prefix).create(
        "t", budget_usd="0.001", budget_kind="soft", budget_period="total")).key
    gw = BudgetEnforcer(a, prefix=prefix)
    flags = []
    for _ in range(3):
        res = await gw.reserve(key, Decimal("0.0006"))
        flags.append(res.over_soft_budget)
        await gw.settle(key, res, Decimal("0.0006"))
    assert flags == [False, True, True]
    assert (await gw.status(key)).spent_usd == Decimal("0.0018")


async def test_unsettled_reservation_expires(env):
    prefix, a, _ = env
    key = (await KeyStore(a, pepper="p", prefix=prefix).create("t", budget_usd="0.001")).key
    gw = BudgetEnforcer(a, prefix=prefix, reservation_ttl_s=3)  # outlives a loaded machine's stall
    await gw.reserve(key, Decimal("0.001"))  # the gateway "dies" and never settles
    with pytest.raises(InsufficientQuota):
        await gw.reserve(key, Decimal("0.0001"))
    await asyncio.sleep(3.2)
    res = await gw.reserve(key, Decimal("0.0001"))
    await gw.settle(key, res, Decimal("0.00005"))
    await gw.settle(key, res, Decimal("0.00005"))  # double settle is ignored
    status = await gw.status(key)
    assert (status.spent_usd, status.reserved_usd) == (Decimal("0.00005"), 0)


async def test_redis_down_policy(env):
    prefix, a, _ = env
    key = (await KeyStore(a, pepper="p", prefix=prefix).create("t", budget_usd="1", rpm=1, tpm=10)).key
    dead = _dead_redis()
    res = await BudgetEnforcer(dead, prefix=prefix, on_redis_error="open").reserve(key, Decimal("0.1"))
    assert res.degraded
    assert (await RateLimiter(dead, prefix=prefix, on_redis_error="open").acquire(key, 5)).degraded
    with pytest.raises(LimiterUnavailable):
        await BudgetEnforcer(dead, prefix=prefix, on_redis_error="closed").reserve(key, Decimal("0.1"))
    with pytest.raises(LimiterUnavailable):
        await RateLimiter(dead, prefix=prefix, on_redis_error="closed").acquire(key, 5)
    await dead.aclose()


async def test_rpm_limit_with_retry_after(env):
    prefix, a, b = env
    key = (await KeyStore(a, pepper="p", prefix=prefix).create("t", rpm=5)).key
    gws = [RateLimiter(a, prefix=prefix), RateLimiter(b, prefix=prefix)]
    for i in range(5):
        assert (await gws[i % 2].acquire(key)).allowed
    with pytest.raises(RateLimited) as info:
        await gws[1].acquire(key)
    assert info.value.limit == "rpm"
    assert 0 < info.value.retry_after_s <= 120


async def test_tpm_limit_counts_completion_tokens(env):
    prefix, a, _ = env
    key = (await KeyStore(a, pepper="p", prefix=prefix).create("t", tpm=1000)).key
    rl = RateLimiter(a, prefix=prefix)
    await rl.acquire(key, tokens=300)
    await rl.add_tokens(key, 500)  # completion tokens known after the response
    with pytest.raises(RateLimited) as info:
        await rl.acquire(key, tokens=300)
    assert info.value.limit == "tpm" and info.value.retry_after_s > 0
    await rl.acquire(key, tokens=200)  # still fits exactly
    # a key without limits never touches Redis
    free = (await KeyStore(a, pepper="p", prefix=prefix).create("t")).key
    assert (await RateLimiter(_dead_redis(), prefix=prefix, on_redis_error="closed").acquire(free, 10**9)).allowed
