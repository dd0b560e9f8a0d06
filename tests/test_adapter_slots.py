"""Which adapter a full replica unloads: an adapter's requests are counted on the replica they were
sent to, so one in flight on replica A never keeps the same adapter on replica B from being
unloaded (it did, and a load on B then failed with 503 while B held nothing in use). The engines'
LoRA calls are recorded, not made: what is checked is the registry's own choice; the engine-backed
behaviour is in tests/test_adapters_shared.py and benchmarks/adapter_routing.py --real."""

from __future__ import annotations

import asyncio

import pytest

from yieldgate.serving.adapter_store import Adapter, AdapterVersion, Placement
from yieldgate.serving.adapters import AdapterRoute, Adapters, AdapterUnavailable, SlotsBusy
from yieldgate.serving.config import FleetConfig, LoraConfig, ReplicaConfig
from yieldgate.serving.fleet import Fleet


class RecordedEngineCalls:
    """The LoRA calls the registry makes, recorded; the engines run nothing of their own."""

    def __init__(self) -> None:
        self.unloaded: list[tuple[str, str]] = []

    async def busy(self, url: str) -> set[str]:
        return set()

    async def unload(self, url: str, engine: str) -> None:
        self.unloaded.append((url, engine))

    async def load(self, url: str, engine: str, path: str) -> None:
        pass

    async def close(self) -> None:
        pass


def registry(pinned: bool = False) -> tuple[Adapters, RecordedEngineCalls, Fleet]:
    """Adapters x and y resident on replicas a and b (two slots each), placed on demand
    (or on every replica with `pinned`)."""
    fleet = Fleet(FleetConfig(model="demo", lora=LoraConfig(max_loras=2), replicas=[
        ReplicaConfig(name="a", url="http://127.0.9.1:9"), ReplicaConfig(name="b", url="http://127.0.9.2:9")]))
    calls = RecordedEngineCalls()
    adapters = Adapters(fleet, client=calls)  # type: ignore[arg-type]
    for name in ("x", "y"):
        resident = {r: Placement("resident") for r in ("a", "b")}
        adapters.adapters[name] = Adapter(name=name, base="demo", tiers=["standard"], replicas=0 if pinned else 2,
                                          versions=[AdapterVersion("v1", f"/adapters/{name}", 0.0)], current="v1",
                                          placements={f"{name}@v1": resident})
    return adapters, calls, fleet


def on_demand(name: str) -> Adapter:
    return Adapter(name=name, base="demo", tiers=["standard"], replicas=2,
                   versions=[AdapterVersion("v1", f"/adapters/{name}", 0.0)], current="v1")


def route(name: str) -> AdapterRoute:
    return AdapterRoute(name, "v1", f"/adapters/{name}")


def test_a_request_on_one_replica_does_not_keep_its_adapter_on_another():
    async def run() -> None:
        adapters, calls, fleet = registry()
        a, b = fleet.replicas["a"], fleet.replicas["b"]
        x, y = route("x"), route("y")
        adapters.slots.acquire(x)
        sent = adapters.slots.touch(x, a)                      # x in flight on a
        adapters.slots.release(y, adapters.slots.touch(y, b))        # y used on b after x: x is b's least recent
        await adapters.slots._evict_one(b, keep=set())
        assert calls.unloaded == [(b.url, "x@v1")]       # nothing of x runs on b
        await adapters.slots._evict_one(a, keep=set())
        assert calls.unloaded[-1] == (a.url, "y@v1")     # x runs on a: y goes there instead
        adapters.slots.release(x, sent)
        assert not adapters.slots._on_replica and not adapters.slots._inflight

    asyncio.run(run())


def test_a_request_retried_elsewhere_is_counted_where_it_went():
    adapters, _, fleet = registry()
    x = route("x")
    adapters.slots.acquire(x)
    sent = adapters.slots.touch(x, fleet.replicas["a"])
    sent = adapters.slots.touch(x, fleet.replicas["b"], sent)  # a failed before answering; b serves it
    assert dict(adapters.slots._on_replica) == {"b\tx@v1": 1}
    adapters.slots.release(x, sent)
    assert not adapters.slots._on_replica and not adapters.slots._inflight


@pytest.mark.parametrize("pinned", [False, True])
def test_a_replica_whose_slots_are_all_in_use_waits_only_if_one_can_free(pinned):
    """Slots held by requests in flight free when they end (SlotsBusy: the load waits); slots held by
    adapters placed on every replica never do (a 503 at once)."""
    async def run() -> None:
        adapters, calls, fleet = registry(pinned)
        a = fleet.replicas["a"]
        for name in ("x", "y"):
            adapters.slots.acquire(route(name))
            adapters.slots.touch(route(name), a)
        with pytest.raises(AdapterUnavailable) as err:
            await adapters.slots._evict_one(a, keep=set())
        assert isinstance(err.value, SlotsBusy) is not pinned
        assert calls.unloaded == []

    asyncio.run(run())


def test_loading_one_adapter_after_another_keeps_unloading_the_least_recent():
    """A load marks its adapter just used, not in use: with no request in flight, every new adapter
    on a full replica unloads the least recently used one."""
    async def run() -> None:
        adapters, calls, fleet = registry()
        a = fleet.replicas["a"]
        a.healthy = True
        for name in ("z", "w", "v"):
            adapters.adapters[name] = adapter = on_demand(name)
            await adapters.slots.load_on(adapter, adapter.versions[0], a, evict=True)
        assert [engine for url, engine in calls.unloaded if url == a.url] == ["x@v1", "y@v1", "z@v1"]
        assert not adapters.slots._on_replica

    asyncio.run(run())
