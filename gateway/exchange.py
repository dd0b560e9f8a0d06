"""One inference request's life, whichever front door it came in by: the ASGI proxy
(gateway/proxy.py), which sends the bytes itself, or the endpoint picker (gateway/picker.py), which
tells an Envoy where to send them. Both are transports over the same steps here:

    open (validate, resolve model, tier and adapter) → admit (pin a follow-up, limits, budget,
    prompt for routing, stream slot) → route (one try: candidates, pick, adapter on the replica)
    → answer (unary) or feed (stream) → end(status, usage), once, however it ended.

`end` is the one place a request's bookkeeping closes: its stream slot, its adapter version (and the
replica it was counted on), its routing try, and its bill.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from yieldgate.cache import RouteRequest, adapter_candidacy
from yieldgate.pricing import ApiKey, Usage
from yieldgate.serving import AdapterError, Replica, UpstreamConnectError

from .accounting import Accounting
from .apis import ANTHROPIC, APIS, Api
from .config import Config
from .context import RequestContext
from .errors import PayloadTooLarge, ServiceUnavailable, UpstreamError
from .intake import Intake, open_request, upstream_payload
from .limits import StreamLease, StreamLimiter, stream_owner
from .registry import ModelPool, ModelRegistry
from .relay import StreamRelay
from .schemas import ChatShaped
from .tiers import FAST, FLEX, STANDARD
from .tracing import Tracing

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder(decimal_format="number").encode


class Pipeline:
    """What every front door shares: the models (each a pool with its fleet, routing, adapters,
    stored responses and lanes: gateway/registry.py), accounting and the concurrent-stream
    limits. Opens one Exchange per request, on the pool its model names."""

    def __init__(self, config: Config, registry: ModelRegistry, accounting: Accounting):
        self.config = config
        self.registry = registry
        self.accounting = accounting
        self.streams = StreamLimiter(config.limits.streams_per_key)
        self.max_body_bytes = config.limits.max_body_bytes
        self.tracing: Tracing | None = None  # set when tracing.endpoint is (gateway/tracing.py)

    def start(self) -> None:
        """Once accounting has started: stored responses are found through its Redis."""
        for pool in self.registry:
            pool.affinity.attach(self.accounting.redis)

    async def authenticate(self, kind: str, headers: dict[bytes, bytes]) -> ApiKey | None:
        """The request's API key (None: anonymous, in open mode); AuthenticationError if refused."""
        authorization = headers.get(b"authorization")
        if kind in ANTHROPIC and b"x-api-key" in headers:  # how Anthropic's clients send the key
            authorization = b"Bearer " + headers[b"x-api-key"]
        return await self.accounting.authenticate_header(authorization)

    def check_size(self, size: int) -> None:
        """PayloadTooLarge (413) for a body, or a declared length, past `limits.max_body_bytes`."""
        if size > self.max_body_bytes:
            raise PayloadTooLarge(f"Request body exceeds {self.max_body_bytes} bytes.")

    def open(self, kind: str, headers: dict[bytes, bytes], body: bytes, key: ApiKey | None,
             started: float | None = None, lane: str = "") -> "Exchange":
        """Validate the body and resolve model, tier and adapter (4xx if it cannot be served).
        From here on the request must `end`. `lane`: a batch line's (served and priced as its lane)."""
        intake = open_request(kind, body, headers, key, self.registry, self.config.limits, started)
        ctx, pool = intake.ctx, intake.pool
        if lane:
            ctx.tier, ctx.lane, ctx.priced_tier = STANDARD, lane, lane
        if ctx.lane:
            ctx.priority = pool.lanes.priority(ctx.lane)
        if kind == "count_tokens":
            ctx.adapter = None  # the base model's tokenizer counts an adapter's tokens too: any replica answers
        elif ctx.adapter is not None:
            # Bound to the version current now, held until the request ends: a version bump
            # unloads the old version only once nothing sent to it is in flight.
            ctx.adapter_held = True
            pool.slots.acquire(ctx.adapter)
        exchange = Exchange(self, pool, APIS[kind], intake, body)
        if self.tracing is not None:
            exchange.span = span = self.tracing.start(ctx, headers)
            exchange.traceparent = self.tracing.traceparent(span)
        return exchange

    def failover(self, requested: str, served_by: str) -> None:
        self.accounting.metrics.failovers.labels(requested, served_by).inc()


