"""Where the adapter registry and per-replica residency live, so that gateways agree on them.

`LocalAdapterStore`: one gateway's memory (and `asyncio` locks). `RedisAdapterStore`: a Redis hash of
registry entries (name -> the adapter without its placements), a hash of residency entries
(`name \\t engine name \\t replica` -> placement, written field by field so gateways that load
different adapters never overwrite each other), a hash of last-use times for LRU unloading, and
Redis locks, so two gateways never load or unload on one replica at the same time.

Every write bumps the registry's version (in one transaction with it), every read
returns the version it saw, and each gateway writes the version it has taken in (`seen`): a
gateway that marks an adapter `unloading` (or switches it to another version, or removes it)
waits until every other live gateway has read that change before unloading, not a fixed delay
(`others_saw`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Protocol

import msgspec

if TYPE_CHECKING:
    import redis.asyncio as aioredis

log = logging.getLogger("yieldgate.adapters")

LOCK_S = 300.0   # a lock's lease: longer than any engine load, released early by its holder


LOADING, RESIDENT, FAILED, UNLOADING = "loading", "resident", "failed", "unloading"


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


# The registry's records, as stored (msgpack) and as served by GET /admin/adapters.
class AdapterVersion(msgspec.Struct):
    version: str
    path: str
    created: float


class Placement(msgspec.Struct):
    """One version on one replica."""

    state: str                    # loading | resident | failed | unloading
    error: str = ""
    # The engine process it was loaded into (its start time): a restarted engine holds nothing.
    engine_started: float = 0.0


class AdapterCanary(msgspec.Struct):
    """A share of an adapter's requests sent to a new version before it is promoted."""

    version: str
    share: float                  # 0 < share < 1
    started: float                # wall clock: the outcome rule compares versions from here on


class Adapter(msgspec.Struct):
    name: str
    base: str                     # the model it adapts (the fleet's model)
    tiers: list[str]              # placed on replicas of these tiers
    replicas: int = 0             # 0: on every replica of the tiers; N: on at most N, loaded on demand
    versions: list[AdapterVersion] = []
    current: str = ""             # the version new requests get
    history: list[str] = []       # versions that were current, oldest first: rollback steps back
    # engine name (name@version) -> replica -> placement
    placements: dict[str, dict[str, Placement]] = {}
    canary: AdapterCanary | None = None  # a version on trial next to `current`

    def version(self, version: str) -> AdapterVersion | None:
        return next((v for v in self.versions if v.version == version), None)


class AdapterStore(Protocol):
    shared: bool

    async def read(self) -> tuple[dict[str, Adapter], dict[str, float], int] | None:
        """Every adapter with its placements, last-use times (`replica \\t engine` -> unix
        time) and the registry's version they are at; None when the store is this gateway's
        memory (nothing to read back)."""

    async def save(self, adapter: Adapter) -> int:
        """Write one registry entry; returns the registry's version that includes it."""

    async def drop(self, name: str) -> int: ...

    async def place(self, name: str, engine: str, replica: str, placement: Placement | None) -> int:
        """Write one residency entry; returns the registry's version that includes it."""

    async def used(self, times: dict[str, float]) -> None: ...

    async def seen(self, gateway: str, version: int) -> None:
        """`gateway` has taken in the registry up to `version` (0: it is starting)."""

    async def others_saw(self, version: int, gateway: str, live_s: float) -> bool | None:
        """Whether every gateway but `gateway` that said `seen` within `live_s` has seen
        `version`; None when there is no other such gateway."""

    async def leave(self, gateway: str) -> None: ...

    def lock(self, key: str) -> contextlib.AbstractAsyncContextManager: ...

    async def close(self) -> None: ...


class LocalAdapterStore:
    shared = False

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}

    async def read(self) -> None:
        return None

    async def save(self, adapter: Adapter) -> int:
        return 0

    async def drop(self, name: str) -> int:
        return 0

    async def place(self, name: str, engine: str, replica: str, placement: Placement | None) -> int:
        return 0

    async def used(self, times: dict[str, float]) -> None:
        pass

    async def seen(self, gateway: str, version: int) -> None:
        pass

    async def others_saw(self, version: int, gateway: str, live_s: float) -> bool | None:
        return None

    async def leave(self, gateway: str) -> None:
        pass

    def lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def close(self) -> None:
        pass


