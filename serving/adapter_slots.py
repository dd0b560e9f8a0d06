"""LoRA adapter slots: which replica's engine holds which adapter version, the requests for each
version on each replica, and the loads, unloads and evictions that keep a replica within its
`max_loras` slots. The registry of adapters and their versions (serving/adapters.py) decides what
should be where; this is the residency it reads and the request path's side of it.

A request for an adapter counts on its version while it runs (`acquire`/`release`) and on the
replica it was sent to (`touch`), so a full replica never unloads an adapter a request is running
there. Placed on demand, an adapter is loaded where a request finds no holder (`ensure`), spread to
one more replica under demand (`spread`), and the least recently used idle adapter makes room.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Protocol

from yieldgate.cache.scorers import adapter_affinity

from .adapter_store import (FAILED, LOADING, RESIDENT, UNLOADING, Adapter, AdapterRoute, AdapterStore,
                            AdapterVersion, Placement, engine_name)
from .config import LoraConfig
from .fleet import Fleet, Replica
from .lora import LoraClient, LoraEngineError

log = logging.getLogger("yieldgate.adapters")


class AdapterError(Exception):
    """An adapter operation refused; `status` and `code` for the admin API's answer."""

    status = 400
    code = "invalid_adapter"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class AdapterUnavailable(AdapterError):
    """A request's adapter could not be loaded on any replica in time: retry later."""

    status, code = 503, "adapter_unavailable"


class SlotsBusy(AdapterUnavailable):
    """Every slot of a replica holds an adapter with a request in flight there: one frees when
    such a request ends."""


class Registry(Protocol):
    """What the slots read and write of the adapter registry (serving/adapters.py `Adapters`)."""

    adapters: dict[str, Adapter]
    store: AdapterStore
    lora: LoraConfig

    async def sync(self) -> None: ...

    async def set_placement(self, adapter: Adapter, engine: str, replica: str, placement: Placement | None) -> int: ...

    async def others_saw(self, version: int) -> None: ...

    def note_change(self) -> None: ...


