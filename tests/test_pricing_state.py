"""Redis as a cache of PostgreSQL: keys read from their record when Redis lost them, budget
counters seeded from the ledger (real Redis DB 14 under a prefix of the test's own, real
PostgreSQL in a database of its own)."""

import os
import time
import uuid
from decimal import Decimal

import pytest
import redis.asyncio as aioredis

from pg import temp_database
from yieldgate.pricing import BudgetEnforcer, InsufficientQuota, InvalidApiKey, KeyStore, StoreUnavailable
from yieldgate.pricing.epoch import CacheEpoch
from yieldgate.pricing.key_record import PostgresKeyRecord
from yieldgate.pricing.keys import ApiKey

pytestmark = pytest.mark.asyncio(loop_scope="session")
REDIS_URL = os.environ.get("YG_TEST_REDIS_URL", "redis://127.0.0.1:6379/14")


@pytest.fixture
async def env():
    prefix = f"yg-test-state:{uuid.uuid4().hex[:8]}:"
    r = aioredis.Redis.from_url(REDIS_URL)
    yield prefix, r
    keys = [k async for k in r.scan_iter(match=prefix + "*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


async def forget(r: aioredis.Redis, prefix: str) -> None:
    """What a Redis restarted without persistence does to this test's keys."""
    keys = [k async for k in r.scan_iter(match=prefix + "*")]
    if keys:
        await r.delete(*keys)


async def test_keys_survive_redis_in_their_record(env):
    prefix, r = env
    with temp_database() as url:
        record = PostgresKeyRecord(url)
        await record.open()
        store = KeyStore(r, pepper="p", prefix=prefix, cache_ttl_s=0, record=record)
        created = await store.create("team-a", budget_usd="2.50", rpm=10)
        other = await store.create("team-b")
        await store.revoke(other.key.id)
        await forget(r, prefix)
        key = await store.authenticate(created.secret)  # read from PostgreSQL, cached again
        assert (key.team, key.budget_usd, key.rpm) == ("team-a", Decimal("2.50"), 10)
        assert await r.hget(f"{prefix}key:{created.key.id}", "doc") is not None
        with pytest.raises(InvalidApiKey, match="revoked"):
            await store.authenticate(other.secret)
        assert [k.id for k in await store.list("team-a")] == [created.key.id]
        await forget(r, prefix)
        assert await store.reload() == 2
        assert await r.scard(prefix + "keys") == 2
        # Another gateway (its own record client) sees the same keys; the secret never is stored.
        second = PostgresKeyRecord(url)
        found = await second.get(created.key.id)
        assert found is not None and found[1] == store.digest(created.secret)
        await second.close()
        await record.close()
    # The record gone: no key is created whose only copy would be the cache.
    with pytest.raises(StoreUnavailable):
        await KeyStore(r, pepper="p", prefix=prefix, record=PostgresKeyRecord(url, timeout_s=1)).create("t")


async def test_epoch_marks_an_emptied_cache(env):
    prefix, r = env
    a, b = CacheEpoch(r, prefix + "epoch"), CacheEpoch(r, prefix + "epoch")
    assert await a.check() is True  # none at all: rebuild (a new Redis, or one that lost it all)
    a.rebuilt()
    assert await b.check() is False  # a cache that was there before this process
    assert await a.check() is False
    await forget(r, prefix)
    assert await b.check() is True  # b writes the new marker...
    assert await a.check() is True  # ...a sees another one than it knew
    assert await a.check() is True  # and keeps saying so until it rebuilt
    a.rebuilt()
    b.rebuilt()
    assert (await a.check(), await b.check()) == (False, False)


async def test_budget_counter_is_seeded_from_the_ledger(env):
    prefix, r = env
    ledger = {"k1": Decimal("0.90")}  # what the ledger holds for the key, before anything below
    calls = []

    async def spend(key_id: str, since, until) -> Decimal:
        calls.append((key_id, since, until))
        return ledger.get(key_id, Decimal(0))

    budget = BudgetEnforcer(r, prefix=prefix, spend_source=spend)
    key = ApiKey(id="k1", budget_usd=Decimal("1.00"), budget_period="total")
    # The counter Redis does not hold is seeded before it admits: 0.90 spent, 0.20 does not fit.
    with pytest.raises(InsufficientQuota):
        await budget.reserve(key, Decimal("0.20"))
    assert len(calls) == 1 and budget.seeded == 1
    res = await budget.reserve(key, Decimal("0.05"))
    await budget.settle(key, res, Decimal("0.04"))
    status = await budget.status(key)
    assert status.spent_usd == Decimal("0.94") and status.reserved_usd == 0
    # Redis loses everything; a request that was in flight settles before anyone re-seeds.
    ledger["k1"] = Decimal("0.94")  # the ledger has every record finished before now
    await forget(r, prefix)
    in_flight_end = time.time() + 5  # finished after the seeding's moment T: parked, then counted
    stale_end = time.time() - 5      # finished before T: its record is in the ledger's sum already
    await budget.settle(key, type(res)(key_id="k1", reservation_id="x", amount_nano=1, period="total"),
                        Decimal("0.01"), in_flight_end)
    await budget.settle(key, type(res)(key_id="k1", reservation_id="y", amount_nano=1, period="total"),
                        Decimal("0.02"), stale_end)
    assert (await budget.status(key)).spent_usd == Decimal("0.94")  # unseeded: the ledger's figure
    with pytest.raises(InsufficientQuota) as exc:
        await budget.reserve(key, Decimal("0.06"))
    assert exc.value.spent_usd == Decimal("0.95")  # 0.94 from the ledger + 0.01 parked after T
    assert (await budget.status(key)).spent_usd == Decimal("0.95")


async def test_budget_counter_unseeded_without_a_ledger_follows_on_redis_error(env):
    prefix, r = env

    async def down(key_id: str, since, until) -> Decimal:
        raise StoreUnavailable("postgres down")

    key = ApiKey(id="k2", budget_usd=Decimal("1.00"), budget_period="daily")
    open_ = await BudgetEnforcer(r, prefix=prefix, spend_source=down).reserve(key, Decimal("0.1"))
    assert open_.degraded
    from yieldgate.pricing import LimiterUnavailable
    with pytest.raises(LimiterUnavailable):
        await BudgetEnforcer(r, prefix=prefix, spend_source=down, on_redis_error="closed").reserve(key, Decimal("0.1"))