class RedisAdapterStore:
    shared = True

    def __init__(self, client: "aioredis.Redis", prefix: str):
        self.client, self.prefix = client, prefix
        self._registry, self._residency, self._used = prefix + "registry", prefix + "residency", prefix + "used"
        self._version, self._seen = prefix + "version", prefix + "seen"

    async def read(self) -> tuple[dict[str, Adapter], dict[str, float], int]:
        async with self.client.pipeline(transaction=True) as pipe:  # one snapshot, at one version
            pipe.get(self._version).hgetall(self._registry).hgetall(self._residency).hgetall(self._used)
            version, registry, residency, used = await pipe.execute()
        adapters = {k.decode(): msgspec.msgpack.decode(v, type=Adapter) for k, v in registry.items()}
        for field, value in residency.items():
            name, engine, replica = field.decode().split("\t")
            if name in adapters:
                adapters[name].placements.setdefault(engine, {})[replica] = \
                    msgspec.msgpack.decode(value, type=Placement)
        return adapters, {k.decode(): float(v) for k, v in used.items()}, int(version or 0)

    async def save(self, adapter: Adapter) -> int:
        entry = msgspec.structs.replace(adapter, placements={})
        return await self._write(lambda pipe: pipe.hset(self._registry, adapter.name, msgspec.msgpack.encode(entry)))

    async def drop(self, name: str) -> int:
        return await self._write(lambda pipe: pipe.hdel(self._registry, name))

    async def place(self, name: str, engine: str, replica: str, placement: Placement | None) -> int:
        field = f"{name}\t{engine}\t{replica}"
        if placement is None:
            return await self._write(lambda pipe: pipe.hdel(self._residency, field))
        return await self._write(lambda pipe: pipe.hset(self._residency, field, msgspec.msgpack.encode(placement)))

    async def _write(self, command: Callable[[Any], Any]) -> int:
        """One write and the version bump, in one transaction; returns the new version."""
        async with self.client.pipeline(transaction=True) as pipe:
            command(pipe)
            pipe.incr(self._version)
            return int((await pipe.execute())[-1])

    async def used(self, times: dict[str, float]) -> None:
        if times:
            await self.client.hset(self._used, mapping=times)

    # Gateways' clocks are taken to agree to well under `live_s`, as last-use times already are.
    async def seen(self, gateway: str, version: int) -> None:
        await self.client.hset(self._seen, gateway, f"{version} {time.time()}")

    async def others_saw(self, version: int, gateway: str, live_s: float) -> bool | None:
        now, others, gone = time.time(), [], []
        for key, value in (await self.client.hgetall(self._seen)).items():
            seen, at = value.decode().split()
            if key.decode() != gateway and now - float(at) < live_s:
                others.append(int(seen))
            elif now - float(at) > 100 * live_s:
                gone.append(key)  # a gateway that stopped without leaving
        if gone:
            await self.client.hdel(self._seen, *gone)
        return all(v >= version for v in others) if others else None

    async def leave(self, gateway: str) -> None:
        await self.client.hdel(self._seen, gateway)

    @contextlib.asynccontextmanager
    async def lock(self, key: str) -> AsyncIterator[None]:
        async with self.client.lock(self.prefix + "lock:" + key, timeout=LOCK_S, blocking_timeout=LOCK_S):
            yield

    async def close(self) -> None:
        await self.client.aclose()


async def open_store(redis_url: str, model: str) -> AdapterStore:
    """Redis when it answers (the registry is shared), else this gateway's memory."""
    from .redis_link import reachable_redis

    client = await reachable_redis(redis_url, "the adapter registry", socket_timeout=5)
    if client is None:
        return LocalAdapterStore()
    return RedisAdapterStore(client, f"yg:adapters:{model}:")
