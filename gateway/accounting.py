"""Per-request accounting: authenticate, admit (rate limits, budget reservation), then finish each
request exactly once (exact cost, ledger record, budget settle, fleet yield, metrics).

The hot path of an anonymous request (no API key) never awaits anything: admit() returns at once
and finish() prices with Decimals, appends one journal line and bumps counters. Redis is touched
only for keyed requests, and then only for the limits the key actually has.

Abandoned streams (the client left before the final usage event) are billed on an estimate:
completion tokens = content events relayed so far (one event per token for vLLM without
speculative decoding); prompt tokens = the routing layer's tokenization when it ran
(ctx.prompt_tokens), else the prompt's characters divided by the chars-per-token ratio observed on
this gateway's completed requests; cached tokens = the router's prediction. The ledger record has
status "aborted" so estimated rows can be told apart from engine-reported ones.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import math
import os
import secrets
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Coroutine

import msgspec
import redis.asyncio as aioredis
from starlette.requests import Request

from prometheus_client import Counter
from redis.exceptions import RedisError

from yieldgate.pricing import (ApiKey, BudgetEnforcer, CacheAdvisor, Cost, FleetCostMeter, InsufficientQuota,
                     InvalidApiKey, KeyStore, Ledger, LedgerConfig, LedgerError, LedgerRecord,
                     LimiterUnavailable, PostgresStore, PriceBook, RateLimited, RateLimiter, RedisStore,
                     ReplicaCost, Reservation, SQLiteStore, StoreUnavailable, Usage)
from yieldgate.pricing.epoch import CacheEpoch
from yieldgate.pricing.key_record import PostgresKeyRecord
from yieldgate.serving import Fleet, home_dir

from .errors import AuthenticationError, QuotaExceeded, ServiceUnavailable, TooManyRequests
from .http import bearer_token
from .context import RequestContext
from .metrics import GatewayMetrics
from .schemas import (ChatCompletionRequest, ChatShaped, CompletionRequest, CountTokensRequest,
                      MessagesRequest)
from .tiers import FAST, FAST_SUFFIX, STANDARD

if TYPE_CHECKING:
    from .config import Config

log = logging.getLogger("yieldgate.accounting")
_DEFAULT_LEDGER = LedgerConfig()
# Chat-template tokens around each message (role markers, separators): an upper bound for ChatML.
_TEMPLATE_TOKENS_PER_MESSAGE = 8
_INITIAL_CHARS_PER_TOKEN = 4.0   # until completed requests calibrate it
# Statuses of a stream that ended without the engine's usage: billed for the tokens relayed.
_ESTIMATED = ("aborted", "upstream_error", "shutdown")  # streams cut short: billed on what was relayed
REDIS_CONNECTIONS = 32


ADVISOR_SAMPLE = 8  # one session-less request in 8 goes through the cache advisor


@dataclass(slots=True)
class TierTotals:
    """Running totals per (tier, model) since start: the dashboard's and gauges' source."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    revenue: Decimal = Decimal(0)


@dataclass(slots=True)
class ClassSpeed:
    """One (tier asked for, workload class) since start: output tokens per second of request time,
    and what was billed against what the standard price would have been (the dashboard's fast-tier
    speed-up and price multiple per class)."""

    requests: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    billed: Decimal = Decimal(0)
    at_standard: Decimal = Decimal(0)
    served_as_asked: int = 0       # not moved to another tier (speculation filter, failover)


def workload_class(ctx: RequestContext) -> str:
    """What the gateway can tell of a request's workload: its API and greedy or sampled decoding
    (what decides whether speculation pays, docs/routing.md#speculation)."""
    temperature = ctx.typed.temperature if ctx.typed is not None else None
    return f"{ctx.kind}, {'greedy' if temperature == 0 else 'sampled'}"


_WITH_MESSAGES = (ChatCompletionRequest, MessagesRequest, CountTokensRequest)


