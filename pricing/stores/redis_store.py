"""RedisStore: the shared ledger for multi-gateway deployments.

Layout under a prefix: `rec` hash request_id -> JSON record, `ts` sorted set request_id by ts,
`outcome:request` / `outcome:session` hashes id -> JSON outcome, `epoch` the store's mark. A Lua
script inserts each record only if its request_id is new, so replayed batches are never billed
twice, and only while `epoch` is the mark the writer knows: a Redis that restarted empty (or was
flushed) answers StoreReset, and the ledger replays its journal instead of trusting its checkpoint.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterable, Sequence
from decimal import Decimal

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ..errors import StoreReset, StoreUnavailable
from ..record import RECORD_KEYS, LedgerRecord, Outcome, OutcomeTarget

_ENC = msgspec.json.Encoder()
_REC = msgspec.json.Decoder(LedgerRecord)
_OUT = msgspec.json.Decoder(Outcome)

# KEYS: rec hash, ts zset, epoch. ARGV: expected epoch, request_id, ts, doc, request_id, ts, doc, ...
_UPSERT = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[1] then return -1 end
local added = 0
for i = 2, #ARGV, 3 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i+2]) == 1 then
    redis.call('ZADD', KEYS[2], ARGV[i+1], ARGV[i])
    added = added + 1
  end
end
return added
"""


class RedisStore:
    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "yg:ledger:",
                 client: aioredis.Redis | None = None, timeout_s: float = 2.0) -> None:
        self.prefix = prefix
        self._own_client = client is None
        self.redis = client or aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._k_rec = prefix + "rec"
        self._k_ts = prefix + "ts"
        self._k_epoch = prefix + "epoch"
        self.epoch = ""  # the mark this writer knows (mark())
        self._upsert = self.redis.register_script(_UPSERT)

    async def open(self) -> None:
        pass  # connections are made lazily; an unreachable Redis surfaces on first upsert

    async def close(self) -> None:
        if self._own_client:
            await self.redis.aclose()

    async def mark(self) -> str:
        try:
            await self.redis.set(self._k_epoch, secrets.token_hex(8), nx=True)
            epoch = await self.redis.get(self._k_epoch)
        except (RedisError, OSError) as e:
            raise StoreUnavailable(f"redis ledger store: {e}") from e
        self.epoch = epoch.decode() if epoch else ""
        return self.epoch

    async def upsert(self, docs: Sequence[bytes]) -> int:
        args: list[object] = [self.epoch]
        for doc in docs:
            k = RECORD_KEYS.decode(doc)
            args += (k.request_id, repr(k.ts), doc)
        try:
            added = int(await self._upsert(keys=[self._k_rec, self._k_ts, self._k_epoch], args=args))
        except (RedisError, OSError) as e:
            raise StoreUnavailable(f"redis ledger store: {e}") from e
        if added < 0:
            raise StoreReset(f"redis ledger store {self.prefix}: its mark {self.epoch!r} is gone")
        return added

    async def key_spend(self, key_id: str, since: float | None = None,
                        until: float | None = None) -> Decimal:
        total = Decimal(0)
        async for batch in self.scan(since, until):
            total += sum((r.cost_total for r in batch if r.key_id == key_id), Decimal(0))
        return total

    async def get(self, request_id: str) -> LedgerRecord | None:
        doc = await self.redis.hget(self._k_rec, request_id)
        return _REC.decode(doc) if doc else None

    async def count(self) -> int:
        return int(await self.redis.hlen(self._k_rec))

    async def scan(self, since: float | None = None, until: float | None = None,
                   batch: int = 1000) -> AsyncIterator[list[LedgerRecord]]:
        lo = "-inf" if since is None else repr(since)
        hi = "+inf" if until is None else f"({until!r}"  # exclusive upper bound
        offset = 0
        while True:
            ids = await self.redis.zrangebyscore(self._k_ts, lo, hi, start=offset, num=batch)
            if not ids:
                return
            offset += len(ids)
            docs = await self.redis.hmget(self._k_rec, ids)
            yield [_REC.decode(d) for d in docs if d]

    async def put_outcome(self, outcome: Outcome) -> None:
        try:
            await self.redis.hset(f"{self.prefix}outcome:{outcome.target}", outcome.target_id,
                                  _ENC.encode(outcome))
        except (RedisError, OSError) as e:
            raise StoreUnavailable(f"redis ledger store: {e}") from e

    async def get_outcomes(self, target: OutcomeTarget, ids: Iterable[str]) -> dict[str, Outcome]:
        ids = list(ids)
        found: dict[str, Outcome] = {}
        for i in range(0, len(ids), 1000):
            part = ids[i:i + 1000]
            docs = await self.redis.hmget(f"{self.prefix}outcome:{target}", part)
            found.update((tid, _OUT.decode(d)) for tid, d in zip(part, docs) if d)
        return found

    async def clear(self) -> None:
        """Delete every key under this store's prefix (tests, resets)."""
        keys = [k async for k in self.redis.scan_iter(match=self.prefix + "*")]
        if keys:
            await self.redis.delete(*keys)