class Exchange:
    """One request from its admission to its end; the transport sends the bytes."""

    __slots__ = ("pipeline", "pool", "api", "intake", "ctx", "body", "billed", "lease", "relay", "ended", "failed",
                 "stored", "_remembered", "span", "traceparent")

    def __init__(self, pipeline: Pipeline, pool: ModelPool, api: Api, intake: Intake, body: bytes):
        self.pipeline = pipeline
        self.pool = pool                     # the model's fleet, routing and adapters (gateway/registry.py)
        self.api = api
        self.intake = intake
        self.ctx: RequestContext = intake.ctx
        self.body = body
        self.billed = False                  # admitted: from here on its end is billed
        self.lease: StreamLease | None = None
        self.relay: StreamRelay | None = None  # a streamed answer's pass-through and bill
        self.ended = False
        self.failed: set[str] = set()        # replicas that failed this request: the next try avoids them
        self.stored: Any = None              # a Responses answer the engine stored, not yet remembered
        self._remembered = False
        self.span: Any = None                # the request's trace span, when tracing is on
        self.traceparent = b""               # its header line for the engine (gateway/tracing.py)

    @property
    def typed(self) -> Any:
        return self.intake.typed

    @property
    def want_usage(self) -> bool:
        return self.intake.typed.shows_usage

    # -- before routing ----------------------------------------------------------------------------

    async def admit(self, client: str | None) -> None:
        """A follow-up pinned to the replica that stored its previous response (404 before
        anything is billed if it is gone), then rate limits and the budget reservation, the
        prompt as routing keys on it, and a stream's slot (`client`: the peer address that an
        anonymous stream counts against). A token count is not admitted: nothing is generated."""
        p, ctx = self.pipeline, self.ctx
        if ctx.kind == "count_tokens":
            ctx.route = RouteRequest()
            return
        await self.pool.affinity.pin(ctx, self.pool.fleet)
        if ctx.pinned is None and ctx.adapter is None:
            other = p.registry.fallback(self.pool, ctx.tier)
            if other is not None:  # nothing of its model can serve it: another model does, priced as that one
                self._move_to(other)
        pool = self.pool
        if ctx.lane == FLEX:  # 429 now when its tier's engines are saturated, never a timeout later
            pool.lanes.admit_flex(ctx.tier)
        await p.accounting.admit(ctx)
        self.billed = True
        typed = self.intake.typed
        # Responses and Messages requests route on their prompt rendered as chat messages.
        ctx.route = pool.routing.prepare(ctx, {"messages": typed.chat_messages()}
                                         if isinstance(typed, ChatShaped) else self.intake.raw)
        if typed.stream:  # 429 when the key (or the client) already holds too many streams
            self.lease = p.streams.acquire(stream_owner(ctx.key, client))

    def _move_to(self, pool: ModelPool) -> None:
        """Cross-model fallback: the request is now `pool`'s, on its tier if it has one."""
        ctx = self.ctx
        self.pipeline.accounting.metrics.model_fallbacks.labels(ctx.model, pool.name).inc()
        ctx.requested_model = ctx.requested_model or ctx.model
        ctx.model = pool.name
        self.pool = pool
        if not pool.routable(ctx.tier):
            ctx.serve_from(STANDARD)

    def payload(self) -> bytes:
        """The bytes for the engine (gateway/intake.py upstream_payload)."""
        return upstream_payload(self.intake, self.body)

    # -- one try on one replica --------------------------------------------------------------------

    async def route(self) -> Replica | None:
        """One try: pick among the candidates that have not failed this request, count it in
        flight there (and its adapter version on that replica), and load the adapter there if
        the pick chose a replica to take it on. None: nothing can take it."""
        p, pool, ctx = self.pipeline, self.pool, self.ctx
        candidates = await self._candidates()
        if not candidates:
            return None
        decision = pool.routing.pick(ctx, ctx.route, candidates)
        replica = decision.replica
        ctx.bind(replica, decision.predicted_cached_tokens)
        if ctx.tier == FAST and self.billed and not p.accounting.fast_premium_earned(ctx):
            ctx.priced_tier = STANDARD  # the premium follows the speed-up measured for this class
        pool.routing.sent(ctx, decision)
        if self.span is not None:
            p.tracing.routed(self.span, ctx, decision)
        if ctx.adapter is not None:
            # Counted on the replica before any load: a full replica never unloads an adapter
            # that a request is about to run there.
            ctx.adapter_sent_to = pool.slots.touch(ctx.adapter, replica, ctx.adapter_sent_to)
            if not pool.slots.holds(ctx.adapter, replica):  # picked to take the adapter on
                try:
                    await self._load_adapter([replica])
                except BaseException:
                    pool.routing.done(ctx)
                    raise
        return replica

    def no_replica(self) -> ServiceUnavailable:
        return self.pool.routing.no_replica(self.ctx)

    async def _candidates(self) -> list[Replica]:
        """The routing candidates. For an adapter, the rule of cache.scorers.adapter_candidacy:
        the replicas of the tier (or its fallback) holding its version, with the tier's others
        while the policy weighs adapter affinity and the version may go on more replicas; held by
        none, it is loaded first (the request waits, bounded)."""
        p, pool, ctx, failed = self.pipeline, self.pool, self.ctx, self.failed
        route, slots, routing = ctx.adapter, pool.slots, pool.routing
        if route is None or ctx.pinned is not None:
            return await routing.targets(ctx, failed, p.failover)
        holds = lambda r: slots.holds(route, r)  # noqa: E731
        holders = await routing.candidates(ctx, failed, p.failover, holds)
        routable = [r for r in pool.fleet.candidates(ctx.tier) if r.name not in failed] \
            or [r for r in pool.fleet.fallback(ctx.tier)[1] if r.name not in failed]
        everywhere, room = slots.placement(route)
        candidacy = adapter_candidacy(holders, routable, lambda r: slots.affinity(route, r),
                                      weighs_affinity=routing.scores_adapters(ctx.tier), room=room,
                                      busy=min((r.inflight for r in everywhere), default=0) >= 1, tier=ctx.tier)
        if candidacy.affinity is not None:
            ctx.route.adapter_affinity = candidacy.affinity
        if candidacy.spread_to is not None:
            slots.spread(route, candidacy.spread_to)
        if candidacy.candidates or not candidacy.load_on:
            return candidacy.candidates
        deadline = time.monotonic() + pool.config.lora.load_wait_s
        while True:
            await self._load_adapter(candidacy.load_on)
            candidates = await routing.candidates(ctx, failed, p.failover, holds)
            if candidates or time.monotonic() >= deadline:
                return candidates
            # Unloaded again before this request was routed there (another request needed the
            # slot, and this one was not counted on the replica yet): load it again.

    async def _load_adapter(self, replicas: list[Replica]) -> None:
        """Load the request's adapter version on one of `replicas`; the request waits (bounded)."""
        try:
            await self.pool.slots.ensure(self.ctx.adapter, replicas)
        except AdapterError as exc:
            raise ServiceUnavailable(exc.message, code=exc.code, headers={"retry-after": "1"}) from None

    def retry(self, replica: Replica, exc: BaseException) -> None:
        """The try on `replica` failed before an answer came: the next try goes elsewhere; a replica
        where nothing listens is out of routing until the health check sees it again."""
        self.pool.routing.done(self.ctx)
        self.failed.add(replica.name)
        if isinstance(exc, UpstreamConnectError):
            self.pool.fleet.set_health(replica, False)

    def answered(self) -> None:
        """The replica's first byte is back: its prefill stops counting as work queued there."""
        self.ctx.first_byte()
        self.pool.routing.first_token(self.ctx)

    def try_over(self) -> None:
        """The replica is done with this try (answered, failed or cut off). Safe to repeat."""
        self.pool.routing.done(self.ctx)

    # -- the answer --------------------------------------------------------------------------------

    def answer(self, data: bytes) -> bytes:
        """A whole 200 answer: billed, with tier and cost added; ends the request. UpstreamError
        (502) if it is not one the API can read."""
        api, ctx = self.api, self.ctx
        if not self.billed:  # a token count: passed on as the engine sent it
            self.end("ok")
            return data
        try:
            answer = _decode(data)
            usage = api.usage(answer)
        except (msgspec.DecodeError, AttributeError, TypeError):
            self.end("error")
            raise UpstreamError("Upstream replica sent an unreadable answer.") from None
        extra = self.end("ok", usage)
        api.decorate(answer, ctx, usage, extra)
        self.stored = answer
        return _encode(answer)

    def stream(self) -> StreamRelay:
        """A 200 stream begins: its events pass through the relay, which bills its final usage."""
        p = self.pipeline
        self.relay = StreamRelay(self.api, self.ctx, p.accounting, self.want_usage, self.pool.routing.tokenizer)
        return self.relay

    def feed(self, data: bytes) -> bytes:
        """Stream bytes from the engine -> the bytes for the client (complete events)."""
        assert self.relay is not None
        out = self.relay.feed(data)
        if self.relay.final is not None and not self._remembered:
            self._remembered = True  # where a follow-up goes: known before the client sees the end
            self.stored = self.relay.final.get("response")
        return out

    def close_stream(self) -> bytes:
        """The engine ended the stream: billed (as `ctx.status` says); the bytes still to send."""
        assert self.relay is not None
        return self.relay.close()

    async def remember(self) -> None:
        """Record where a Responses answer the engine stored is, so a follow-up naming it finds it."""
        stored, self.stored = self.stored, None
        if stored is not None and self.ctx.kind == "responses":
            await self.pool.affinity.remember(self.ctx, stored)

    # -- the end -----------------------------------------------------------------------------------

    def end(self, status: str, usage: Usage | None = None) -> dict[str, Any]:
        """Once per request, however it ended: its stream slot, its adapter version (and the
        replica it was counted on), its routing try, and its bill (an admitted request only; a
        stream by its relay, on what was relayed if it never saw the engine's usage). Returns the
        fields to add to the answer's `usage` (cost)."""
        if self.ended:
            return {}
        self.ended = True
        p, ctx = self.pipeline, self.ctx
        if self.lease is not None:
            self.lease.release()
        if ctx.adapter_held:
            ctx.adapter_held = False
            self.pool.slots.release(ctx.adapter, ctx.adapter_sent_to)
        self.pool.routing.done(ctx)
        extra: dict[str, Any] = {}
        if self.relay is not None:
            self.relay.end(status)
            usage = self.relay.usage
        elif self.billed:
            extra = p.accounting.finish(ctx, usage, status)
        if self.span is not None:
            p.tracing.end(self.span, ctx, status, usage)
        return extra