def prompt_size(typed: Any) -> tuple[int, int, int | None]:
    """(characters, UTF-8 byte upper bound, exact token count if the prompt is token ids)."""
    chars = upper = 0
    texts: list[str] = []
    if isinstance(typed, ChatShaped):  # Responses and Messages requests, as the chat template sees them
        for m in typed.chat_messages():
            upper += _TEMPLATE_TOKENS_PER_MESSAGE
            texts.append(m["content"])
    elif isinstance(typed, ChatCompletionRequest):
        for m in typed.messages:
            upper += _TEMPLATE_TOKENS_PER_MESSAGE
            content = m.content
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(p["text"] for p in content
                             if isinstance(p, dict) and isinstance(p.get("text"), str))
    elif isinstance(typed, CompletionRequest):
        prompt = typed.prompt
        if isinstance(prompt, str):
            texts.append(prompt)
        elif isinstance(prompt, list) and prompt:
            if all(isinstance(t, int) for t in prompt):
                return 0, len(prompt), len(prompt)
            if all(isinstance(p, list) for p in prompt):
                n = sum(len(p) for p in prompt)
                return 0, n, n
            texts.extend(p for p in prompt if isinstance(p, str))
    for t in texts:
        chars += len(t)
        upper += len(t) if t.isascii() else 4 * len(t)
    return chars, upper + _TEMPLATE_TOKENS_PER_MESSAGE, None


def usd(amount: Decimal) -> str:
    """0E-9 -> "0", 0.000092500 -> "0.0000925" (fixed point, no exponent)."""
    return format(amount.normalize(), "f")


def local_pepper(root: Path) -> str:
    """A per-installation secret for key hashes, created once, readable only by its owner."""
    path = root / "key-pepper"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        root.mkdir(parents=True, exist_ok=True)
        pepper = secrets.token_hex(32)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another gateway process won the race
            return path.read_text().strip()
        with os.fdopen(fd, "w") as f:
            f.write(pepper)
        return pepper


def data_dir(config: "Config") -> Path:
    return Path(config.server.data_dir).expanduser() if config.server.data_dir else home_dir() / "data"


@dataclass(slots=True)
class _Children:
    """Labelled metric children of one (tier, model): .labels() costs microseconds per call."""

    prompt: Any
    cached: Any
    uncached: Any
    completion: Any
    cost_uncached: Any
    cost_cached: Any
    cost_output: Any
    predicted_cached: Any
    prediction_error: Any

    @classmethod
    def bind(cls, m: GatewayMetrics, tier: str, model: str) -> "_Children":
        return cls(m.tokens.labels("prompt", tier, model), m.tokens.labels("cached", tier, model),
                   m.tokens.labels("uncached", tier, model), m.tokens.labels("completion", tier, model),
                   m.cost.labels("uncached_input", tier, model), m.cost.labels("cached_input", tier, model),
                   m.cost.labels("output", tier, model), m.predicted_cached.labels(tier),
                   m.prediction_error.labels(tier))


def served_target(ctx: RequestContext) -> str:
    """What served the request, as a client names it: the adapter, or the model (":fast" for a
    request that asked for the fast tier); what `auto` chooses among (docs/models.md#auto)."""
    name = ctx.adapter.name if ctx.adapter is not None else ctx.model
    return name + FAST_SUFFIX if (ctx.requested_tier or ctx.tier) == FAST else name


