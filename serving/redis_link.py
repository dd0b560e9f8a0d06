"""The Redis that gateways share state through, when it answers: one connection attempt at start,
and a local fallback with a warning when it does not (the gateway still serves)."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

log = logging.getLogger("yieldgate.redis")


async def reachable_redis(url: str, what: str, socket_timeout: float) -> aioredis.Redis | None:
    """A client for `url` if Redis answers a ping; None (and a warning that `what` stays local to
    this gateway) if it does not."""
    client = aioredis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=socket_timeout)
    try:
        await client.ping()
    except (aioredis.RedisError, OSError) as exc:
        log.warning("Redis at %s unreachable (%s): %s stays local to this gateway", url, type(exc).__name__, what)
        await client.aclose()
        return None
    return client
