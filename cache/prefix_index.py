"""Which prefix blocks each replica likely holds in its KV cache.

A per-replica LRU of block hashes, fed by the gateway's own routing decisions (`record`) and by
the engines' KV events (`store` / `remove` / `clear`); `match(hashes)` counts each replica's
leading cached blocks. `SharedPrefixIndex` shares it between gateways through Redis (write-through
snapshot + a change channel; the hot path never waits on Redis). See docs/routing.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from typing import Any, Literal

import msgspec
from redis.exceptions import RedisError

from .blocks import BlockHash

log = logging.getLogger(__name__)

# How long local changes gather before one Redis write (and one published message) carries them.
WRITE_BATCH_S = 0.05
# Rough CPython cost of one OrderedDict entry holding an int key (node + int + slot).
_BYTES_PER_ENTRY = 120


class PrefixIndexConfig(msgspec.Struct, frozen=True):
    # Used until a replica's real capacity (kv_capacity_blocks) is known.
    default_capacity_blocks: int = 8192
    # Hard ceiling over all replicas: bounds gateway memory whatever engines report.
    max_total_blocks: int = 2_000_000
    redis_key_prefix: str = "yg:prefix"
    hash_format: Literal["int64", "bytes"] = "int64"


class IndexStats(msgspec.Struct):
    replicas: dict[str, int]  # replica -> blocks held
    capacity: dict[str, int]
    total_blocks: int
    approx_bytes: int
    recorded: int
    stored: int
    removed: int
    evicted: int
    cleared: int


class PrefixIndex:
    """In-process index: replica -> LRU of block hashes."""

    def __init__(self, config: PrefixIndexConfig = PrefixIndexConfig()) -> None:
        self.config = config
        self._blocks: dict[str, OrderedDict[BlockHash, None]] = {}
        self._capacity: dict[str, int] = {}
        self._total = 0
        # block -> replicas holding it: "does anyone else hold this?" in O(1) for the eviction scorer
        self._holders: dict[BlockHash, int] = {}
        self._counters = {"recorded": 0, "stored": 0, "removed": 0, "evicted": 0, "cleared": 0}

    # -- writes ---------------------------------------------------------
    def set_capacity(self, replica: str, capacity_blocks: int) -> None:
        self._capacity[replica] = max(1, int(capacity_blocks))
        self._evict(replica)

    def capacity(self, replica: str) -> int:
        return self._capacity.get(replica, self.config.default_capacity_blocks)

    def record(self, replica: str, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Approximate: the gateway sent these blocks to `replica`. Returns the ones it did not hold."""
        self._counters["recorded"] += len(block_hashes)
        return self._touch(replica, block_hashes)

    def store(self, replica: str, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Precise: the engine announced BlockStored. Returns the ones it did not hold."""
        self._counters["stored"] += len(block_hashes)
        return self._touch(replica, block_hashes)

    def remove(self, replica: str, block_hashes: Iterable[BlockHash]) -> None:
        """Precise: the engine announced BlockRemoved."""
        lru = self._blocks.get(replica)
        if not lru:
            return
        for h in block_hashes:
            if lru.pop(h, 0) is None:
                self._total -= 1
                self._unhold(h)
                self._counters["removed"] += 1

    def clear(self, replica: str) -> None:
        """AllBlocksCleared, an engine restart, or an event gap we cannot replay."""
        lru = self._blocks.pop(replica, None)
        if lru:
            self._total -= len(lru)
            for h in lru:
                self._unhold(h)
        self._counters["cleared"] += 1

    def forget_replica(self, replica: str) -> None:
        self.clear(replica)
        self._capacity.pop(replica, None)

    def _touch(self, replica: str, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        lru = self._blocks.get(replica)
        if lru is None:
            lru = self._blocks[replica] = OrderedDict()
        new: list[BlockHash] = []
        move = lru.move_to_end
        # Newest last, touched tail-first: vLLM frees a request's blocks in
        # reverse, so the prefix head outlives its tail under eviction.
        for h in reversed(block_hashes):
            if h in lru:
                move(h)
            else:
                lru[h] = None
                new.append(h)
                self._holders[h] = self._holders.get(h, 0) + 1
        if new:
            self._total += len(new)
            self._evict(replica)
            new.reverse()  # in prompt order
        return new

    def _evict(self, replica: str) -> None:
        lru = self._blocks.get(replica)
        if lru is None:
            return
        over = len(lru) - self.capacity(replica)
        for _ in range(max(0, over)):
            self._unhold(lru.popitem(last=False)[0])
        evicted = max(0, over)
        while self._total - evicted > self.config.max_total_blocks:
            biggest = max(self._blocks.values(), key=len)
            self._unhold(biggest.popitem(last=False)[0])
            evicted += 1
        self._total -= evicted
        self._counters["evicted"] += evicted

    def _unhold(self, h: BlockHash) -> None:
        n = self._holders.get(h, 0) - 1
        if n > 0:
            self._holders[h] = n
        else:
            self._holders.pop(h, None)

    # -- reads ----------------------------------------------------------
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """replica -> number of leading blocks of `block_hashes` it holds (0s omitted)."""
        out: dict[str, int] = {}
        if not block_hashes:
            return out
        first = block_hashes[0]
        for replica, lru in self._blocks.items():
            if first not in lru:
                continue
            n = 1
            for h in block_hashes[1:]:
                if h not in lru:
                    break
                n += 1
            out[replica] = n
        return out

    def holds(self, replica: str, block_hash: BlockHash) -> bool:
        lru = self._blocks.get(replica)
        return lru is not None and block_hash in lru

    def blocks(self, replica: str) -> list[BlockHash]:
        """Oldest first."""
        return list(self._blocks.get(replica, ()))

    def holders(self, block_hash: BlockHash) -> int:
        """How many replicas hold `block_hash`."""
        return self._holders.get(block_hash, 0)

    def eviction_victims(self, replica: str, new_blocks: int, keep: Collection[BlockHash] = ()) -> list[BlockHash]:
        """The blocks `replica` would evict, oldest first, if `new_blocks` more arrived now: its LRU
        head past its capacity. Blocks in `keep` (the request's own prefix, touched, not evicted) are
        skipped."""
        lru = self._blocks.get(replica)
        if not lru or new_blocks <= 0:
            return []
        over = len(lru) + new_blocks - self.capacity(replica)
        out: list[BlockHash] = []
        if over <= 0:
            return out
        for h in lru:
            if h in keep:
                continue
            out.append(h)
            if len(out) >= over:
                break
        return out

    def stats(self) -> IndexStats:
        replicas = {r: len(lru) for r, lru in self._blocks.items()}
        return IndexStats(
            replicas=replicas,
            capacity={r: self.capacity(r) for r in set(replicas) | set(self._capacity)},
            total_blocks=self._total,
            approx_bytes=(self._total + len(self._holders)) * _BYTES_PER_ENTRY,  # LRU entries + holder counts
            **self._counters,
        )


# Op kinds on the wire between gateways.
_RECORD, _STORE, _REMOVE, _CLEAR, _CAPACITY = "r", "s", "x", "c", "k"


class _Op(msgspec.Struct, array_like=True):
    origin: str
    kind: str
    replica: str
    hashes: list[Any] = []
    capacity: int = 0


class SharedPrefixIndex:
    """A PrefixIndex kept identical across gateway processes through Redis.

    Same read/write API as PrefixIndex; writes are local immediately and reach
    Redis from a background task (call ``await start()`` first, ``flush()`` to
    wait for pending writes, ``close()`` at shutdown).
    """

    def __init__(self, redis: Any, config: PrefixIndexConfig = PrefixIndexConfig(),
                 local: PrefixIndex | None = None) -> None:
        self.redis = redis  # redis.asyncio.Redis
        self.config = config
        self.local = local or PrefixIndex(config)
        self.origin = f"{os.getpid()}-{id(self):x}-{time.monotonic_ns()}"
        # A batch's first op names its origin within the message's first bytes (array headers, then
        # the origin string): this gateway's own batches are recognised there, without decoding them.
        # Encoded with its msgpack length header, it cannot match inside another gateway's origin.
        self._own_head = msgspec.msgpack.encode(self.origin)
        self._pending: list[_Op] = []
        self._wake = asyncio.Event()
        self._flushed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._pubsub: Any = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(list[_Op])  # one message per write batch
        self._writing = False
        self.applied_remote = 0

    @property
    def channel(self) -> str:
        return f"{self.config.redis_key_prefix}:ops"

    def _key(self, replica: str) -> str:
        return f"{self.config.redis_key_prefix}:r:{replica}"

    def _member(self, h: BlockHash) -> bytes:
        return h if isinstance(h, bytes) else str(h).encode()

    def _unmember(self, m: bytes) -> BlockHash:
        return int(m) if self.config.hash_format == "int64" else m

    async def start(self) -> None:
        """Subscribe, load the Redis snapshot into the local index, start syncing."""
        self._pubsub = self.redis.pubsub()
        await self._pubsub.subscribe(self.channel)
        await self._load_snapshot()
        self._tasks = [asyncio.create_task(self._flush_loop(), name="prefix-index-flush"),
                       asyncio.create_task(self._listen_loop(), name="prefix-index-listen")]

    async def _load_snapshot(self) -> None:
        prefix = f"{self.config.redis_key_prefix}:r:"
        caps = await self.redis.hgetall(f"{self.config.redis_key_prefix}:capacity")
        for replica, cap in caps.items():
            self.local.set_capacity(replica.decode() if isinstance(replica, bytes) else replica, int(cap))
        async for key in self.redis.scan_iter(match=prefix + "*"):
            key_s = key.decode() if isinstance(key, bytes) else key
            replica = key_s[len(prefix):]
            members = await self.redis.zrange(key_s, 0, -1)  # oldest first
            # One block at a time, oldest first, so the local LRU order matches Redis.
            for m in members:
                self.local.store(replica, [self._unmember(m)])

    async def close(self) -> None:
        await self.flush()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        if self._pubsub is not None:
            await self._pubsub.aclose()
            self._pubsub = None

    async def flush(self) -> None:
        """Wait until every local change so far is in Redis and published."""
        while (self._pending or self._writing) and self._tasks:
            self._flushed.clear()
            self._wake.set()
            await self._flushed.wait()

    # -- writes: local now, Redis soon -----------------------------------
    def _emit(self, op: _Op) -> None:
        self._pending.append(op)
        self._wake.set()

    def set_capacity(self, replica: str, capacity_blocks: int) -> None:
        if self.local._capacity.get(replica) == capacity_blocks:
            return
        self.local.set_capacity(replica, capacity_blocks)
        self._emit(_Op(self.origin, _CAPACITY, replica, [], int(capacity_blocks)))

    # Only blocks this index did not hold yet go to Redis: a hot prefix is re-recorded by every
    # request that uses it, and re-sending it would cost a Redis write per request for nothing
    # (recency of known blocks is kept locally; Redis only seeds gateways that start later).
    def record(self, replica: str, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        new = self.local.record(replica, block_hashes)
        if new:
            self._emit(_Op(self.origin, _RECORD, replica, new))
        return new

    def store(self, replica: str, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        new = self.local.store(replica, block_hashes)
        if new:
            self._emit(_Op(self.origin, _STORE, replica, new))
        return new

    def remove(self, replica: str, block_hashes: Iterable[BlockHash]) -> None:
        block_hashes = list(block_hashes)
        self.local.remove(replica, block_hashes)
        self._emit(_Op(self.origin, _REMOVE, replica, block_hashes))

    def clear(self, replica: str) -> None:
        self.local.clear(replica)
        self._emit(_Op(self.origin, _CLEAR, replica))

    # -- reads: local only ------------------------------------------------
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        return self.local.match(block_hashes)

    def holds(self, replica: str, block_hash: BlockHash) -> bool:
        return self.local.holds(replica, block_hash)

    def blocks(self, replica: str) -> list[BlockHash]:
        return self.local.blocks(replica)

    def eviction_victims(self, replica: str, new_blocks: int, keep: Collection[BlockHash] = ()) -> list[BlockHash]:
        return self.local.eviction_victims(replica, new_blocks, keep)

    def holders(self, block_hash: BlockHash) -> int:
        return self.local.holders(block_hash)

    def capacity(self, replica: str) -> int:
        return self.local.capacity(replica)

    def stats(self) -> IndexStats:
        return self.local.stats()

    # -- background sync ----------------------------------------------------
    def _apply(self, op: _Op) -> None:
        if op.kind == _RECORD:
            self.local.record(op.replica, op.hashes)
        elif op.kind == _STORE:
            self.local.store(op.replica, op.hashes)
        elif op.kind == _REMOVE:
            self.local.remove(op.replica, op.hashes)
        elif op.kind == _CLEAR:
            self.local.clear(op.replica)
        elif op.kind == _CAPACITY:
            self.local.set_capacity(op.replica, op.capacity)

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            # Let a batch gather: one pipeline and one message per batch, not per routed request
            # (this gateway receives its own messages too).
            await asyncio.sleep(WRITE_BATCH_S)
            self._wake.clear()
            ops, self._pending = self._pending, []
            if ops:
                self._writing = True
                try:
                    await self._write(ops)
                except (RedisError, OSError) as exc:  # Redis down: local routing goes on, sharing resumes later
                    log.warning("prefix index: Redis write-through failed (%s: %s); routing goes on from "
                                "the local index", type(exc).__name__, exc)
                except Exception:
                    log.exception("prefix index: Redis write-through failed")
                finally:
                    self._writing = False
            if not self._pending:
                self._flushed.set()

    async def _write(self, ops: list[_Op]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        now = time.time()
        touched: set[str] = set()
        # One ZADD per replica for a run of records (a batch holds one op per routed request, and
        # each command costs redis-py tens of µs); a remove or clear of that replica goes after
        # the adds queued before it, so Redis ends in the same state as op by op.
        adds: dict[str, dict[bytes, float]] = {}

        def queue_adds(replica: str) -> None:
            members = adds.pop(replica, None)
            if members:
                pipe.zadd(self._key(replica), members)

        for op in ops:
            key = self._key(op.replica)
            if op.kind in (_RECORD, _STORE) and op.hashes:
                # Head of the prefix newest, as in PrefixIndex._touch.
                n = len(op.hashes)
                members = adds.setdefault(op.replica, {})
                for i, h in enumerate(op.hashes):
                    members[self._member(h)] = now + (n - i) * 1e-6  # a later add of a block wins
                touched.add(op.replica)
            elif op.kind == _REMOVE and op.hashes:
                queue_adds(op.replica)
                pipe.zrem(key, *[self._member(h) for h in op.hashes])
            elif op.kind == _CLEAR:
                queue_adds(op.replica)
                pipe.delete(key)
            elif op.kind == _CAPACITY:
                pipe.hset(f"{self.config.redis_key_prefix}:capacity", op.replica, op.capacity)
                touched.add(op.replica)
        for replica in list(adds):
            queue_adds(replica)
        for replica in touched:  # same LRU bound in Redis as locally
            pipe.zremrangebyrank(self._key(replica), 0, -self.local.capacity(replica) - 1)
        pipe.publish(self.channel, self._encoder.encode(ops))
        await pipe.execute()

    async def _listen_loop(self) -> None:
        while True:
            msg = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if msg is None or msg.get("type") != "message":
                continue
            if self._own_head in msg["data"][:len(self._own_head) + 16]:
                continue  # published by this gateway: already applied locally
            try:
                ops = self._decoder.decode(msg["data"])
            except msgspec.DecodeError:
                log.warning("prefix index: undecodable op on %s", self.channel)
                continue
            for op in ops:
                if op.origin == self.origin:
                    break  # a batch comes from one gateway (kept in case the header check misses one)
                self._apply(op)
                self.applied_remote += 1