class AdapterSlots:
    """Residency of adapter versions on the fleet's replicas, and the requests running on them."""

    def __init__(self, registry: Registry, fleet: Fleet, client: LoraClient):
        self.registry = registry
        self.fleet = fleet
        self.client = client
        self._inflight: Counter[str] = Counter()   # engine name -> requests sent to it, not over
        self._on_replica: Counter[str] = Counter()  # "replica \t engine name" -> ... and to that replica
        self._used: dict[str, float] = {}          # "replica \t engine" -> last request (unix time)
        self._touched: dict[str, float] = {}       # ... not written to the store yet
        self._loads: dict[str, asyncio.Task] = {}  # engine name -> its load on demand
        self._tasks: set[asyncio.Task] = set()     # reloads after restarts
        fleet.on_restart.append(self.refill)
        fleet.on_join.append(self._joined)

    @property
    def lora(self) -> LoraConfig:
        return self.registry.lora

    async def close(self) -> None:
        tasks = self._tasks | set(self._loads.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def in_flight(self, engine: str) -> int:
        """Requests sent to the version `engine` (name@version) that are not over, through this gateway."""
        return self._inflight.get(engine, 0)

    def take_touched(self) -> dict[str, float]:
        """Last uses not written to the store yet (the registry's sync writes them)."""
        touched, self._touched = self._touched, {}
        return touched

    def merge_used(self, used: dict[str, float]) -> None:
        """Last uses other gateways wrote: least-recently-used unloading reads the latest."""
        for key, at in used.items():
            self._used[key] = max(at, self._used.get(key, 0.0))

    def acquire(self, route: AdapterRoute) -> None:
        self._inflight[route.engine_name] += 1

    def release(self, route: AdapterRoute, sent_to: str = "") -> None:
        """The request is over (`sent_to`: what `touch` returned for it, if it was sent)."""
        _count_down(self._inflight, route.engine_name)
        if sent_to:
            _count_down(self._on_replica, sent_to)

    def touch(self, route: AdapterRoute, replica: Replica, before: str = "") -> str:
        """A request for the adapter goes to `replica` (instead of `before`, where it was sent and
        failed): least-recently-used unloading reads when, and never unloads an adapter from a
        replica with a request of it in flight. Returns what `release` takes."""
        key = self._used_now(replica, route.engine_name)
        if before:
            _count_down(self._on_replica, before)
        self._on_replica[key] += 1
        return key

    def running(self, route: AdapterRoute, replica: Replica | None = None) -> int:
        """Requests for the version not over yet (on `replica`: sent there), as this gateway counts them."""
        if replica is None:
            return self._inflight.get(route.engine_name, 0)
        return self._on_replica.get(f"{replica.name}\t{route.engine_name}", 0)

    def _used_now(self, replica: Replica, engine: str) -> str:
        """The version was used on the replica now (least-recently-used unloading reads this);
        returns its "replica \t engine" key."""
        key = f"{replica.name}\t{engine}"
        self._used[key] = self._touched[key] = time.time()
        return key

    def holds(self, route: AdapterRoute, replica: Replica) -> bool:
        adapter = self.registry.adapters.get(route.name)
        if adapter is None:
            return False
        placed = adapter.placements.get(route.engine_name, {}).get(replica.name)
        return placed is not None and placed.state == RESIDENT and same_engine(placed, replica)

    def affinity(self, route: AdapterRoute, replica: Replica) -> float:
        """1 where the version is resident, 0.5 where a slot is free, 0 where loading it means
        unloading another adapter."""
        return adapter_affinity(self.holds(route, replica), len(self._resident(replica)), self.lora.max_loras)

    async def ensure(self, route: AdapterRoute, replicas: list[Replica]) -> None:
        """Load the request's adapter version on one of `replicas` (no replica of them holds it),
        waiting at most `lora.load_wait_s`; AdapterUnavailable if it cannot. Requests that arrive
        meanwhile wait for the same load."""
        key = route.engine_name if len(replicas) != 1 else f"{route.engine_name}\t{replicas[0].name}"
        task = self._loads.get(key)
        if task is None:
            task = self._loads[key] = asyncio.create_task(self._load_somewhere(route, replicas))
            task.add_done_callback(lambda t: self._loaded(key, t))
        try:
            await asyncio.wait_for(asyncio.shield(task), self.lora.load_wait_s)
        except TimeoutError:
            raise AdapterUnavailable(f"Adapter '{route.label}' did not load within {self.lora.load_wait_s:g} s; "
                                     "retry shortly.") from None

    def placement(self, route: AdapterRoute) -> tuple[list[Replica], bool]:
        """The replicas holding the version, and whether it may go on more: an adapter placed on
        demand that is on fewer replicas than it may be (cache.scorers.adapter_candidacy's `room`)."""
        adapter = self.registry.adapters.get(route.name)
        holders = [r for r in self.fleet.replicas.values() if self.holds(route, r)]
        return holders, adapter is not None and 0 < adapter.replicas and len(holders) < adapter.replicas

    def spread(self, route: AdapterRoute, replica: Replica) -> None:
        """Demand beyond its holders: load the version on `replica` too, in the background (one
        such load per version at a time)."""
        if route.engine_name in self._loads:
            return
        task = self._loads[route.engine_name] = asyncio.create_task(self._load_somewhere(route, [replica]))
        task.add_done_callback(lambda t: self._loaded(route.engine_name, t))

    def _loaded(self, engine: str, task: asyncio.Task) -> None:
        if self._loads.get(engine) is task:
            del self._loads[engine]
        if not task.cancelled() and task.exception() is not None:
            log.warning("adapter %s: %s", engine, task.exception())

    async def _load_somewhere(self, route: AdapterRoute, replicas: list[Replica]) -> None:
        adapter = self.registry.adapters.get(route.name)
        record = adapter.version(route.version) if adapter is not None else None
        if adapter is None or record is None:
            raise AdapterUnavailable(f"Adapter '{route.label}' was removed meanwhile.")
        deadline = time.monotonic() + self.lora.load_wait_s
        while True:
            errors, busy = [], False
            for replica in self.ranked(route, replicas):
                try:
                    await self.load_on(adapter, record, replica, evict=True)
                    return
                except SlotsBusy as exc:
                    busy = True
                    errors.append(f"{replica.name}: {exc.message}")
                except (AdapterError, LoraEngineError) as exc:
                    errors.append(f"{replica.name}: {getattr(exc, 'message', exc)}")
            if not busy or time.monotonic() >= deadline:
                raise AdapterUnavailable(f"Adapter '{route.label}' could not be loaded: " + ("; ".join(errors)
                                         or "no replica to load it on."))
            await asyncio.sleep(0.1)  # a slot frees when a request of a resident adapter ends

    def ranked(self, route: AdapterRoute, replicas: list[Replica]) -> list[Replica]:
        """Where to load it: a free slot before one that must be emptied, then the least loaded."""
        return sorted(replicas, key=lambda r: (-self.affinity(route, r), r.inflight))

    # -- slots on one replica ----------------------------------------------------------------------

    def _resident(self, replica: Replica) -> list[tuple[Adapter, str]]:
        """(adapter, engine name) of every version resident on the replica's current engine."""
        return [(a, e) for a in self.registry.adapters.values() for e, placed in a.placements.items()
                if (p := placed.get(replica.name)) is not None and p.state in (RESIDENT, UNLOADING)
                and same_engine(p, replica)]

    async def load_on(self, adapter: Adapter, record: AdapterVersion, replica: Replica, evict: bool) -> None:
        """Load one version on one replica (one load or unload at a time per replica, across
        gateways); with `evict`, empty a slot first when all `max_loras` are taken."""
        engine = engine_name(adapter.name, record.version)
        async with self.registry.store.lock(f"replica:{replica.name}"):
            await self.registry.sync()
            route = AdapterRoute(adapter.name, record.version, record.path)
            if self.holds(route, replica):
                return
            while evict and len(self._resident(replica)) >= self.lora.max_loras:
                keep = {engine, engine_name(adapter.name, adapter.current)}
                await self._evict_one(replica, keep)
            await self.registry.set_placement(adapter, engine, replica.name, Placement(LOADING))
            try:
                await self._load(replica, engine, record.path)
            except LoraEngineError as exc:
                await self.registry.set_placement(adapter, engine, replica.name, Placement(FAILED, str(exc)))
                raise
            await self.registry.set_placement(adapter, engine, replica.name, Placement(RESIDENT, engine_started=replica.engine_started or 0.0))
            key = self._used_now(replica, engine)  # just loaded for a request: not the next one to go
            await self.registry.store.used({key: self._used[key]})

    async def _evict_one(self, replica: Replica, keep: set[str]) -> None:
        """Unload the least recently used adapter of the replica that no request is using (here or,
        as the engine reports, through another gateway). Adapters placed on every replica stay."""
        victims = sorted(((a, e) for a, e in self._resident(replica)
                          if a.replicas and e not in keep and not self._on_replica.get(f"{replica.name}\t{e}")),
                         key=lambda ae: self._used.get(f"{replica.name}\t{ae[1]}", 0.0))
        for adapter, engine in victims:
            # Other gateways stop sending it there, then the engine must show no request of it
            # running or waiting.
            version = await self.registry.set_placement(adapter, engine, replica.name,
                                      Placement(UNLOADING, engine_started=replica.engine_started or 0.0))
            await self.registry.others_saw(version)
            if self._on_replica.get(f"{replica.name}\t{engine}") or engine in await self.client.busy(replica.url):
                await self.registry.set_placement(adapter, engine, replica.name, Placement(RESIDENT, engine_started=replica.engine_started or 0.0))
                continue
            await self.unload(replica, engine)
            await self.registry.set_placement(adapter, engine, replica.name, None)
            log.warning("adapter %s unloaded from %s (least recently used; its slot is needed)", engine, replica.name)
            return
        message = (f"All {self.lora.max_loras} adapter slots of replica {replica.name} hold "
                   "adapters that are in use or placed on every replica.")
        in_use = any(a.replicas and e not in keep for a, e in self._resident(replica))
        raise SlotsBusy(message) if in_use else AdapterUnavailable(message)

    async def _load(self, replica: Replica, engine: str, path: str) -> None:
        if not replica.healthy:
            raise LoraEngineError(replica.url, "load", 0, "replica is down")
        await self.client.load(replica.url, engine, path)

    async def unload(self, replica: Replica, engine: str) -> None:
        try:
            await self.client.unload(replica.url, engine)
        except LoraEngineError as exc:  # a down engine has forgotten its adapters anyway
            log.warning("unloading %s from %s: %s", engine, replica.name, exc)

    async def busy(self, replica: Replica) -> set[str]:
        try:
            return await self.client.busy(replica.url)
        except LoraEngineError:
            return set()  # not answering: nothing runs there

    # -- replicas that lost their adapters or never had them ------------------------------------

    def refill(self, replica: Replica) -> None:
        """The replica's engine holds none of its adapters (it restarted): every version placed
        there is loaded again; adapter requests skip the replica until it is resident there (a
        placement counts only for the engine process it was loaded into)."""
        for adapter in self.registry.adapters.values():
            wanted = [e for e, placed in adapter.placements.items() if replica.name in placed]
            if replica.tier in adapter.tiers and adapter.current and not adapter.replicas:
                wanted = list(dict.fromkeys(wanted + [engine_name(adapter.name, adapter.current)]))
            for engine in wanted:
                version = adapter.version(engine.split("@", 1)[1])
                if version is not None:
                    self.registry.note_change()  # shown as loading again at once (and written by `_reload`)
                    adapter.placements.setdefault(engine, {})[replica.name] = Placement(LOADING)
                    self._spawn(self._reload(adapter, version, replica))

    async def _joined(self, replica: Replica) -> None:
        self.refill(replica)

    async def _reload(self, adapter: Adapter, record: AdapterVersion, replica: Replica,
                      wait_s: float = 300.0) -> None:
        engine = engine_name(adapter.name, record.version)
        await self.registry.store.place(adapter.name, engine, replica.name, Placement(LOADING))
        deadline = time.monotonic() + wait_s
        while not replica.healthy and time.monotonic() < deadline:  # up, then routable
            await asyncio.sleep(0.2)
        if engine not in adapter.placements and engine_name(adapter.name, adapter.current) != engine:
            return  # retired meanwhile
        try:
            await self.load_on(adapter, record, replica, evict=False)
        except (AdapterError, LoraEngineError) as exc:
            log.warning("adapter %s on %s after its engine restarted: %s", engine, replica.name, exc)
            return
        log.warning("adapter %s on %s after its engine restarted: resident", engine, replica.name)


def same_engine(placement: Placement, replica: Replica) -> bool:
    """A placement counts only for the engine process it was loaded into."""
    return not placement.engine_started or not replica.engine_started \
        or placement.engine_started == replica.engine_started


def _count_down(counts: Counter[str], key: str) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]
