"""Budget enforcement shared by every gateway through Redis Lua scripts.

Per request: reserve() the maximum possible cost before going upstream, then settle() with the
actual cost. The check `spent + reserved + this > budget` and the reservation happen in one
script, so concurrent requests from any number of gateways can never jointly overshoot a hard
budget by more than (actual - reserved) of a request that under-estimated its maximum.
Reservations of gateways that died before settling expire after reservation_ttl_s.

Amounts are integer nano-dollars (ceil) inside Redis: Lua numbers are doubles, exact to 2^53
nano-USD (about $9M per key and period).

Redis is a cache of the spend; the ledger is its record. Given a spend source (the ledger), a
counter is "seeded" before it admits anything: a counter Redis does not hold (a new period, or a
Redis that lost its data) is set from the ledger's sum of the key's records before a moment T, plus
the settles of requests that finished at or after T, which an unseeded counter parks in a sorted
set by finish time. So a Redis emptied under load over-admits at most the requests whose
reservations it lost (those in flight), and the counter equals the ledger again once seeded.
"""

from __future__ import annotations

import asyncio
import calendar
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from decimal import ROUND_CEILING, Decimal
from typing import Literal

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .config import LimitsConfig
from .cost import Cost
from .errors import InsufficientQuota, LimiterUnavailable, StoreUnavailable
from .keys import ApiKey

log = logging.getLogger(__name__)
NANO = Decimal("1e-9")

# KEYS: budget hash {spent, reserved, seeded}, reservation expiry zset, reservation amount hash
# ARGV: reservation id, amount, limit, hard (1/0), reservation ttl s, key expiry s (0: none),
#       seeded counters only (1/0)
_RESERVE = """
if ARGV[7] == '1' and redis.call('HEXISTS', KEYS[1], 'seeded') == 0 then
  return {2, 0, 0, 0}
end
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

# KEYS as above + settles parked until seeding (zset "rid:amount" by finish time).
# ARGV: reservation id, actual amount, finish time, seeded counters only (1/0), key expiry s.
_SETTLE = """
local a = redis.call('HGET', KEYS[3], ARGV[1])
if a then
  redis.call('HINCRBY', KEYS[1], 'reserved', '-' .. a)
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
end
if ARGV[4] == '1' and redis.call('HEXISTS', KEYS[1], 'seeded') == 0 then
  redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1] .. ':' .. ARGV[2])
  if tonumber(ARGV[5]) > 0 then redis.call('EXPIRE', KEYS[4], ARGV[5]) end
  return 0
end
return redis.call('HINCRBY', KEYS[1], 'spent', ARGV[2])
"""

# KEYS: budget hash, parked settles. ARGV: T, ledger spend before T (nano), key expiry s.
_SEED = """
if redis.call('HEXISTS', KEYS[1], 'seeded') == 1 then return 0 end
local total = tonumber(ARGV[2])
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], ARGV[1], '+inf')) do
  total = total + tonumber(string.match(m, ':(%d+)$'))
