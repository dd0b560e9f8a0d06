"""LoRA adapters as post-trained weights: the registry of adapters and their versions, kept in
step with other gateways, and the control plane over it (push, canary, promote, rollback, remove).
Where each version is resident and the requests running on it are serving/adapter_slots.py.

Every version of an adapter is loaded into the engines under a name of its own, `name@version`,
and a request is sent to the engine under that name. A version bump loads the new version next
to the old one on every placed replica, then switches new requests to it in one step; the old
version is unloaded once the last request that was sent to it is over. So no response is ever
produced by two versions, and the version a response is labelled with is the one the engine ran
(vLLM's in-place reload would swap the weights under requests already running). It also keys
vLLM's prefix cache by version: the engine hashes blocks of a LoRA request with the adapter's name
and path, so a new version never reuses the old one's cached blocks.

Placement is `all` (every replica of the adapter's tiers) or `replicas: N` (loaded on demand: where
a request finds no replica holding it, on at most N replicas, unloading the least recently used
idle adapter when a replica's `max_loras` slots are full). The registry and residency live in
Redis (serving/adapter_store.py), so gateways that share it agree on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from typing import Iterable

import msgspec

from .adapter_slots import AdapterError, AdapterSlots, AdapterUnavailable, SlotsBusy, same_engine
from .adapter_store import (RESIDENT, Adapter, AdapterCanary, AdapterRoute, AdapterStore, AdapterVersion,
                            LocalAdapterStore, Placement, engine_name)
from .config import LoraConfig
from .fleet import Fleet, Replica
from .lora import LoraClient

# What callers import from here: the registry's names and the request path's.
__all__ = ["AdapterConflict", "AdapterError", "AdapterLoadFailed", "AdapterRoute", "AdapterSlots", "AdapterUnavailable",
           "Adapters", "SlotsBusy", "UnknownAdapter", "engine_name"]

log = logging.getLogger("yieldgate.adapters")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # no ":" (tier suffix), "@" or "/"
# How long a retired version waits for its last requests before it is unloaded regardless.
RETIRE_WAIT_S = 600.0
# After every other gateway has read an `unloading` mark: time for a request one of them routed
# just before its read to reach the engine's running/waiting counts.
UNLOAD_GRACE_S = 0.1


class UnknownAdapter(AdapterError):
    status, code = 404, "adapter_not_found"


class AdapterConflict(AdapterError):
    status, code = 409, "adapter_conflict"


class AdapterLoadFailed(AdapterError):
    """An engine refused the version (missing, unreadable or malformed adapter): nothing changed."""

    status, code = 422, "adapter_load_failed"


class Adapters:
    """The fleet's adapters: the registry, version switches, canaries and rollback; `slots`: where
    each version is resident and the requests running on it (serving/adapter_slots.py)."""

    def __init__(self, fleet: Fleet, client: LoraClient | None = None, store: AdapterStore | None = None,
                 instance_id: str = ""):
        self.fleet = fleet
        # How the store's `seen` names this process: unique even if two gateways share an instance id.
        self.instance = f"{instance_id or 'gateway'}:{uuid.uuid4().hex[:12]}"
        self.base = fleet.config.model
        self.lora: LoraConfig = fleet.config.lora
        self.client = client or LoraClient()
        self.store: AdapterStore = store or LocalAdapterStore()
        self.adapters: dict[str, Adapter] = {}
        self._routes: dict[str, AdapterRoute] = {}
        self._writes = 0                           # local changes: a read begun before one is stale
        self._tasks: set[asyncio.Task] = set()     # retiring versions, syncs
        self._canary_counts: dict[tuple[str, float], list[int]] = {}  # requests, of which to the canary
        self.slots = AdapterSlots(self, fleet, self.client)

    async def start(self, store: AdapterStore) -> None:
        """Share the registry through `store` (read now, then every `lora.sync_s`)."""
        self.store = store
        if store.shared:  # a gateway that has not read the registry yet holds up unloads too
            with contextlib.suppress(Exception):
                await store.seen(self.instance, 0)
        await self.sync()
        if store.shared:
            self._spawn(self._sync_every(self.lora.sync_s))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.slots.close()
        await self.client.close()
        with contextlib.suppress(Exception):
            await self.store.leave(self.instance)
        await self.store.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the shared registry ---------------------------------------------------------------------

    async def _sync_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.sync()

    async def sync(self) -> None:
        """Take in what other gateways wrote (a read that overlapped a change of ours is dropped:
        the next one sees both)."""
        try:
            touched = self.slots.take_touched()
            if touched:
                await self.store.used(touched)
            writes = self._writes
            got = await self.store.read()
        except Exception as exc:  # noqa: BLE001 - Redis down: keep serving what we know
            log.warning("adapter registry not read: %s: %s", type(exc).__name__, exc)
            return
        if got is None or writes != self._writes:
            return
        remote, used, version = got
        for name, fresh in remote.items():
            local = self.adapters.get(name)
            if local is None:
                self.adapters[name] = fresh
            else:  # the same object: tasks holding it see the change
                for field in fresh.__struct_fields__:
                    setattr(local, field, getattr(fresh, field))
        for name in set(self.adapters) - set(remote):
            del self.adapters[name]
            self._routes.pop(name, None)
        self.slots.merge_used(used)
        try:
            await self.store.seen(self.instance, version)  # applied: routes no longer see what it replaced
        except Exception as exc:  # noqa: BLE001 - the next sync says it again
            log.warning("adapter registry: could not record the version read: %s: %s", type(exc).__name__, exc)

    def note_change(self) -> None:
        """A local change not written yet: a read begun before it is stale."""
        self._writes += 1

    async def set_placement(self, adapter: Adapter, engine: str, replica: str, placement: Placement | None) -> int:
        """Change one residency entry here and in the store; returns the registry's version."""
        self._writes += 1
        if placement is None:
            adapter.placements.get(engine, {}).pop(replica, None)
            if not adapter.placements.get(engine, True):
                del adapter.placements[engine]
        else:
            adapter.placements.setdefault(engine, {})[replica] = placement
        return await self.store.place(adapter.name, engine, replica, placement)

    async def _save(self, adapter: Adapter) -> int:
        self._writes += 1
        return await self.store.save(adapter)

    # -- what a request is bound to ------------------------------------------------------------------

    def resolve(self, model: str) -> AdapterRoute | None:
        """The adapter (at its current version) a request's model names; None if it names none."""
        adapter = self.adapters.get(model)
        if adapter is None or not adapter.current:
            return None
        if adapter.canary is not None and self._canary_take(adapter.canary):
            return self._canary_route(adapter, adapter.canary.version)
        route = self._routes.get(model)
        if route is None or route.version != adapter.current:  # one object per version, not per request
            record = adapter.version(adapter.current)
            if record is None:
                return None
            route = self._routes[model] = AdapterRoute(adapter.name, adapter.current, record.path)
        return route

    def _canary_take(self, canary: AdapterCanary) -> bool:
        """Whether this request goes to the canary: exactly `share` of this gateway's requests for
        the adapter, spread evenly (counted here, not in the shared registry)."""
        counts = self._canary_counts.setdefault((canary.version, canary.started), [0, 0])
        counts[0] += 1
        if int(counts[0] * canary.share) > counts[1]:
            counts[1] += 1
            return True
        return False

    def _canary_route(self, adapter: Adapter, version: str) -> AdapterRoute:
        route = self.resolve_at(adapter.name, version)
        assert route is not None
        return route

    def resolve_at(self, name: str, version: str) -> AdapterRoute | None:
        """Adapter `name` at `version` (an alias pinned to a version); None if it has no such version."""
        adapter = self.adapters.get(name)
        engine = engine_name(name, version)  # never a model name: those have no "@"
        route = self._routes.get(engine)
        if route is None:
            record = adapter.version(version) if adapter is not None else None
            if record is None:
                return None
            route = self._routes[engine] = AdapterRoute(name, version, record.path)
        return route

    def names(self) -> list[str]:
        return sorted(n for n, a in self.adapters.items() if a.current)

    # -- admin -----------------------------------------------------------------------------------

    def _replicas(self, tiers: Iterable[str]) -> list[Replica]:
        wanted = set(tiers)
        return [r for r in self.fleet.replicas.values() if r.tier in wanted and not r.leaving]

    async def push(self, name: str, version: str, path: str, tiers: list[str] | None = None,
                   replicas: int = 0, canary: float | None = None) -> Adapter:
        """Load `version` of adapter `name` from `path` where it is placed (every replica of its
        tiers, or for `replicas: N` where its current version is, else on one replica), then make
        it the version requests get (with `canary`, that share of them until `promote` or
        `rollback`). A version any engine refuses changes nothing."""
        if not _NAME.match(name) or name == self.base:
            raise AdapterError(f"Invalid adapter name {name!r}: letters, digits, '.', '_' or '-' "
                               f"(at most 64), and not the base model's name.")
        if not _NAME.match(version):
            raise AdapterError(f"Invalid version {version!r}: letters, digits, '.', '_' or '-' (at most 64).")
        if not path.startswith("/"):
            raise AdapterError("path must be an absolute path to a PEFT adapter directory the engines can read.")
        if replicas < 0:
            raise AdapterError("placement.replicas must be at least 1.")
        async with self.store.lock(f"adapter:{name}"):
            await self.sync()
            adapter = self.adapters.get(name)
            known = set(self.fleet.tiers())
            if tiers is not None:
                unknown = sorted(set(tiers) - known)
                if unknown or not tiers:
                    raise AdapterError(f"tiers must name tiers of the fleet ({sorted(known)}), not {tiers}.")
            if adapter is None:
                adapter = Adapter(name=name, base=self.base, tiers=sorted(tiers or known), replicas=replicas)
            elif (tiers is not None and sorted(tiers) != adapter.tiers) or replicas != adapter.replicas:
                raise AdapterConflict(f"Adapter {name!r} is placed on tiers {adapter.tiers} "
                                      f"({_placement(adapter.replicas)}); a new version cannot move it "
                                      "(delete it first).")
            if adapter.version(version) is not None:
                raise AdapterConflict(f"Adapter {name!r} already has version {version!r}; push a new version.")
            if adapter.canary is not None:
                raise AdapterConflict(f"Version {adapter.canary.version!r} of adapter {name!r} is on canary; "
                                      "promote or roll it back first.")
            if canary is not None and not adapter.current:
                raise AdapterConflict(f"A canary needs a version of {name!r} that serves already.")
            fresh = name not in self.adapters
            record = AdapterVersion(version, path, time.time())
            adapter.versions.append(record)
            if fresh:
                self.adapters[name] = adapter  # listed as loading; not routable until it has a current version
            await self._save(adapter)
            try:
                await self._place(adapter, record)
            except AdapterLoadFailed:
                adapter.versions.remove(record)
                if fresh:
                    del self.adapters[name]
                    await self.store.drop(name)
                else:
                    await self._save(adapter)
                raise
            if canary is not None:
                adapter.canary = AdapterCanary(version, canary, time.time())
                await self._save(adapter)
                log.warning("adapter %s: version %s on canary for %.0f%% of requests", name, version, canary * 100)
                return adapter
            adapter.history.append(version)
            await self._switch(adapter, version)
            return adapter

    async def promote(self, name: str, canary: str | None = None) -> Adapter:
        """The canary version (if named, only that one) serves every request from now on."""
        async with self.store.lock(f"adapter:{name}"):
            await self.sync()
            adapter = self._get(name)
            self._check_canary(adapter, canary)
            version, adapter.canary = adapter.canary.version, None
            adapter.history.append(version)
            await self._switch(adapter, version)
            return adapter

    def _check_canary(self, adapter: Adapter, version: str | None) -> None:
        if adapter.canary is None or version not in (None, adapter.canary.version):
            named = f" {version!r}" if version else ""
            raise AdapterConflict(f"Adapter {adapter.name!r} has no version{named} on canary.")

    async def rollback(self, name: str, canary: str | None = None) -> Adapter:
        """Back to the version that was current before this one (N-1); during a canary, the
        canary's requests go back to the current version (`canary`: only if that version is on it)."""
        async with self.store.lock(f"adapter:{name}"):
            await self.sync()
            adapter = self._get(name)
            if canary is not None:
                self._check_canary(adapter, canary)
            if adapter.canary is not None:  # the trial ends; the version that serves stays
                version, adapter.canary = adapter.canary.version, None
                self._retire(adapter, engine_name(name, version), await self._save(adapter))
                return adapter
            if len(adapter.history) < 2:
                raise AdapterConflict(f"Adapter {name!r} has no earlier version to roll back to.")
            target = adapter.version(adapter.history[-2])
            assert target is not None
            await self._place(adapter, target)
            adapter.history.pop()
            await self._switch(adapter, target.version)
            return adapter

    async def remove(self, name: str) -> None:
        """Out of the registry at once (requests for it are unknown from now on); unloaded from
        the engines once the requests already sent to it are over."""
        async with self.store.lock(f"adapter:{name}"):
            await self.sync()
            adapter = self._get(name)
            self._writes += 1
            del self.adapters[name]
            self._routes.pop(name, None)
            dropped = await self.store.drop(name)
            for engine in list(adapter.placements):
                self._retire(adapter, engine, dropped)

    def _get(self, name: str) -> Adapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise UnknownAdapter(f"No adapter named {name!r}.")
        return adapter

    def _targets(self, adapter: Adapter) -> list[Replica]:
        """Where a new version goes: every replica of the tiers, or (on demand) the replicas that
        hold the current version, else the one with a free slot or the least loaded."""
        replicas = self._replicas(adapter.tiers)
        if not adapter.replicas:
            return replicas
        current = AdapterRoute(adapter.name, adapter.current, "")
        holding = [r for r in replicas if adapter.current and self.slots.holds(current, r)]
        return holding[:adapter.replicas] or self.slots.ranked(current, [r for r in replicas if r.routable])[:1]

    async def _place(self, adapter: Adapter, record: AdapterVersion) -> None:
        """Load one version where it is placed; refused anywhere, it is unloaded everywhere."""
        engine = engine_name(adapter.name, record.version)
        replicas = self._targets(adapter)
        if not replicas:
            raise AdapterLoadFailed(f"No replica in tiers {adapter.tiers} to load {engine} on.")
        results = await asyncio.gather(*(self.slots.load_on(adapter, record, r, evict=bool(adapter.replicas))
                                         for r in replicas), return_exceptions=True)
        errors = [f"{r.name}: {getattr(x, 'message', x)}" for r, x in zip(replicas, results)
                  if isinstance(x, BaseException)]
        if errors:
            # Refused somewhere: take it off the replicas that did load it, keep what served before.
            placed = adapter.placements.get(engine, {})
            await asyncio.gather(*(self.slots.unload(self.fleet.replicas[n], engine) for n, p in placed.items()
                                   if p.state == RESIDENT and n in self.fleet.replicas), return_exceptions=True)
            for replica in list(placed):
                await self.set_placement(adapter, engine, replica, None)
            raise AdapterLoadFailed(f"Version {record.version!r} of adapter {adapter.name!r} was refused: "
                                    + "; ".join(errors))

    async def _switch(self, adapter: Adapter, version: str) -> None:
        """New requests get `version` from now on; the previous version goes once it is idle."""
        previous, adapter.current = adapter.current, version
        switched = await self._save(adapter)
        log.warning("adapter %s: version %s serves (was %s)", adapter.name, version, previous or "none")
        if previous and previous != version:
            self._retire(adapter, engine_name(adapter.name, previous), switched)

    def _retire(self, adapter: Adapter, engine: str, version: int) -> None:
        """Unload `engine` once idle; `version`: the registry's version that stopped routing to it."""
        self._spawn(self._unload_when_idle(adapter, engine, version))

    async def _unload_when_idle(self, adapter: Adapter, engine: str, version: int) -> None:
        deadline = time.monotonic() + RETIRE_WAIT_S
        await self.others_saw(version)  # other gateways send it no new request
        while self.slots.in_flight(engine) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        async with self.store.lock(f"adapter:{adapter.name}"):
            await self.sync()
            if adapter.current and engine_name(adapter.name, adapter.current) == engine \
                    and self.adapters.get(adapter.name) is adapter:
                return  # rolled back to it meanwhile: it serves again
            for name in list(adapter.placements.get(engine, {})):
                replica = self.fleet.replicas.get(name)
                if replica is not None:
                    while engine in await self.slots.busy(replica) and time.monotonic() < deadline:
                        await asyncio.sleep(0.1)  # still running for another gateway's request
                    await self.slots.unload(replica, engine)
                await self.set_placement(adapter, engine, name, None)
        log.warning("adapter %s unloaded", engine)

    async def others_saw(self, version: int) -> None:
        """Wait until every other live gateway has taken in the registry at `version` (each says
        so after every sync), at most two syncs. None: go on at once. Then a short grace, for
        a request another gateway routed just before its sync to reach the engine's counts."""
        if not self.store.shared:
            await asyncio.sleep(0)  # a request routed here just now is counted on the replica first
            return
        deadline = time.monotonic() + 2 * self.lora.sync_s
        while True:
            try:
                saw = await self.store.others_saw(version, self.instance, live_s=3 * self.lora.sync_s)
            except Exception as exc:  # noqa: BLE001 - Redis trouble: fall back to waiting two syncs
                log.warning("adapter registry: %s: %s", type(exc).__name__, exc)
                saw = False
            if saw is None:
                return
            if saw or time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(0.05, self.lora.sync_s / 4))
        await asyncio.sleep(max(0.0, min(UNLOAD_GRACE_S, deadline - time.monotonic())))

    async def status(self) -> list[dict]:
        """GET /admin/adapters: each adapter's versions and where each version is."""
        await self.sync()
        out = []
        for adapter in sorted(self.adapters.values(), key=lambda a: a.name):
            doc = msgspec.to_builtins(adapter)
            del doc["placements"]
            doc["placement"] = "all" if not adapter.replicas else {"replicas": adapter.replicas}
            doc["replicas"] = {
                replica: {version: p.state for version, p in (
                    (e.split("@", 1)[1], placed.get(replica)) for e, placed in adapter.placements.items())
                    if p is not None and self._current_engine(replica, p)}
                for replica in sorted({r for placed in adapter.placements.values() for r in placed})}
            doc["replicas"] = {r: v for r, v in doc["replicas"].items() if v}
            doc["inflight"] = {e: self.slots.in_flight(e) for e in adapter.placements}
            if adapter.canary is not None:  # this gateway's requests for the adapter, and the canary's
                requests, sent = self._canary_counts.get((adapter.canary.version, adapter.canary.started), (0, 0))
                doc["canary"].update(requests=requests, sent=sent)
            out.append(doc)
        return out

    def _current_engine(self, replica: str, placement: Placement) -> bool:
        r = self.fleet.replicas.get(replica)
        return r is None or same_engine(placement, r)


def _placement(replicas: int) -> str:
    return "every replica" if not replicas else f"at most {replicas} replicas, on demand"

