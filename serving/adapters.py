"""LoRA adapters as post-trained weights: names, versions, and which replica holds which version.

Every version of an adapter is loaded into the engines under a name of its own, `name@version`,
and a request is sent to the engine under that name. A version bump loads the new version next
to the old one on every placed replica, then switches new requests to it in one step; the old
version is unloaded once the last request that was sent to it is over. So no response is ever
produced by two versions, and the version a response is labelled with is the one the engine ran
(vLLM's in-place reload would swap the weights under requests already running). It also keys
vLLM's prefix cache by version: the engine hashes blocks of a LoRA request with the adapter's name
and path, so a new version never reuses the old one's cached blocks.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import msgspec

from .fleet import Fleet, Replica
from .lora import LoraClient, LoraEngineError

log = logging.getLogger("yieldgate.adapters")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # no ":" (tier suffix), "@" or "/"
# How long a retired version waits for its last requests before it is unloaded regardless.
RETIRE_WAIT_S = 600.0

LOADING, RESIDENT, FAILED = "loading", "resident", "failed"


class AdapterError(Exception):
    """An adapter operation refused; `status` and `code` for the admin API's answer."""

    status = 400
    code = "invalid_adapter"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class UnknownAdapter(AdapterError):
    status, code = 404, "adapter_not_found"


class AdapterConflict(AdapterError):
    status, code = 409, "adapter_conflict"


class AdapterLoadFailed(AdapterError):
    """An engine refused the version (missing, unreadable or malformed adapter): nothing changed."""

    status, code = 422, "adapter_load_failed"


class AdapterVersion(msgspec.Struct):
    version: str
    path: str
    created: float


class Placement(msgspec.Struct):
    """One version on one replica."""

    state: str                    # loading | resident | failed
    error: str = ""


class Canary(msgspec.Struct):
    """A share of an adapter's requests sent to a new version before it is promoted."""

    version: str
    share: float                  # 0 < share < 1
    started: float                # wall clock: the outcome rule compares versions from here on
    requests: int = 0             # requests for the adapter since it started
    sent: int = 0                 # ... of which the canary version got

    def take(self) -> bool:
        """Whether this request goes to the canary: exactly `share` of them, spread evenly."""
        self.requests += 1
        if int(self.requests * self.share) > self.sent:
            self.sent += 1
            return True
        return False


class Adapter(msgspec.Struct):
    name: str
    base: str                     # the model it adapts (the fleet's model)
    tiers: list[str]              # placed on every replica of these tiers
    versions: list[AdapterVersion] = []
    current: str = ""             # the version new requests get
    history: list[str] = []       # versions that were current, oldest first: rollback steps back
    # engine name (name@version) -> replica -> placement
    placements: dict[str, dict[str, Placement]] = {}
    canary: Canary | None = None  # a version on trial next to `current`

    def version(self, version: str) -> AdapterVersion | None:
        return next((v for v in self.versions if v.version == version), None)


def engine_name(name: str, version: str) -> str:
    return f"{name}@{version}"


@dataclass(frozen=True, slots=True)
class AdapterRoute:
    """What a request for an adapter carries: the version it was bound to when it arrived."""

    name: str
    version: str
    path: str                     # where the engines loaded it from (part of vLLM's block hashes)

    @property
    def engine_name(self) -> str:
        return engine_name(self.name, self.version)

    @property
    def label(self) -> str:
        """How responses and the ledger name what produced them."""
        return self.engine_name


