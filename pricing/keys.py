"""API keys: created and revoked by the admin API / CLI, stored hashed in Redis (one hash per key)
so several gateways share them. With a KeyRecord (PostgreSQL, pricing/key_record.py) the record
holds every key and Redis is its cache: written through on every change, filled from the record
on a miss, reloaded whole (reload()) when it comes back empty.

Secrets look like `yg-<key id>-<random>` and are shown once. Redis keeps only
HMAC-SHA256(pepper, secret); authentication recomputes it and compares with hmac.compare_digest.
Authenticated keys are cached per process for cache_ttl_s, so revocation reaches every gateway
within that time and the hot path usually skips the Redis round trip. The cache never holds a
secret: a verified secret is remembered by its BLAKE2b fingerprint (~0.4 µs, a fifth of the HMAC).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Literal, Protocol

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .config import LimitsConfig
from .errors import InvalidApiKey, KeyNotFound, LimiterUnavailable, StoreUnavailable

log = logging.getLogger(__name__)
SECRET_PREFIX = "yg-"
_KEY_ID = re.compile(r"[0-9a-f]{12}")  # secrets.token_hex(6)
BudgetKind = Literal["hard", "soft"]
BudgetPeriod = Literal["daily", "monthly", "total"]
_DEC = msgspec.json.Decoder()


class ApiKey(msgspec.Struct, kw_only=True):
    id: str
    team: str = ""
    name: str = ""
    budget_usd: Decimal | None = None       # None: no budget
    budget_kind: BudgetKind = "hard"        # hard rejects (429 insufficient_quota), soft only flags
    budget_period: BudgetPeriod = "monthly"  # UTC calendar day / month, or lifetime
    rpm: int | None = None                  # requests per minute, None: unlimited
    tpm: int | None = None                  # tokens per minute, None: unlimited
    created_at: float = 0.0
    revoked: bool = False


class KeyRecord(Protocol):
    """Where API keys are kept for good (pricing/key_record.py: PostgreSQL); Redis caches them."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def put(self, key: ApiKey, secret_hmac: str | None = None) -> None:
        """Insert or update a key; secret_hmac None keeps the stored one. StoreUnavailable."""
        ...

    async def get(self, key_id: str) -> tuple[ApiKey, str] | None: ...

    async def all(self, team: str | None = None) -> list[tuple[ApiKey, str]]: ...


class CreatedKey(msgspec.Struct):
    key: ApiKey
    secret: str  # shown once; only its HMAC is stored