class Accounting:
    """Where requests are authenticated, admitted and, once finished, priced and recorded."""

    def __init__(self, config: "Config", metrics: GatewayMetrics, fleet: Fleet | None = None,
                 instance_id: str = ""):
        self.config = config
        self.instance_id = instance_id  # the gateway named in each ledger record
        self.metrics = metrics
        self.fleet = fleet
        pricing = config.pricing
        self.price_book = PriceBook(pricing)
        replicas = dict(pricing.replicas)
        for fleet_config in config.fleets:  # [fleet] cost_per_hour unless [pricing.replicas] says
            for r in fleet_config.replicas:
                replicas.setdefault(r.name, ReplicaCost(hourly_usd=Decimal(r.cost_per_hour or "0"),
                                                        tier=r.tier, model=fleet_config.model))
        self.fleet_cost = FleetCostMeter(msgspec.structs.replace(pricing, replicas=replicas))
        self.advisor = CacheAdvisor()
        self._advisor_sample = itertools.count()
        self.totals: dict[tuple[str, str], TierTotals] = {}
        self.speeds: dict[tuple[str, str], ClassSpeed] = {}
        self._children: dict[tuple[str, str], _Children] = {}
        self._request_children: dict[tuple[str, str, str], tuple[Any, Any, Any]] = {}
        self.chars_per_token = _INITIAL_CHARS_PER_TOKEN
        self.redis: aioredis.Redis | None = None
        self.keys: KeyStore | None = None
        self.budget: BudgetEnforcer | None = None
        self.limiter: RateLimiter | None = None
        self.ledger: Ledger | None = None
        self.epoch: CacheEpoch | None = None
        self._epoch_task: asyncio.Task[None] | None = None
        self.cache_rebuilds = Counter(
            "yieldgate_cache_rebuilds_total", "Times Redis was found without its data (epoch marker "
            "gone) and rebuilt: keys reloaded from PostgreSQL, budget counters re-seeded from the ledger",
            registry=metrics.registry)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._admin_token = config.server.admin_token.encode()
        self._request_metrics = config.server.request_metrics
        # Every tier of every model must have a price, or finish() could not bill it.
        for fleet_config in config.fleets:
            for tier in fleet_config.tier_names():
                self.price_book.price(fleet_config.model, tier)
        metrics.on_render(self.refresh_gauges)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        limits = self.config.pricing.limits
        # A bounded pool: a burst of keyed requests queues for a connection instead of opening
        # dozens at once (connect timeouts under load would make budgets fail open).
        pool = aioredis.BlockingConnectionPool.from_url(
            self.config.server.redis_url, max_connections=REDIS_CONNECTIONS, timeout=5.0,
            socket_timeout=5.0, socket_connect_timeout=5.0)
        self.redis = aioredis.Redis(connection_pool=pool)
        postgres_url = self.config.server.postgres_url
        record = PostgresKeyRecord(postgres_url) if postgres_url else None
        if record is not None:
            await record.open()
        self.keys = KeyStore(self.redis, pepper=limits.key_pepper or local_pepper(data_dir(self.config)),
                             prefix=limits.prefix, record=record,
                             cache_ttl_s=limits.key_cache_ttl_s, on_redis_error=limits.on_redis_error)
        self.ledger = await self._start_ledger() if self.config.server.ledger else None
        # Budget counters are a cache of the ledger's spend when there is a ledger to read.
        self.budget = BudgetEnforcer(self.redis, prefix=limits.prefix,
                                     on_redis_error=limits.on_redis_error,
                                     reservation_ttl_s=limits.reservation_ttl_s,
                                     spend_source=self._ledger_spend if self.ledger is not None else None,
                                     seed_delay_s=self.config.pricing.ledger.flush_interval_s + 0.1)
        self.limiter = RateLimiter(self.redis, prefix=limits.prefix, window_s=limits.rate_window_s,
                                   on_redis_error=limits.on_redis_error)
        self.epoch = CacheEpoch(self.redis, limits.prefix + "epoch")
        await self._check_cache()
        self._epoch_task = asyncio.create_task(self._watch_cache(), name="yieldgate-cache-epoch")

    async def _ledger_spend(self, key_id: str, since: float | None, until: float | None) -> Decimal:
        """A key's spend in [since, until) as the ledger has it, this gateway's records included."""
        assert self.ledger is not None
        await self.ledger.flush_verified(timeout=5.0)  # StoreUnavailable: the counter stays unseeded
        return await self.ledger.store.key_spend(key_id, since, until)

    async def _watch_cache(self) -> None:
        while True:
            await asyncio.sleep(self.config.server.cache_check_s)
            try:
                await self._check_cache()
            except Exception:  # the watch must outlive any one failure, or a loss goes unnoticed
                log.exception("cache epoch check failed")

    async def _check_cache(self) -> None:
        """A Redis without the epoch marker lost its data: reload the keys from their record and
        have the ledger check its store (counters re-seed themselves from the ledger on first use)."""
        assert self.epoch is not None and self.keys is not None
        try:
            if not await self.epoch.check():
                return
            reloaded = await self.keys.reload()
        except (RedisError, OSError, StoreUnavailable) as exc:
            log.warning("cache epoch check or rebuild failed, tried again in %.1f s: %s",
                        self.config.server.cache_check_s, exc)
            return
        self.epoch.rebuilt()
        self.cache_rebuilds.inc()
        if self.ledger is not None:
            self.ledger.verify_store()
        log.warning("Redis holds no epoch marker (new or emptied): rebuilt its cache, %d API keys reloaded "
                    "from the record; budget counters are re-seeded from the ledger on first use", reloaded)

    async def _start_ledger(self) -> Ledger:
        cfg = self.config.pricing.ledger
        root = data_dir(self.config)
        journal = Path(cfg.journal_dir).expanduser() if cfg.journal_dir != _DEFAULT_LEDGER.journal_dir \
            else root / "journal"
        # A journal belongs to one process (flock). A second gateway on the same data dir gets a
        # journal of its own, named after its port so that its restart replays it.
        for directory in (journal, journal.with_name(f"{journal.name}-{self.config.server.port}")):
            if cfg.store == "redis":
                url = self.config.server.redis_url if cfg.redis_url == _DEFAULT_LEDGER.redis_url else cfg.redis_url
                store: Any = RedisStore(url, cfg.redis_prefix)
            elif cfg.store == "postgres":
                store = PostgresStore(cfg.postgres_url or self.config.server.postgres_url,
                                      retention_days=cfg.retention_days)
            else:
                store = SQLiteStore(cfg.sqlite_path or root / "ledger.sqlite3")
            ledger = Ledger(store, directory, flush_interval_s=cfg.flush_interval_s,
                            batch_size=cfg.batch_size, compact_bytes=cfg.compact_bytes,
                            retry_backoff_s=cfg.retry_backoff_s)
            try:
                await ledger.start()
                return ledger
            except LedgerError as exc:
                await store.close()
                log.warning("%s; trying a journal of this gateway's own", exc)
        raise LedgerError(f"no usable ledger journal under {journal.parent}")

    async def close(self) -> None:
        if self._epoch_task is not None:
            self._epoch_task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=10)
        if self.ledger is not None:
            await self.ledger.close()
        if self.keys is not None and self.keys.record is not None:
            await self.keys.record.close()
        if self.redis is not None:
            await self.redis.aclose()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- before routing ----------------------------------------------------------------------------

    def is_admin_token(self, token: str) -> bool:
        return bool(self._admin_token and token) and hmac.compare_digest(token.encode(), self._admin_token)

    async def authenticate(self, request: Request) -> ApiKey | None:
        """The API key of an inference request; None for an anonymous request in open mode."""
        return await self.authenticate_header(dict(request.scope["headers"]).get(b"authorization"))

    async def authenticate_header(self, raw: bytes | None) -> ApiKey | None:
        """The API key named by a raw Authorization header value (None: no header).

        yg- secrets are always checked (a typo'd or revoked key fails loudly instead of running
        unbudgeted). Other bearer tokens are ignored in open mode (OpenAI clients always send
        one), so anonymous requests never cost a Redis round trip."""
        header = raw.decode("latin-1") if raw else ""
        token = bearer_token(header)
        if token and self.is_admin_token(token):
            raise AuthenticationError("The admin token is not an API key.")
        if not token.startswith("yg-"):
            if not self.config.server.require_keys:
                return None
            raise AuthenticationError(
                "Missing or malformed API key: send 'Authorization: Bearer yg-...'." if not token
                else "Incorrect API key provided.")
        assert self.keys is not None
        try:
            return await self.keys.authenticate(token)
        except InvalidApiKey as exc:
            raise AuthenticationError(f"Incorrect API key provided ({exc}).") from None
        except LimiterUnavailable:
            raise ServiceUnavailable("Key store unreachable.", code="key_store_unavailable") from None

    async def admit(self, ctx: RequestContext) -> None:
        """Rate limits, then the budget reservation of the request's maximum cost."""
        key = ctx.key
        if key is None or (not key.rpm and not key.tpm and key.budget_usd is None):
            return
        assert self.limiter is not None and self.budget is not None
        _, upper, exact = prompt_size(ctx.typed)
        try:
            if key.rpm or key.tpm:
                ctx.rate_tokens = exact if exact is not None else self._estimate_tokens(ctx.typed)
                await self.limiter.acquire(key, ctx.rate_tokens)
            if key.budget_usd is not None:
                max_out = ctx.max_tokens or self.config.limits.max_tokens
                # The requested tier's price: a failover to a dearer tier settles at that tier's
                # exact cost, so a hard budget is overshot by at most one such request's difference.
                ctx.reservation = await self.budget.reserve(
                    key, self.price_book.max_cost(ctx.model, ctx.tier, upper, max_out,
                                                  ctx.adapter.name if ctx.adapter else ""))
                if ctx.reservation.over_soft_budget:  # a soft budget flags, never refuses
                    self.metrics.soft_budget_exceeded.labels(key.id, key.team).inc()
        except RateLimited as exc:
            raise TooManyRequests(
                f"Rate limit reached for key {key.id} ({exc.limit}): retry after "
                f"{exc.retry_after_s:.1f}s.",
                headers={"retry-after": str(max(1, math.ceil(exc.retry_after_s)))}) from None
        except InsufficientQuota as exc:
            raise QuotaExceeded(
                f"Budget exhausted for key {key.id}: ${usd(exc.budget_usd)} budget, "
                f"${usd(exc.spent_usd)} spent, ${usd(exc.reserved_usd)} reserved, this request "
                f"may cost up to ${usd(exc.requested_usd)}.") from None
        except LimiterUnavailable:
            raise ServiceUnavailable("Budget/limit store unreachable.", code="limiter_unavailable") from None

    def _estimate_tokens(self, typed: Any) -> int:
        chars, _, exact = prompt_size(typed)
        if exact is not None:
            return exact
        n = len(typed.messages) if isinstance(typed, _WITH_MESSAGES) else 1
        return math.ceil(chars / self.chars_per_token) + 4 * n

    # -- after the response ------------------------------------------------------------------------

    def finish(self, ctx: RequestContext, usage: Usage | None, status: str) -> dict[str, Any]:
        """Record the request once; return fields to add to the response's `usage`."""
        if ctx.finished:
            return {}
        ctx.finished = True
        ctx.status = status
        latency = time.perf_counter() - ctx.started
        if self._request_metrics:
            rc = self._request_children.get((ctx.kind, ctx.tier, status))
            if rc is None:
                m = self.metrics
                rc = self._request_children[(ctx.kind, ctx.tier, status)] = (
                    m.requests.labels(ctx.kind, ctx.tier, status), m.latency.labels(ctx.tier),
                    m.ttft.labels(ctx.tier))
            batch = self.metrics.batch
            batch.inc(rc[0])
            batch.observe(rc[1], latency)
            if ctx.ttft is not None:
                batch.observe(rc[2], ctx.ttft)
        estimated = False
        if usage is None and status in _ESTIMATED and ctx.replica is not None:
            usage = self._estimate_aborted(ctx)
            estimated = True
        priced = usage if usage is not None else Usage()
        price_tier = ctx.priced_tier or ctx.tier
        cost = self.price_book.cost(ctx.model, price_tier, priced, ctx.adapter.name if ctx.adapter else "") \
            if usage is not None else Cost()
        key = ctx.key
        finished_at = time.time()
        if self.ledger is not None or ctx.record_sink is not None:
            record = LedgerRecord.priced(
                request_id=ctx.request_id, usage=priced, cost=cost, ts=finished_at,
                key_id=key.id if key else "", team=key.team if key else "", model=ctx.model,
                tier=price_tier, requested_tier=ctx.requested_tier or (ctx.tier if ctx.priced_tier else ""),
                replica=ctx.replica_name, weight_version=ctx.weight_version, gateway=self.instance_id,
                adapter=ctx.adapter.name if ctx.adapter is not None else "",
                session_id=ctx.session_id or None, route=ctx.kind,
                ttft_ms=None if ctx.ttft is None else round(ctx.ttft * 1000, 3),
                latency_ms=round(latency * 1000, 3), status=status, batch_id=ctx.batch_id,
                target=served_target(ctx), requested_model=ctx.requested_model, task=ctx.task)
            if ctx.record_sink is not None:
                ctx.record_sink(record)  # a batch line: stored with its output line, then recorded
            else:
                self.ledger.record(record)
        if key is not None:
            self._after_keyed(ctx, key, cost, priced, finished_at)
        if usage is None:
            return {}
        # Totals, token and cost counters and the cache advisor only feed the dashboard and the
        # metrics: they run right after the response is written, not before (~40 µs per request).
        loop = asyncio.get_running_loop()
        loop.call_soon(self._count, ctx, priced, cost, latency, estimated)
        # The advisor compares a prompt with the previous one of its session; without a session all
        # of a key's requests share one slot, so sample those (diagnosing a 600-token prompt costs ~80 µs).
        if ctx.prompt_tokens and (ctx.session_id or next(self._advisor_sample) % ADVISOR_SAMPLE == 0):
            loop.call_soon(self.advisor.observe, key.id if key else "anonymous", ctx.session_id or None,
                           ctx.prompt_packed or ctx.prompt_tokens)
        ctx.cost_header = cost.header_value()
        return {} if estimated else {"cost": cost.to_wire()}

    def _count(self, ctx: RequestContext, priced: Usage, cost: Cost,
               latency: float, estimated: bool) -> None:
        labels = (ctx.tier, ctx.model)
        if self._request_metrics:
            c = self._children.get(labels)
            if c is None:
                c = self._children[labels] = _Children.bind(self.metrics, *labels)
            inc = self.metrics.batch.inc
            inc(c.prompt, priced.prompt_tokens)
            inc(c.cached, priced.cached_tokens)
            inc(c.uncached, priced.uncached_tokens)
            inc(c.completion, priced.completion_tokens)
            inc(c.cost_uncached, cost.uncached_input)  # Decimal sums: exact until the scrape
            inc(c.cost_cached, cost.cached_input)
            inc(c.cost_output, cost.output)
            if estimated:
                m = self.metrics
                m.aborted_estimated_tokens.labels("prompt", ctx.tier).inc(priced.prompt_tokens)
                m.aborted_estimated_tokens.labels("completion", ctx.tier).inc(priced.completion_tokens)
            else:
                inc(c.predicted_cached, ctx.predicted_cached_tokens)
                self.metrics.batch.observe(c.prediction_error, abs(ctx.predicted_cached_tokens - priced.cached_tokens))
            if ctx.adapter is not None:
                m = self.metrics
                labels = m.adapter_series(ctx.adapter.name, ctx.adapter.label)
                m.adapter_requests.labels(*labels).inc()
                m.adapter_cost.labels(*labels).inc(float(cost.total))
        if not estimated:
            self._calibrate(ctx, priced.prompt_tokens)
        t = self.totals.get(labels)
        if t is None:
            t = self.totals[labels] = TierTotals()
        t.requests += 1
        t.prompt_tokens += priced.prompt_tokens
        t.cached_tokens += priced.cached_tokens
        t.completion_tokens += priced.completion_tokens
        t.revenue += cost.total
        # Flex and batch run behind interactive work: their speed says nothing of a tier's.
        if not estimated and priced.completion_tokens and latency > 0 and not ctx.lane:
            self._observe_speed(ctx, priced, cost, latency)
        if ctx.replica is not None:
            self.fleet_cost.observe(ctx.replica.name, ctx.model, ctx.tier, priced, cost,
                                    busy_ns=int(latency * 1e9))

    def fast_premium_earned(self, ctx: RequestContext) -> bool:
        """Whether a request served by the fast tier pays its price: its workload class has shown
        the configured speed-up over the standard tier here, on enough requests of each."""
        floor = self.config.pricing.fast_min_speedup
        if floor <= 0:
            return True
        cls = workload_class(ctx)
        fast, std = self.speeds.get((FAST, cls)), self.speeds.get((STANDARD, cls))
        need = self.config.pricing.fast_min_samples
        if fast is None or std is None or fast.served_as_asked < need or std.requests < need:
            return False
        return fast.completion_tokens * std.seconds >= floor * std.completion_tokens * fast.seconds

    def _observe_speed(self, ctx: RequestContext, priced: Usage, cost: Cost, latency: float) -> None:
        asked = ctx.requested_tier or ctx.tier
        key = (asked, workload_class(ctx))
        s = self.speeds.get(key)
        if s is None:
            s = self.speeds[key] = ClassSpeed()
        s.requests += 1
        s.completion_tokens += priced.completion_tokens
        s.seconds += latency
        s.billed += cost.total
        s.at_standard += cost.total if ctx.tier == STANDARD else self.price_book.cost(ctx.model, STANDARD, priced).total
        s.served_as_asked += ctx.tier == asked

    def _calibrate(self, ctx: RequestContext, prompt_tokens: int) -> None:
        """Track characters per prompt token (EWMA) for estimates when nothing tokenized."""
        if ctx.typed is None or prompt_tokens <= 0:
            return
        chars, _, exact = prompt_size(ctx.typed)
        if exact is None and chars:
            self.chars_per_token += 0.05 * (chars / prompt_tokens - self.chars_per_token)

    def _estimate_aborted(self, ctx: RequestContext) -> Usage:
        prompt = len(ctx.prompt_tokens) if ctx.prompt_tokens else self._estimate_tokens(ctx.typed)
        completion = ctx.relayed_tokens
        if ctx.max_tokens:
            completion = min(completion, ctx.max_tokens)
        return Usage.reported(prompt, ctx.predicted_cached_tokens, completion)

    def _after_keyed(self, ctx: RequestContext, key: ApiKey, cost: Cost, usage: Usage,
                     finished_at: float) -> None:
        """Budget settle and TPM top-up need Redis: off the response path, awaited on close."""
        if ctx.reservation is not None:
            self._spawn(self._settle(key, ctx.reservation, cost, finished_at))
        extra_tokens = usage.total_tokens - ctx.rate_tokens
        if key.tpm and extra_tokens > 0 and self.limiter is not None:
            self._spawn(self.limiter.add_tokens(key, extra_tokens))

    async def _settle(self, key: ApiKey, reservation: Reservation, cost: Cost, finished_at: float) -> None:
        assert self.budget is not None
        await self.budget.settle(key, reservation, cost, finished_at)
        try:
            status = await self.budget.status(key)
        except Exception:  # a gauge is not worth an error
            return
        if key.budget_usd is not None:
            remaining = key.budget_usd - status.spent_usd - status.reserved_usd
            self.metrics.budget_remaining.labels(key.id, key.team).set(float(remaining))

    # -- derived figures ---------------------------------------------------------------------------

    def refresh_gauges(self) -> None:
        m = self.metrics
        for (tier, model), t in self.totals.items():
            if t.prompt_tokens:
                m.cache_hit_ratio.labels(tier, model).set(t.cached_tokens / t.prompt_tokens)
        report = self.fleet_cost.report()
        for ty in report.tiers:
            if ty.list_per_mtok is not None:
                m.list_per_mtok.labels(ty.tier, ty.model).set(float(ty.list_per_mtok))
            if ty.cost_per_mtok is not None:
                m.actual_per_mtok.labels(ty.tier, ty.model).set(float(ty.cost_per_mtok))
            if ty.margin_ratio is not None:
                m.margin_ratio.labels(ty.tier, ty.model).set(float(ty.margin_ratio))
        for ry in report.replicas:
            m.replica_utilization.labels(ry.replica).set(float(ry.utilization))
        if self.ledger is not None:
            m.ledger_pending_bytes.set(self.ledger.pending_bytes)

    async def flushed_ledger(self) -> Ledger:
        """The ledger with everything recorded so far stored (best effort within 2 s): reports
        read the store, and a just-finished request should show up in them."""
        ledger = self.require_ledger()
        try:
            await ledger.flush(timeout=2.0)
        except LedgerError as exc:
            log.warning("report on a ledger not fully flushed: %s", exc)
        return ledger

    def require_ledger(self) -> Ledger:
        if self.ledger is None:
            raise ServiceUnavailable("The ledger is switched off on this gateway (server.ledger).",
                                     code="ledger_disabled")
        return self.ledger
