"""RPM / TPM limits per API key, shared by every gateway through one Redis Lua script.

Algorithm: sliding-window counter. Counts live in fixed windows of rate_window_s (60 s); the
usage estimate at time t is  previous_window * (1 - elapsed_fraction) + current_window,  which
smooths the burst-at-the-boundary of plain fixed windows at the cost of one extra GET. Time comes
from Redis (TIME), so gateways with skewed clocks agree. retry_after_s is when the estimate
will have room again if nothing else arrives.

TPM is admitted on an estimate (prompt tokens, known before the request); completion tokens are
added afterwards with add_tokens(), so they count against the following requests.
"""

from __future__ import annotations

import logging
from typing import Literal

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .config import LimitsConfig
from .errors import LimiterUnavailable, RateLimited
from .keys import ApiKey

log = logging.getLogger(__name__)

# KEYS[1]: rpm key base, KEYS[2]: tpm key base (window index appended; same {key} hash tag).
# ARGV: window s, rpm limit (0 = none), tpm limit (0 = none), tokens.
# Returns {allowed, limit index (1 rpm, 2 tpm), retry_after_ms}.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local w = tonumber(ARGV[1])
local idx = math.floor(now / w)
local frac = (now - idx * w) / w
local function wait_ms(base, limit, cost)
  if cost > limit then cost = limit end  -- a request bigger than the limit fits an empty window
  local cur = tonumber(redis.call('GET', base .. idx) or '0')
  local prev = tonumber(redis.call('GET', base .. (idx - 1)) or '0')
  if prev * (1 - frac) + cur + cost <= limit then return 0 end
  if cur + cost <= limit and prev > 0 then
    return math.ceil(((1 - (limit - cur - cost) / prev) - frac) * w * 1000)
  end
  -- wait for the next window, where today's count decays as the previous window
  local f2 = 0
  if cur > 0 then f2 = math.max(0, 1 - (limit - cost) / cur) end
  return math.ceil(((1 - frac) + f2) * w * 1000)
end
local limits = {tonumber(ARGV[2]), tonumber(ARGV[3])}
local costs = {1, tonumber(ARGV[4])}
for i = 1, 2 do
  if limits[i] > 0 then
    local ms = wait_ms(KEYS[i], limits[i], costs[i])
    if ms > 0 then return {0, i, ms} end
  end
end
for i = 1, 2 do
  if limits[i] > 0 and costs[i] > 0 then
    redis.call('INCRBY', KEYS[i] .. idx, costs[i])
    redis.call('EXPIRE', KEYS[i] .. idx, 2 * w + 1)
  end
end
return {1, 0, 0}
"""

# KEYS[1]: tpm key base. ARGV: window s, tokens.
_ADD = """
local t = redis.call('TIME')
local idx = math.floor((tonumber(t[1]) + tonumber(t[2]) / 1000000) / tonumber(ARGV[1]))
redis.call('INCRBY', KEYS[1] .. idx, ARGV[2])
redis.call('EXPIRE', KEYS[1] .. idx, 2 * tonumber(ARGV[1]) + 1)
return 1
"""


class RateDecision(msgspec.Struct):
    allowed: bool = True
    degraded: bool = False  # Redis down and on_redis_error = "open": not enforced


ALLOWED = RateDecision()


class RateLimiter:
    def __init__(self, redis: aioredis.Redis, *, prefix: str = "yg:", window_s: int = 60,
                 on_redis_error: Literal["open", "closed"] = "open") -> None:
        self.redis = redis
        self.prefix = prefix
        self.window_s = window_s
        self.on_redis_error = on_redis_error
        self._acquire = redis.register_script(_ACQUIRE)
        self._add = redis.register_script(_ADD)
        self.redis_errors = 0

    @classmethod
    def from_config(cls, config: LimitsConfig, redis: aioredis.Redis | None = None) -> RateLimiter:
        return cls(redis or aioredis.Redis.from_url(config.redis_url), prefix=config.prefix,
                   window_s=config.rate_window_s, on_redis_error=config.on_redis_error)

    def _bases(self, key_id: str) -> list[str]:
        return [f"{self.prefix}rl:{{{key_id}}}:rpm:", f"{self.prefix}rl:{{{key_id}}}:tpm:"]

    async def acquire(self, key: ApiKey, tokens: int = 0) -> RateDecision:
        """Count one request (and `tokens` estimated tokens) or raise RateLimited."""
        if not key.rpm and not key.tpm:
            return ALLOWED  # no limits: no Redis round trip
        try:
            ok, which, ms = await self._acquire(
                keys=self._bases(key.id), args=[self.window_s, key.rpm or 0, key.tpm or 0, tokens])
        except (RedisError, OSError) as e:
            self.redis_errors += 1
            if self.on_redis_error == "closed":
                raise LimiterUnavailable(f"rate limiter unreachable: {e}") from e
            log.warning("rate limiter unreachable, failing open for key %s: %s", key.id, e)
            return RateDecision(degraded=True)
        if not ok:
            raise RateLimited(key.id, "rpm" if which == 1 else "tpm", ms / 1000)
        return ALLOWED

    async def add_tokens(self, key: ApiKey, tokens: int) -> None:
        """Count tokens known only after the response (completion tokens). Never raises."""
        if not key.tpm or tokens <= 0:
            return
        try:
            await self._add(keys=self._bases(key.id)[1:], args=[self.window_s, tokens])
        except (RedisError, OSError) as e:
            self.redis_errors += 1
            log.warning("rate limiter add_tokens failed for key %s: %s", key.id, e)