class KeyStore:
    def __init__(self, redis: aioredis.Redis, *, pepper: str | bytes, prefix: str = "yg:",
                 cache_ttl_s: float = 5.0, on_redis_error: Literal["open", "closed"] = "open",
                 clock: Callable[[], float] = time.monotonic, record: KeyRecord | None = None) -> None:
        self.redis = redis
        self.record = record  # None: Redis is the only copy of the keys
        self.prefix = prefix
        self._pepper = pepper.encode() if isinstance(pepper, str) else pepper
        self.cache_ttl_s = cache_ttl_s
        self.on_redis_error = on_redis_error
        self._clock = clock
        # id -> (fetched_at, key, digest, BLAKE2b of the secret last verified against it, or b"")
        self._cache: dict[str, tuple[float, ApiKey, str, bytes]] = {}

    @classmethod
    def from_config(cls, config: LimitsConfig, redis: aioredis.Redis | None = None) -> KeyStore:
        return cls(redis or aioredis.Redis.from_url(config.redis_url), pepper=config.key_pepper,
                   prefix=config.prefix, cache_ttl_s=config.key_cache_ttl_s,
                   on_redis_error=config.on_redis_error)

    def _k(self, key_id: str) -> str:
        return f"{self.prefix}key:{key_id}"

    def digest(self, secret: str) -> str:
        return hmac.digest(self._pepper, secret.encode(), "sha256").hex()  # one C call; hmac.new is ~5x slower

    async def create(self, team: str = "", *, name: str = "", budget_usd: Decimal | str | None = None,
                     budget_kind: BudgetKind = "hard", budget_period: BudgetPeriod = "monthly",
                     rpm: int | None = None, tpm: int | None = None) -> CreatedKey:
        key = ApiKey(id=secrets.token_hex(6), team=team, name=name,
                     budget_usd=None if budget_usd is None else Decimal(budget_usd),
                     budget_kind=budget_kind, budget_period=budget_period, rpm=rpm, tpm=tpm,
                     created_at=time.time())
        secret = f"{SECRET_PREFIX}{key.id}-{secrets.token_urlsafe(24)}"
        digest = self.digest(secret)
        if self.record is not None:
            await self.record.put(key, digest)  # StoreUnavailable: no key whose only copy is a cache
        await self._cache_key(key, digest)
        return CreatedKey(key=key, secret=secret)

    async def _cache_key(self, key: ApiKey, digest: str) -> None:
        try:
            await self.redis.hset(self._k(key.id), mapping={
                "doc": msgspec.json.encode(key), "hash": digest, "team": key.team})
            await self.redis.sadd(self.prefix + "keys", key.id)
        except (RedisError, OSError):
            if self.record is None:
                raise
            log.warning("key %s is in the record but not cached in Redis (filled on first use)", key.id)

    async def get(self, key_id: str) -> ApiKey:
        doc = await self.redis.hget(self._k(key_id), "doc")
        if doc is not None:
            return msgspec.json.decode(doc, type=ApiKey)
        if self.record is not None and (found := await self.record.get(key_id)) is not None:
            await self._cache_key(*found)
            return found[0]
        raise KeyNotFound(key_id)

    async def update(self, key_id: str, **changes: object) -> ApiKey:
        """Change budget/limits/team of an existing key (admin API)."""
        key = msgspec.structs.replace(await self.get(key_id), **changes)
        key = msgspec.convert(msgspec.to_builtins(key), ApiKey)  # re-validate field types
        if self.record is not None:
            await self.record.put(key)
        await self.redis.hset(self._k(key_id), mapping={"doc": msgspec.json.encode(key), "team": key.team})
        self._cache.pop(key_id, None)
        return key

    async def reload(self) -> int:
        """Copy every key of the record into Redis (a Redis that came back empty); how many."""
        if self.record is None:
            return 0
        keys = await self.record.all()
        pipe = self.redis.pipeline(transaction=False)
        for key, digest in keys:
            pipe.hset(self._k(key.id), mapping={"doc": msgspec.json.encode(key), "hash": digest, "team": key.team})
        if keys:
            pipe.sadd(self.prefix + "keys", *(k.id for k, _ in keys))
        await pipe.execute()
        return len(keys)

    async def revoke(self, key_id: str) -> ApiKey:
        return await self.update(key_id, revoked=True)

    async def list(self, team: str | None = None) -> list[ApiKey]:
        if self.record is not None:
            return [k for k, _ in await self.record.all(team)]
        ids = sorted(i.decode() for i in await self.redis.smembers(self.prefix + "keys"))
        docs = [await self.redis.hget(self._k(i), "doc") for i in ids]
        keys = [msgspec.json.decode(d, type=ApiKey) for d in docs if d]
        return [k for k in keys if team is None or k.team == team]

    async def authenticate(self, secret: str) -> ApiKey:
        """The active key whose secret this is; InvalidApiKey otherwise."""
        if not secret.startswith(SECRET_PREFIX):
            raise InvalidApiKey("malformed API key")
        key_id = secret[len(SECRET_PREFIX):].split("-", 1)[0]
        cached = self._cache.get(key_id)
        fresh = cached is not None and self._clock() - cached[0] <= self.cache_ttl_s
        seen = hashlib.blake2b(secret.encode(), digest_size=32).digest()
        if fresh and cached[3] and hmac.compare_digest(cached[3], seen):  # type: ignore[index]
            # The secret this entry's digest already matched: no HMAC.
            return self._active(cached[1])  # type: ignore[index]
        presented = self.digest(secret)
        if not fresh:
            try:
                doc, stored = await self.redis.hmget(self._k(key_id), ["doc", "hash"])
            except (RedisError, OSError) as e:
                # A stale cached key is better than refusing everyone while Redis blips ("open").
                if cached is not None and self.on_redis_error == "open":
                    return self._check(cached[1], cached[2], presented)
                found = await self._from_record(key_id, e)
            else:
                found = None if doc is None else (msgspec.json.decode(doc, type=ApiKey), stored.decode())
                if found is None and self.record is not None and _KEY_ID.fullmatch(key_id):
                    # Not cached (yet, or any more). Only well-formed ids cost a record lookup.
                    found = await self._from_record(key_id, None)
                    if found is not None:
                        await self._cache_key(*found)
            if found is None:
                raise InvalidApiKey("unknown API key")
            if len(self._cache) > 100_000:
                self._cache.clear()  # bound memory under key-id spraying
            cached = (self._clock(), found[0], found[1], b"")
            self._cache[key_id] = cached
        assert cached is not None
        key = self._check(cached[1], cached[2], presented)
        if not cached[3]:
            self._cache[key_id] = (*cached[:3], seen)
        return key

    async def _from_record(self, key_id: str, redis_error: Exception | None) -> tuple[ApiKey, str] | None:
        if self.record is None:
            raise LimiterUnavailable(f"key store unreachable: {redis_error}") from redis_error
        try:
            return await self.record.get(key_id)
        except StoreUnavailable as e:
            raise LimiterUnavailable(f"key store unreachable: {redis_error or e}") from e

    @staticmethod
    def _check(key: ApiKey, stored: str, presented: str) -> ApiKey:
        if not hmac.compare_digest(stored, presented):
            raise InvalidApiKey("unknown API key")
        return KeyStore._active(key)

    @staticmethod
    def _active(key: ApiKey) -> ApiKey:
        if key.revoked:
            raise InvalidApiKey("API key revoked")
        return key

    async def delete_all(self) -> None:
        """Remove every key under this prefix (tests)."""
        for i in await self.redis.smembers(self.prefix + "keys"):
            await self.redis.delete(self._k(i.decode()))
        await self.redis.delete(self.prefix + "keys")