end
redis.call('HSET', KEYS[1], 'spent', string.format('%d', total), 'seeded', '1')
redis.call('DEL', KEYS[2])
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return 1
"""

SpendSource = Callable[[str, "float | None", "float | None"], Awaitable[Decimal]]

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


def period_bounds(period: str, now: float) -> tuple[float | None, float | None]:
    """[start, end) of the budget period holding `now` (UTC); (None, None) for a lifetime budget."""
    if period == "daily":
        start = now // 86400 * 86400
        return start, start + 86400
    if period == "monthly":
        t = time.gmtime(now)
        nxt = (t.tm_year + t.tm_mon // 12, t.tm_mon % 12 + 1)
        return (float(calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))),
                float(calendar.timegm((*nxt, 1, 0, 0, 0))))
    return None, None


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
                 clock: Callable[[], float] = time.time, spend_source: SpendSource | None = None,
                 seed_delay_s: float = 0.0) -> None:
        self.redis = redis
        self.prefix = prefix
        self.on_redis_error = on_redis_error
        self.reservation_ttl_s = reservation_ttl_s
        self.clock = clock  # period keys follow this clock (UTC)
        # The ledger's spend of a key in [since, until); None: Redis is the counters' only copy.
        self.spend_source = spend_source
        # How long a seeding waits after T before it sums: records other gateways finished before T
        # reach the ledger within their flush interval.
        self.seed_delay_s = seed_delay_s
        self._seeding: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._reserve = redis.register_script(_RESERVE)
        self._settle = redis.register_script(_SETTLE)
        self._seed = redis.register_script(_SEED)
        self.redis_errors = 0
        self.seeded = 0  # counters this process seeded from the ledger

    @classmethod
    def from_config(cls, config: LimitsConfig, redis: aioredis.Redis | None = None) -> BudgetEnforcer:
        return cls(redis or aioredis.Redis.from_url(config.redis_url), prefix=config.prefix,
                   on_redis_error=config.on_redis_error, reservation_ttl_s=config.reservation_ttl_s)

    def _keys(self, key_id: str, period: str) -> list[str]:
        # {key_id} hash tag keeps the three keys in one Redis Cluster slot.
        base = f"{self.prefix}budget:{{{key_id}}}:{period}"
        return [base, base + ":resv", base + ":resv-amount", base + ":parked"]

    async def reserve(self, key: ApiKey, max_cost: Cost | Decimal) -> Reservation:
        """Reserve a request's maximum cost; InsufficientQuota if a hard budget cannot cover it."""
        period = period_id(key.budget_period, self.clock())
        amount = to_nano(max_cost.total if isinstance(max_cost, Cost) else max_cost)
        rid = secrets.token_hex(8)
        if key.budget_usd is None:
            return Reservation(key_id=key.id, reservation_id=rid, amount_nano=0, period=period)
        keys = self._keys(key.id, period)[:3]
        args = [rid, amount, to_nano(key.budget_usd), int(key.budget_kind == "hard"),
                self.reservation_ttl_s, _PERIOD_TTL_S[key.budget_period], int(self.spend_source is not None)]
        for _ in range(3):
            try:
                ok, spent, reserved, over = await self._reserve(keys=keys, args=args)
                if ok != 2:
                    break
                await self.seed(key, period)  # a counter Redis does not hold: from the ledger first
            except (RedisError, OSError, StoreUnavailable) as e:
                return self._unavailable(key, rid, period, e)
        else:
            return self._unavailable(key, rid, period, LimiterUnavailable("budget counter not seeded"))
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

    async def seed(self, key: ApiKey, period: str) -> None:
        """Set the key's counter for `period` from the ledger unless it already is (one seeding
        per key and period in this process at a time; across gateways the script keeps the first)."""
        if self.spend_source is None:
            return
        flight = self._seeding.get((key.id, period))
        if flight is None:
            flight = self._seeding[(key.id, period)] = asyncio.ensure_future(self._seed_once(key, period))
            flight.add_done_callback(lambda _: self._seeding.pop((key.id, period), None))
        await asyncio.shield(flight)

    async def _seed_once(self, key: ApiKey, period: str) -> None:
        assert self.spend_source is not None
        t = self.clock()
        if self.seed_delay_s:
            await asyncio.sleep(self.seed_delay_s)
        since, until = period_bounds(key.budget_period, t)
        spent = await self.spend_source(key.id, since, t if until is None else min(t, until))
        keys = self._keys(key.id, period)
        if await self._seed(keys=[keys[0], keys[3]], args=[repr(t), to_nano(spent), _PERIOD_TTL_S[key.budget_period]]):
            self.seeded += 1
            log.info("budget counter of key %s for %s seeded from the ledger: $%s", key.id, period, spent)

    async def settle(self, key: ApiKey, reservation: Reservation, actual: Cost | Decimal,
                     finished_at: float | None = None) -> None:
        """Release the reservation and add the actual cost. Never raises on Redis errors: the
        request was already served; a lost settle leaves the reservation to expire.
        finished_at: the ledger record's ts (an unseeded counter counts the settle by it)."""
        if reservation.settled or reservation.degraded or key.budget_usd is None:
            return
        reservation.settled = True
        amount = to_nano(actual.total if isinstance(actual, Cost) else actual)
        try:
            await self._settle(keys=self._keys(key.id, reservation.period),
                               args=[reservation.reservation_id, amount,
                                     repr(self.clock() if finished_at is None else finished_at),
                                     int(self.spend_source is not None), _PERIOD_TTL_S[key.budget_period]])
        except (RedisError, OSError) as e:
            self.redis_errors += 1
            log.warning("budget settle failed for key %s: %s", key.id, e)

    async def status(self, key: ApiKey) -> BudgetStatus:
        now = self.clock()
        period = period_id(key.budget_period, now)
        spent, reserved, seeded = await self.redis.hmget(self._keys(key.id, period)[0],
                                                         ["spent", "reserved", "seeded"])
        if seeded is None and self.spend_source is not None and key.budget_usd is not None:
            # Not seeded yet: the ledger's figure, without waiting to seed (listing many keys).
            since, until = period_bounds(key.budget_period, now)
            return BudgetStatus(key_id=key.id, period=period, budget_usd=key.budget_usd,
                                spent_usd=await self.spend_source(key.id, since, until),
                                reserved_usd=Decimal(0))
        return BudgetStatus(key_id=key.id, period=period, budget_usd=key.budget_usd,
                            spent_usd=from_nano(int(spent or 0)), reserved_usd=from_nano(int(reserved or 0)))
