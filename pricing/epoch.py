"""CacheEpoch: notices a Redis that lost its data (restarted without persistence, flushed, failed
over to an empty replica) by a marker it must still hold.

The first gateway to find the marker gone writes a new one (SET NX); every gateway that knew the
old one, or finds none at start, sees a different value and rebuilds what it caches there.
"""

from __future__ import annotations

import secrets

import redis.asyncio as aioredis


class CacheEpoch:
    def __init__(self, redis: aioredis.Redis, key: str = "yg:epoch") -> None:
        self.redis = redis
        self.key = key
        self.epoch: str | None = None  # the marker of the cache this process last rebuilt or found
        self._seen: str | None = None
        self._checked = False

    async def check(self) -> bool:
        """True when the cache must be rebuilt: the marker is not the one known (or, on the first
        check, there was none); call rebuilt() once it is, or the next check says so again.
        Raises Redis errors (unreachable: nothing to decide)."""
        value = await self.redis.get(self.key)
        if value is not None and value.decode() == self.epoch:
            return False
        missing = value is None
        if missing:
            await self.redis.set(self.key, secrets.token_hex(8), nx=True)
            value = await self.redis.get(self.key)
        self._seen = value.decode() if value is not None else None
        first, self._checked = not self._checked, True
        if first and not missing:
            self.epoch = self._seen  # a cache that was there before this process
            return False
        return True

    def rebuilt(self) -> None:
        self.epoch = self._seen
