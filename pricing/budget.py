"""Budget enforcement shared by every gateway through Redis Lua scripts.

Per request: reserve() the maximum possible cost before going upstream, then settle() with the
actual cost. The check `spent + reserved + this > budget` and the reservation happen in one
script, so concurrent requests from any number of gateways can never jointly overshoot a hard
budget by more than (actual - reserved) of a request that under-estimated its maximum.
Reservations of gateways that died before settling expire after reservation_ttl_s.

Amounts are integer nano-dollars (ceil) inside Redis: Lua numbers are doubles, exact to 2^53
nano-USD (about $9M per key and period).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from decimal import ROUND_CEILING, Decimal
from typing import Literal

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .config import LimitsConfig
from .cost import Cost
from .errors import InsufficientQuota, LimiterUnavailable
from .keys import ApiKey

log = logging.getLogger(__name__)
NANO = Decimal("1e-9")

# KEYS: budget hash {spent, reserved}, reservation expiry zset, reservation amount hash
# ARGV: reservation id, amount, limit, hard (1/0), reservation ttl s, key expiry s (0: none)
_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  local a = redis.call('HGET', KEYS[3], id)
  if a then
    redis.call('HINCRBY', KEYS[1], 'reserved', '-' .. a)
    redis.call('HDEL', KEYS[3], id)
  end
  redis.call('ZREM', KEYS[2], id)
end
local spent = tonumber(redis.call('HGET', KEYS[1], 'spent') or '0')
local reserved = tonumber(redis.call('HGET', KEYS[1], 'reserved') or '0')
local amount = tonumber(ARGV[2])
local over = spent + reserved + amount > tonumber(ARGV[3])
if over and ARGV[4] == '1' then
  return {0, spent, reserved, 1}
end
redis.call('HINCRBY', KEYS[1], 'reserved', ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[5]), ARGV[1])
if tonumber(ARGV[6]) > 0 then
  for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[6]) end
end
return {1, spent, reserved + amount, over and 1 or 0}
"""

# KEYS as above. ARGV: reservation id, actual amount.
_SETTLE = """
local a = redis.call('HGET', KEYS[3], ARGV[1])
if a then
  redis.call('HINCRBY', KEYS[1], 'reserved', '-' .. a)
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
end
return redis.call('HINCRBY', KEYS[1], 'spent', ARGV[2])
"""

_PERIOD_TTL_S = {"daily": 3 * 86400, "monthly": 63 * 86400, "total": 0}


def to_nano(usd: Decimal) -> int:
    return int((usd / NANO).to_integral_value(ROUND_CEILING))


def from_nano(n: int) -> Decimal:
    return Decimal(n) * NANO


def period_id(period: str, now: float) -> str:
    if period == "daily":
        return time.strftime("d%Y-%m-%d", time.gmtime(now))
    if period == "monthly":
        return time.strftime("m%Y-%m", time.gmtime(now))
    return "total"


class Reservation(msgspec.Struct, kw_only=True):
    key_id: str
    reservation_id: str
    amount_nano: int
    period: str
    over_soft_budget: bool = False  # soft budget exceeded: gateway flags (metric/header), never rejects
    degraded: bool = False          # Redis was down and on_redis_error = "open": nothing enforced
    settled: bool = False


class BudgetStatus(msgspec.Struct):
    key_id: str
    period: str
    budget_usd: Decimal | None
    spent_usd: Decimal
    reserved_usd: Decimal


class BudgetEnforcer:
    def __init__(self, redis: aioredis.Redis, *, prefix: str = "yg:",
                 on_redis_error: Literal["open", "closed"] = "open", reservation_ttl_s: int = 600,
                 clock: Callable[[], float] = time.time) -> None:
        self.redis = redis
        self.prefix = prefix
        self.on_redis_error = on_redis_error
        self.reservation_ttl_s = reservation_ttl_s
        self.clock = clock  # period keys follow this clock (UTC)
        self._reserve = redis.register_script(_RESERVE)
        self._settle = redis.register_script(_SETTLE)
        self.redis_errors = 0

    @classmethod
    def from_config(cls, config: LimitsConfig, redis: aioredis.Redis | None = None) -> BudgetEnforcer:
        return cls(redis or aioredis.Redis.from_url(config.redis_url), prefix=config.prefix,
                   on_redis_error=config.on_redis_error, reservation_ttl_s=config.reservation_ttl_s)

    def _keys(self, key_id: str, period: str) -> list[str]:
        # {key_id} hash tag keeps the three keys in one Redis Cluster slot.
        base = f"{self.prefix}budget:{{{key_id}}}:{period}"
        return [base, base + ":resv", base + ":resv-amount"]

    async def reserve(self, key: ApiKey, max_cost: Cost | Decimal) -> Reservation:
        """Reserve a request's maximum cost; InsufficientQuota if a hard budget cannot cover it."""
        period = period_id(key.budget_period, self.clock())
        amount = to_nano(max_cost.total if isinstance(max_cost, Cost) else max_cost)
        rid = secrets.token_hex(8)
        if key.budget_usd is None:
            return Reservation(key_id=key.id, reservation_id=rid, amount_nano=0, period=period)
        try:
            ok, spent, reserved, over = await self._reserve(
                keys=self._keys(key.id, period),
                args=[rid, amount, to_nano(key.budget_usd), int(key.budget_kind == "hard"),
                      self.reservation_ttl_s, _PERIOD_TTL_S[key.budget_period]])
        except (RedisError, OSError) as e:
            return self._unavailable(key, rid, period, e)
        if not ok:
            raise InsufficientQuota(key.id, key.budget_usd, from_nano(spent), from_nano(reserved),
                                    from_nano(amount))
        return Reservation(key_id=key.id, reservation_id=rid, amount_nano=amount, period=period,
                           over_soft_budget=bool(over))

    def _unavailable(self, key: ApiKey, rid: str, period: str, e: Exception) -> Reservation:
        self.redis_errors += 1
        if self.on_redis_error == "closed":
            raise LimiterUnavailable(f"budget store unreachable: {e}") from e
        log.warning("budget store unreachable, failing open for key %s: %s", key.id, e)
        return Reservation(key_id=key.id, reservation_id=rid, amount_nano=0, period=period,
                           degraded=True)

    async def settle(self, key: ApiKey, reservation: Reservation, actual: Cost | Decimal) -> None:
        """Release the reservation and add the actual cost. Never raises on Redis errors: the
        request was already served; a lost settle leaves the reservation to expire."""
        if reservation.settled or reservation.degraded or key.budget_usd is None:
            return
        reservation.settled = True
        amount = to_nano(actual.total if isinstance(actual, Cost) else actual)
        try:
            await self._settle(keys=self._keys(key.id, reservation.period),
                               args=[reservation.reservation_id, amount])
        except (RedisError, OSError) as e:
            self.redis_errors += 1
            log.warning("budget settle failed for key %s: %s", key.id, e)

    async def status(self, key: ApiKey) -> BudgetStatus:
        period = period_id(key.budget_period, self.clock())
        spent, reserved = await self.redis.hmget(self._keys(key.id, period)[0], ["spent", "reserved"])
        return BudgetStatus(key_id=key.id, period=period, budget_usd=key.budget_usd,
                            spent_usd=from_nano(int(spent or 0)), reserved_usd=from_nano(int(reserved or 0)))
