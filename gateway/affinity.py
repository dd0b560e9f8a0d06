"""Which replica stored a Responses API response, so that a follow-up naming it in
`previous_response_id` reaches the engine that has it: vLLM keeps stored responses in the engine's
memory only, so any other replica answers 404.

Records go to Redis when it is reachable (every gateway in front of the fleet then agrees) and to
a bounded in-process map always (this gateway's own follow-ups need no round trip, and keep working
while Redis is away).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

import redis.asyncio as aioredis

from yieldgate.serving import Fleet, Replica

from .context import RequestContext
from .errors import PreviousResponseNotFound, ServiceUnavailable

log = logging.getLogger("yieldgate.affinity")

RECORD_TTL_S = 7 * 24 * 3600   # an engine forgets them on restart anyway
LOCAL_ENTRIES = 100_000
REDIS_TIMEOUT_S = 1.0
REDIS_RETRY_S = 5.0            # after a Redis failure, stay local this long before trying again


class ResponseAffinity:
    def __init__(self, model: str, local_entries: int = LOCAL_ENTRIES):
        self.prefix = f"yg:responses:{model}:"
        self.local_entries = local_entries
        self._local: OrderedDict[str, str] = OrderedDict()
        self._redis: aioredis.Redis | None = None
        self._redis_down_until = 0.0

    def attach(self, redis: aioredis.Redis | None) -> None:
        self._redis = redis

    async def record(self, response_id: str, replica: str) -> None:
        self._local[response_id] = replica
        self._local.move_to_end(response_id)
        while len(self._local) > self.local_entries:
            self._local.popitem(last=False)
        redis = self._usable_redis()
        if redis is not None:
            try:
                async with asyncio.timeout(REDIS_TIMEOUT_S):
                    await redis.set(self.prefix + response_id, replica, ex=RECORD_TTL_S)
            except (aioredis.RedisError, OSError, TimeoutError) as exc:
                self._redis_failed(exc)

    async def lookup(self, response_id: str) -> str | None:
        """The replica that stored `response_id`, or None if no gateway recorded it."""
        replica = self._local.get(response_id)
        if replica is not None:
            return replica
        redis = self._usable_redis()
        if redis is None:
            return None
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                found = await redis.get(self.prefix + response_id)
        except (aioredis.RedisError, OSError, TimeoutError) as exc:
            self._redis_failed(exc)
            return None
        return found.decode() if isinstance(found, bytes) else found

    async def replica(self, response_id: str, fleet: Fleet) -> Replica:
        """The replica holding a stored response; 404 when no gateway recorded it or its replica
        is gone (what OpenAI answers for an unknown previous_response_id)."""
        name = await self.lookup(response_id)
        if name is None:
            raise PreviousResponseNotFound(f"Previous response with id '{response_id}' not found.",
                                           param="previous_response_id")
        replica = fleet.replicas.get(name)
        if replica is None:
            raise PreviousResponseNotFound(
                f"Previous response with id '{response_id}' not found: replica {name}, which stored "
                "it, is no longer in the fleet.", param="previous_response_id")
        if replica.swapping:
            raise ServiceUnavailable(f"The replica holding response '{response_id}' is swapping to new "
                                     "weights. Retry shortly.", code="weight_swap_in_progress",
                                     headers={"retry-after": "1"})
        if not replica.routable:
            raise PreviousResponseNotFound(
                f"Previous response with id '{response_id}' not found: replica {replica.name}, which "
                "stored it, is not serving.", param="previous_response_id")
        return replica

    async def pin(self, ctx: RequestContext, fleet: Fleet) -> None:
        """A Responses follow-up (`previous_response_id`) may only go to the replica that stored
        the earlier response; it is priced and labelled as that replica's tier."""
        if ctx.kind == "responses" and ctx.typed.previous_response_id:
            ctx.pinned = await self.replica(ctx.typed.previous_response_id, fleet)
            ctx.serve_from(ctx.pinned.tier)

    async def remember(self, ctx: RequestContext, response: Any) -> None:
        """A Responses answer the engine stored: where follow-ups naming it must go."""
        if ctx.kind == "responses" and ctx.typed.stores and ctx.replica is not None \
                and isinstance(response, dict) and isinstance(response.get("id"), str):
            await self.record(response["id"], ctx.replica.name)

    def _usable_redis(self) -> aioredis.Redis | None:
        if self._redis is None or time.monotonic() < self._redis_down_until:
            return None
        return self._redis

    def _redis_failed(self, exc: BaseException) -> None:
        log.warning("Redis unreachable for response affinity (%s): records stay local for %.0f s",
                    type(exc).__name__, REDIS_RETRY_S)
        self._redis_down_until = time.monotonic() + REDIS_RETRY_S
