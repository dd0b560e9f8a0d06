"""Before unloading an adapter to free a slot, a gateway marks it `unloading` in the shared
registry and waits until every other live gateway has read that mark (each writes the registry
version it has taken in after every sync), at most two syncs; a gateway alone does not wait.
Real Redis; the engines' LoRA calls are recorded, not made (tests/test_adapter_slots.py)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aioredis

from test_adapter_slots import RecordedEngineCalls, registry
from yieldgate.serving.adapter_store import AdapterVersion, Placement, RedisAdapterStore
from yieldgate.serving.adapters import Adapters
from yieldgate.serving.config import FleetConfig, LoraConfig
from yieldgate.serving.fleet import Fleet


async def _store(redis_url: str, prefix: str) -> RedisAdapterStore:
    return RedisAdapterStore(aioredis.from_url(redis_url), prefix)


async def _shared(adapters: Adapters, store: RedisAdapterStore) -> RedisAdapterStore:
    """`store` holding the registry `adapters` has in memory (tests/test_adapter_slots.py's)."""
    for name, adapter in adapters.adapters.items():
        await store.save(adapter)
        for engine, placed in adapter.placements.items():
            for replica, placement in placed.items():
                await store.place(name, engine, replica, placement)
    return store


async def _clean(redis_url: str, prefix: str) -> None:
    client = aioredis.from_url(redis_url)
    keys = [k async for k in client.scan_iter(match=prefix + "*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


def test_the_store_counts_versions_and_which_gateways_have_seen_them(redis_url):
    async def run() -> None:
        prefix = f"yg:test:{uuid.uuid4().hex}:"
        store = await _store(redis_url, prefix)
        try:
            v1 = await store.place("x", "x@v1", "a", Placement("resident"))
            v2 = await store.place("x", "x@v1", "a", Placement("unloading"))
            assert v2 == v1 + 1
            _, _, seen = await store.read()
            assert seen == v2
            assert await store.others_saw(v2, "me", live_s=5) is None  # nobody else
            await store.seen("me", v2)
            assert await store.others_saw(v2, "me", live_s=5) is None  # only itself
            await store.seen("other", v1)
            assert await store.others_saw(v2, "me", live_s=5) is False
            await store.seen("other", v2)
            assert await store.others_saw(v2, "me", live_s=5) is True
            await store.client.hset(prefix + "seen", "other", f"{v1} {time.time() - 60}")
            assert await store.others_saw(v2, "me", live_s=5) is None  # silent for a minute: gone
            await store.seen("other", v1)
            await store.leave("other")
            assert await store.others_saw(v2, "me", live_s=5) is None
        finally:
            await _clean(redis_url, prefix)
            await store.close()

    asyncio.run(run())


def test_a_gateway_alone_unloads_without_waiting_for_a_sync(redis_url):
    """With one sync every 30 s, two syncs' wait would be a minute; alone, nothing is waited for."""
    async def run() -> None:
        prefix = f"yg:test:{uuid.uuid4().hex}:"
        adapters, calls, fleet = registry()
        fleet.config.lora = adapters.lora = LoraConfig(max_loras=2, sync_s=30.0)
        await adapters.start(await _shared(adapters, await _store(redis_url, prefix)))
        try:
            await asyncio.wait_for(adapters.slots._evict_one(fleet.replicas["a"], keep=set()), 10)
            assert calls.unloaded == [(fleet.replicas["a"].url, "x@v1")]
        finally:
            await adapters.close()
            await _clean(redis_url, prefix)

    asyncio.run(run())


def test_a_gateway_alone_unloads_a_retired_version_without_waiting_for_a_sync(redis_url):
    """A version switch retires the previous version: with no other gateway to tell, it is unloaded
    once idle, not two syncs (a minute here) later."""
    async def run() -> None:
        prefix = f"yg:test:{uuid.uuid4().hex}:"
        adapters, calls, fleet = registry()
        fleet.config.lora = adapters.lora = LoraConfig(max_loras=2, sync_s=30.0)
        x = adapters.adapters["x"]
        x.versions.append(AdapterVersion("v2", "/adapters/x-v2", 0.0))
        x.placements["x@v2"] = {"a": Placement("resident"), "b": Placement("resident")}
        await adapters.start(await _shared(adapters, await _store(redis_url, prefix)))
        try:
            await adapters._switch(x, "v2")
            for _ in range(200):
                if len(calls.unloaded) == 2:
                    break
                await asyncio.sleep(0.05)
            assert sorted(engine for _, engine in calls.unloaded) == ["x@v1", "x@v1"]
        finally:
            await adapters.close()
            await _clean(redis_url, prefix)

    asyncio.run(run())


@pytest.mark.parametrize("other_syncs", [True, False])
def test_an_unload_waits_until_the_other_gateway_has_read_the_mark(redis_url, other_syncs):
    """Gateway one unloads x from replica b. When the engine is told, gateway two already routes no
    request of x there (it has read `unloading`). A gateway that stopped syncing holds the unload
    up for at most two syncs."""
    async def run() -> None:
        prefix = f"yg:test:{uuid.uuid4().hex}:"
        # A syncing gateway two has the whole bound (6 s) to read the mark on a loaded machine; a
        # silent one is waited for the bound alone (2 s).
        lora = LoraConfig(max_loras=2, sync_s=3.0 if other_syncs else 1.0)
        one, calls, fleet = registry()
        fleet.config.lora = one.lora = lora
        two_fleet = Fleet(FleetConfig(model="demo", lora=lora, replicas=fleet.config.replicas))
        two = Adapters(two_fleet, client=RecordedEngineCalls(), instance_id="two")  # type: ignore[arg-type]
        await one.start(await _shared(one, await _store(redis_url, prefix)))
        await two.start(await _store(redis_url, prefix))
        if not other_syncs:  # alive when it last said so, then silent
            for task in list(two._tasks):
                task.cancel()
        seen_by_two: list[str] = []

        async def unload(url: str, engine: str) -> None:
            seen_by_two.append(two.adapters["x"].placements["x@v1"]["b"].state)
            calls.unloaded.append((url, engine))

        calls.unload = unload  # type: ignore[method-assign]
        try:
            started = time.monotonic()
            await one.slots._evict_one(fleet.replicas["b"], keep=set())
            waited = time.monotonic() - started
            assert calls.unloaded == [(fleet.replicas["b"].url, "x@v1")]
            if other_syncs:
                assert seen_by_two == ["unloading"]
            else:
                assert seen_by_two == ["resident"] and waited >= 2 * lora.sync_s  # the bound, then on
        finally:
            await one.close()
            await two.close()
            await _clean(redis_url, prefix)

    asyncio.run(run())


def test_a_version_read_during_a_local_change_is_not_said_to_be_seen(redis_url):
    """`seen` follows what routing uses: a read that overlapped a change of this gateway's own is
    dropped, and so is its version."""
    async def run() -> None:
        prefix = f"yg:test:{uuid.uuid4().hex}:"
        adapters, _, _ = registry()
        store = await _shared(adapters, await _store(redis_url, prefix))
        await adapters.start(store)
        try:
            version = await adapters.set_placement(adapters.adapters["x"], "x@v1", "a", Placement("unloading"))
            read = store.read

            async def racing_read():
                got = await read()
                adapters._writes += 1  # a local change lands while the read is under way
                return got

            store.read = racing_read  # type: ignore[method-assign]
            await adapters.sync()
            mine = (await store.client.hget(prefix + "seen", adapters.instance)).decode().split()
            assert int(mine[0]) < version
            store.read = read  # type: ignore[method-assign]
            await adapters.sync()
            mine = (await store.client.hget(prefix + "seen", adapters.instance)).decode().split()
            assert int(mine[0]) == version
        finally:
            await adapters.close()
            await _clean(redis_url, prefix)

    asyncio.run(run())


def test_a_request_whose_adapter_is_unloaded_again_before_it_is_routed_loads_it_again():
    """A request for an adapter held nowhere waits for its load, then routes among the holders.
    If another request's load unloaded it meanwhile (this one was not counted on the replica
    yet), it loads it again instead of answering 503."""
    from test_adapter_slots import on_demand

    from yieldgate.gateway.app import Gateway
    from yieldgate.gateway.config import Config
    from yieldgate.gateway.apis import APIS
    from yieldgate.gateway.context import RequestContext
    from yieldgate.gateway.exchange import Exchange
    from yieldgate.gateway.intake import Intake
    from yieldgate.serving.config import FleetConfig, ReplicaConfig

    async def run() -> None:
        gateway = Gateway(Config(fleet=FleetConfig(model="demo", lora=LoraConfig(max_loras=2), replicas=[
            ReplicaConfig(name="a", url="http://127.0.9.1:9"), ReplicaConfig(name="b", url="http://127.0.9.2:9")])))
        adapters = gateway.adapters
        for replica in gateway.fleet.replicas.values():
            replica.healthy = True
        adapters.adapters["x"] = adapter = on_demand("x")
        loads: list[list[str]] = []

        async def ensure(route, replicas) -> None:
            loads.append([r.name for r in replicas])
            if len(loads) > 1:  # the first load's adapter is gone again by the time it routes
                adapter.placements["x@v1"] = {"a": Placement("resident")}

        adapters.slots.ensure = ensure  # type: ignore[method-assign]
        ctx = RequestContext(request_id="r", kind="completions", model="x", tier="standard", started=0.0,
                             adapter=adapters.resolve("x"))
        pool = gateway.models.primary
        exchange = Exchange(gateway.pipeline, pool, APIS["completions"], Intake({}, None, ctx, pool), b"")
        candidates = await exchange._candidates()
        assert [r.name for r in candidates] == ["a"] and loads == [["a", "b"], ["a", "b"]]

    asyncio.run(run())