class Adapters:
    """The fleet's adapters: registry, placement on replicas, version switches, rollback."""

    def __init__(self, fleet: Fleet, client: LoraClient | None = None):
        self.fleet = fleet
        self.base = fleet.config.model
        self.client = client or LoraClient()
        self.adapters: dict[str, Adapter] = {}
        self._inflight: Counter[str] = Counter()   # engine name -> requests sent to it, not over
        self._routes: dict[str, AdapterRoute] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._retiring: set[asyncio.Task] = set()
        self._reloads: set[asyncio.Task] = set()
        fleet.on_restart.append(self.refill)
        fleet.on_join.append(self._joined)

    async def close(self) -> None:
        tasks = self._retiring | self._reloads
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.close()

    # -- the request path --------------------------------------------------------------------------

    def resolve(self, model: str) -> AdapterRoute | None:
        """The adapter (at its current version) a request's model names; None if it names none."""
        adapter = self.adapters.get(model)
        if adapter is None or not adapter.current:
            return None
        if adapter.canary is not None and adapter.canary.take():
            return self._canary_route(adapter, adapter.canary.version)
        route = self._routes.get(model)
        if route is None or route.version != adapter.current:  # one object per version, not per request
            record = adapter.version(adapter.current)
            assert record is not None
            route = self._routes[model] = AdapterRoute(adapter.name, adapter.current, record.path)
        return route

    def _canary_route(self, adapter: Adapter, version: str) -> AdapterRoute:
        engine = engine_name(adapter.name, version)  # never a model name: those have no "@"
        route = self._routes.get(engine)
        if route is None:
            record = adapter.version(version)
            assert record is not None
            route = self._routes[engine] = AdapterRoute(adapter.name, version, record.path)
        return route

    def acquire(self, route: AdapterRoute) -> None:
        self._inflight[route.engine_name] += 1

    def release(self, route: AdapterRoute) -> None:
        name = route.engine_name
        self._inflight[name] -= 1
        if self._inflight[name] <= 0:
            del self._inflight[name]

    def holds(self, route: AdapterRoute, replica: Replica) -> bool:
        adapter = self.adapters.get(route.name)
        if adapter is None:
            return False
        placed = adapter.placements.get(route.engine_name, {}).get(replica.name)
        return placed is not None and placed.state == RESIDENT

    def names(self) -> list[str]:
        return sorted(n for n, a in self.adapters.items() if a.current)

    # -- admin -----------------------------------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _replicas(self, tiers: Iterable[str]) -> list[Replica]:
        wanted = set(tiers)
        return [r for r in self.fleet.replicas.values() if r.tier in wanted and not r.leaving]

    async def push(self, name: str, version: str, path: str, tiers: list[str] | None = None,
                   canary: float | None = None) -> Adapter:
        """Load `version` of adapter `name` from `path` on every replica of its tiers, then make it
        the version requests get (with `canary`, that share of them until `promote` or
        `rollback`). A version any engine refuses changes nothing."""
        if not _NAME.match(name) or name == self.base:
            raise AdapterError(f"Invalid adapter name {name!r}: letters, digits, '.', '_' or '-' "
                               f"(at most 64), and not the base model's name.")
        if not _NAME.match(version):
            raise AdapterError(f"Invalid version {version!r}: letters, digits, '.', '_' or '-' (at most 64).")
        if not path.startswith("/"):
            raise AdapterError("path must be an absolute path to a PEFT adapter directory the engines can read.")
        async with self._lock(name):
            adapter = self.adapters.get(name)
            known = set(self.fleet.tiers())
            if tiers is not None:
                unknown = sorted(set(tiers) - known)
                if unknown or not tiers:
                    raise AdapterError(f"tiers must name tiers of the fleet ({sorted(known)}), not {tiers}.")
            if adapter is None:
                adapter = Adapter(name=name, base=self.base, tiers=sorted(tiers or known))
            elif tiers is not None and sorted(tiers) != adapter.tiers:
                raise AdapterConflict(f"Adapter {name!r} is placed on tiers {adapter.tiers}; a new version "
                                      "cannot move it (delete it first).")
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
            try:
                await self._place(adapter, record)
            except AdapterLoadFailed:
                adapter.versions.remove(record)
                if fresh:
                    del self.adapters[name]
                raise
            if canary is not None:
                adapter.canary = Canary(version, canary, time.time())
                log.warning("adapter %s: version %s on canary for %.0f%% of requests", name, version, canary * 100)
                return adapter
            self._switch(adapter, version)
            adapter.history.append(version)
            return adapter

    async def promote(self, name: str, canary: str | None = None) -> Adapter:
        """The canary version (if named, only that one) serves every request from now on."""
        async with self._lock(name):
            adapter = self._get(name)
            self._check_canary(adapter, canary)
            version, adapter.canary = adapter.canary.version, None
            self._switch(adapter, version)
            adapter.history.append(version)
            return adapter

    def _check_canary(self, adapter: Adapter, version: str | None) -> None:
        if adapter.canary is None or version not in (None, adapter.canary.version):
            named = f" {version!r}" if version else ""
            raise AdapterConflict(f"Adapter {adapter.name!r} has no version{named} on canary.")

    async def rollback(self, name: str, canary: str | None = None) -> Adapter:
        """Back to the version that was current before this one (N-1); during a canary, the
        canary's requests go back to the current version (`canary`: only if that version is on it)."""
        async with self._lock(name):
            adapter = self._get(name)
            if canary is not None:
                self._check_canary(adapter, canary)
            if adapter.canary is not None:  # the trial ends; the version that serves stays
                version, adapter.canary = adapter.canary.version, None
                self._retire(adapter, engine_name(name, version))
                return adapter
            if len(adapter.history) < 2:
                raise AdapterConflict(f"Adapter {name!r} has no earlier version to roll back to.")
            target = adapter.version(adapter.history[-2])
            assert target is not None
            await self._place(adapter, target)
            self._switch(adapter, target.version)
            adapter.history.pop()
            return adapter

    async def remove(self, name: str) -> None:
        """Out of the registry at once (requests for it are unknown from now on); unloaded from
        the engines once the requests already sent to it are over."""
        async with self._lock(name):
            adapter = self._get(name)
            del self.adapters[name]
            self._routes.pop(name, None)
            for engine in list(adapter.placements):
                self._retire(adapter, engine)

    def _get(self, name: str) -> Adapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise UnknownAdapter(f"No adapter named {name!r}.")
        return adapter

    async def _place(self, adapter: Adapter, record: AdapterVersion) -> None:
        """Load one version on every replica of the adapter's tiers that does not hold it."""
        engine = engine_name(adapter.name, record.version)
        placed = adapter.placements.setdefault(engine, {})
        replicas = [r for r in self._replicas(adapter.tiers)
                    if placed.get(r.name) is None or placed[r.name].state != RESIDENT]
        if not self._replicas(adapter.tiers):
            raise AdapterLoadFailed(f"No replica in tiers {adapter.tiers} to load {engine} on.")
        for r in replicas:
            placed[r.name] = Placement(LOADING)
        results = await asyncio.gather(*(self._load(r, engine, record.path) for r in replicas),
                                       return_exceptions=True)
        errors = []
        for replica, result in zip(replicas, results):
            if isinstance(result, BaseException):
                placed[replica.name] = Placement(FAILED, str(result))
                errors.append(f"{replica.name}: {result}")
            else:
                placed[replica.name] = Placement(RESIDENT)
        if errors:
            # Refused somewhere: take it off the replicas that did load it, keep what served before.
            await asyncio.gather(*(self._unload(self.fleet.replicas[n], engine) for n, p in placed.items()
                                   if p.state == RESIDENT and n in self.fleet.replicas), return_exceptions=True)
            del adapter.placements[engine]
            raise AdapterLoadFailed(f"Version {record.version!r} of adapter {adapter.name!r} was refused: "
                                    + "; ".join(errors))

    async def _load(self, replica: Replica, engine: str, path: str) -> None:
        if not replica.healthy:
            raise LoraEngineError(replica.url, "load", 0, "replica is down")
        await self.client.load(replica.url, engine, path)

    async def _unload(self, replica: Replica, engine: str) -> None:
        try:
            await self.client.unload(replica.url, engine)
        except LoraEngineError as exc:  # a down engine has forgotten its adapters anyway
            log.warning("unloading %s from %s: %s", engine, replica.name, exc)

    def _switch(self, adapter: Adapter, version: str) -> None:
        """New requests get `version` from now on; the previous version goes once it is idle."""
        previous, adapter.current = adapter.current, version
        log.warning("adapter %s: version %s serves (was %s)", adapter.name, version, previous or "none")
        if previous and previous != version:
            self._retire(adapter, engine_name(adapter.name, previous))

    def _retire(self, adapter: Adapter, engine: str) -> None:
        task = asyncio.create_task(self._unload_when_idle(adapter, engine))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _unload_when_idle(self, adapter: Adapter, engine: str) -> None:
        deadline = time.monotonic() + RETIRE_WAIT_S
        while self._inflight.get(engine, 0) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        async with self._lock(adapter.name):
            if adapter.current and engine_name(adapter.name, adapter.current) == engine \
                    and self.adapters.get(adapter.name) is adapter:
                return  # rolled back to it meanwhile: it serves again
            placed = adapter.placements.pop(engine, {})
            await asyncio.gather(*(self._unload(self.fleet.replicas[n], engine) for n in placed
                                   if n in self.fleet.replicas))
        log.warning("adapter %s unloaded", engine)

    # -- replicas that lost their adapters or never had them ------------------------------------

    def refill(self, replica: Replica) -> None:
        """The replica's engine holds none of its adapters (it restarted): every version placed
        there is loading again, and adapter requests skip the replica until it is resident."""
        for adapter in self.adapters.values():
            wanted = [e for e, placed in adapter.placements.items() if replica.name in placed]
            if replica.tier in adapter.tiers and adapter.current:
                wanted = list(dict.fromkeys(wanted + [engine_name(adapter.name, adapter.current)]))
            for engine in wanted:
                version = adapter.version(engine.split("@", 1)[1])
                if version is None:
                    continue
                adapter.placements.setdefault(engine, {})[replica.name] = Placement(LOADING)
                task = asyncio.create_task(self._reload(adapter, engine, version.path, replica))
                self._reloads.add(task)
                task.add_done_callback(self._reloads.discard)

    async def _joined(self, replica: Replica) -> None:
        self.refill(replica)

    async def _reload(self, adapter: Adapter, engine: str, path: str, replica: Replica,
                      wait_s: float = 300.0) -> None:
        deadline = time.monotonic() + wait_s
        while not replica.healthy and time.monotonic() < deadline:  # up, then routable
            await asyncio.sleep(0.2)
        try:
            await self._load(replica, engine, path)
            state = Placement(RESIDENT)
        except LoraEngineError as exc:
            state = Placement(FAILED, str(exc))
        placed = adapter.placements.get(engine)
        if placed is not None and replica.name in placed:  # not retired meanwhile
            placed[replica.name] = state
            log.warning("adapter %s on %s after its engine restarted: %s", engine, replica.name, state.state)
        else:
            await self._unload(replica, engine)

    def status(self) -> list[dict]:
        """GET /admin/adapters: each adapter's versions and where each version is."""
        out = []
        for adapter in sorted(self.adapters.values(), key=lambda a: a.name):
            doc = msgspec.to_builtins(adapter)
            doc["replicas"] = {
                replica: {version: p.state for version, p in (
                    (e.split("@", 1)[1], placed.get(replica)) for e, placed in adapter.placements.items())
                    if p is not None}
                for replica in sorted({r for placed in adapter.placements.values() for r in placed})}
            doc["inflight"] = {e: self._inflight.get(e, 0) for e in adapter.placements}
            out.append(doc)
        return out
