"""The request path: validate → tier → route → forward (unary or streamed) → account.

One path for every inference API (chat completions, completions, Responses, Anthropic Messages);
what differs between them (schema, where usage is, error shape) is in gateway/apis.py.

Bodies are decoded once into a dict (unknown fields survive untouched) and converted to a typed
request for validation; the client's bytes go upstream as they came unless a field must change
(a `:fast` model suffix, a stream that did not ask for usage). Streams are forwarded event by event
as they arrive; only the final usage event is decoded and rewritten (cost, tier, weight version).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Callable
from urllib.parse import quote

import httpx
import msgspec
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from yieldgate.cache import RouteRequest
from yieldgate.pricing import ApiKey

from yieldgate.serving.adapters import AdapterError, Adapters
from yieldgate.serving.fleet import Fleet, Replica
from yieldgate.serving.upstream import (Endpoint, UpstreamAborted, UpstreamConnectError, UpstreamConnectionError,
                                       UpstreamPool, UpstreamResponse)

from .accounting import Accounting
from .affinity import ResponseAffinity
from .apis import APIS, Api
from .context import RequestContext
from .intake import open_request, parse_request, upstream_payload
from .config import Config
from .drain import Drain
from .errors import PayloadTooLarge, PreviousResponseNotFound, ResponseNotFound, ServiceUnavailable, UpstreamError
from .limits import StreamLimiter, stream_owner
from .relay import StreamRelay
from .responses import JSONReply, yieldgate_headers
from .routing import Routing
from .schemas import ChatShaped

log = logging.getLogger("yieldgate.proxy")

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder(decimal_format="number").encode
# Failures before the first response byte: the request can safely go to another replica.
_RETRYABLE = (UpstreamConnectionError, TimeoutError)


class Proxy:
    def __init__(self, config: Config, fleet: Fleet, routing: Routing, accounting: Accounting,
                 adapters: Adapters | None = None, drain: Drain | None = None, instance_id: str = ""):
        self.config = config
        self.drain = drain or Drain()
        self._gateway_header = (b"x-yieldgate-gateway", instance_id.encode("latin-1"))
        self.fleet = fleet
        self.adapters = adapters
        self.routing = routing
        self.accounting = accounting
        limits = config.limits
        # Keep-alive connections per engine, dropped after 4 s idle (vLLM's uvicorn closes at 5 s).
        self.upstream = UpstreamPool(connect_timeout_s=limits.upstream_connect_timeout_s,
                                     read_timeout_s=limits.upstream_read_timeout_s)
        self.streams = StreamLimiter(config.limits.streams_per_key)
        self._endpoints: dict[str, Endpoint] = {}
        self.affinity = ResponseAffinity(config.fleet.model)

    async def start(self) -> None:
        await self.upstream.start()
        self.affinity.attach(self.accounting.redis)

    async def close(self) -> None:
        await self.upstream.close()

    # -- request parsing -------------------------------------------------------------------------

    async def read_body(self, receive: Any, headers: dict[bytes, bytes]) -> bytes:
        """The request body from ASGI messages, refused past max_body_bytes."""
        limit = self.config.limits.max_body_bytes
        declared = headers.get(b"content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"Request body exceeds {limit} bytes.")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"Request body exceeds {limit} bytes.")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def parse(self, kind: str, body: bytes) -> tuple[dict[str, Any], Any]:
        return parse_request(kind, body, self.config.limits)

    # -- the request path ------------------------------------------------------------------------

    async def handle(self, kind: str, scope: Any, receive: Any, key: ApiKey | None) -> Response:
        """One inference request, straight from its ASGI scope; `key` is the authenticated API key."""
        started = time.perf_counter()
        # One pass over the raw header list (ASGI names are lower-case); Starlette's Headers
        # would scan and decode the whole list again for every lookup.
        headers = dict(scope["headers"])
        body = await self.read_body(receive, headers)
        intake = open_request(kind, body, headers, key, self.fleet.config.model, self.config.limits, started,
                              adapters=self.adapters)
        raw, typed, ctx = intake.raw, intake.typed, intake.ctx
        api = APIS[kind]
        if kind == "count_tokens":  # the base model's tokenizer counts an adapter's tokens too
            return await self._count_tokens(ctx, api, body)
        if ctx.adapter is not None:
            # Bound to the version current now, held until the request is over: a version bump
            # unloads the old version only once nothing sent to it is in flight.
            ctx.adapter_held = True
            self.adapters.acquire(ctx.adapter)
        streaming = False
        try:
            await self.affinity.pin(ctx, self.fleet)
            await self.accounting.admit(ctx)
            # Responses and Messages requests route on their prompt rendered as chat messages.
            ctx.route = self.routing.prepare(ctx, {"messages": typed.chat_messages()}
                                             if isinstance(typed, ChatShaped) else raw)
            want_usage = typed.shows_usage
            payload = upstream_payload(intake, body)
            try:
                if typed.stream:
                    client = scope.get("client")
                    owner = stream_owner(ctx.key, client[0] if client else None)
                    response = await self._stream(ctx, api, payload, want_usage, owner)
                    streaming = True  # the stream's end lets the adapter version go
                    return response
                return await self._unary(ctx, api, payload)
            except BaseException:
                if not ctx.finished:
                    self.accounting.finish(ctx, None, "error")
                raise
        finally:
            if not streaming:
                self._let_go(ctx)

    def _headers(self, ctx: RequestContext) -> list[tuple[bytes, bytes]]:
        """The x-yieldgate-* response headers, with this gateway's instance id."""
        return [*yieldgate_headers(ctx), self._gateway_header]

    def _let_go(self, ctx: RequestContext) -> None:
        """The request no longer needs its adapter version on the engines (once per request)."""
        if ctx.adapter_held and self.adapters is not None:
            ctx.adapter_held = False
            self.adapters.release(ctx.adapter, ctx.adapter_sent_to)

    async def stored_response(self, response_id: str) -> Response:
        """`GET /v1/responses/{id}` (the openai client's responses.retrieve): asked of the replica
        that stored it, the only engine that has it. Not billed: nothing is generated."""
        try:
            replica = await self.affinity.replica(response_id, self.fleet)
        except PreviousResponseNotFound as exc:
            raise ResponseNotFound(f"Response with id '{response_id}' not found.", param="response_id") from exc
        try:
            # A rare read, not the hot path: one short-lived client instead of the pooled POST path.
            async with httpx.AsyncClient(timeout=30.0) as http:
                resp = await http.get(f"{replica.url}/v1/responses/{quote(response_id, safe='')}")
        except httpx.HTTPError as exc:
            raise ServiceUnavailable(f"Replica {replica.name}, which stored response '{response_id}', did "
                                     f"not answer: {type(exc).__name__}.", code="upstream_unavailable") from exc
        if resp.status_code == 404:
            raise ResponseNotFound(f"Response with id '{response_id}' not found: replica {replica.name} no "
                                   "longer has it.", param="response_id")
        if resp.status_code != 200:
            return APIS["responses"].upstream_error(resp.status_code, resp.content)
        return JSONReply(resp.content, [(b"x-yieldgate-replica", replica.name.encode("latin-1"))])

    async def _count_tokens(self, ctx: RequestContext, api: Api, body: bytes) -> Response:
        """Anthropic's token count: any replica of the tier answers it; nothing is generated, so
        nothing is billed."""
        ctx.route = RouteRequest()
        payload = body if ctx.model == ctx.typed.model else _encode(dict(_decode(body), model=ctx.model))
        replica, resp = await self._open(ctx, ctx.typed, payload)
        try:
            data = await resp.read()
        except _RETRYABLE:
            raise UpstreamError("Upstream replica failed while answering.") from None
        finally:
            self.routing.done(ctx)
            resp.release()
        if resp.status != 200:
            return api.upstream_error(resp.status, data)
        return JSONReply(data, self._headers(ctx))

    async def _open(self, ctx: RequestContext, typed: Any, payload: bytes,
                    failed: set[str] | None = None) -> tuple[Replica, UpstreamResponse]:
        """Send to the routed replica; if that fails before any answer, try again elsewhere if
        possible. Three tries: a replica that just died often costs one, and a keep-alive
        connection that the other replica closed at the same moment can cost another."""
        failed = set() if failed is None else failed
        last_exc: BaseException | None = None
        for attempt in range(3):
            candidates = await self._candidates(ctx, failed)
            if not candidates:
                break
            decision = self.routing.pick(ctx, ctx.route, candidates)
            replica = decision.replica
            ctx.bind(replica, decision.predicted_cached_tokens)
            self.routing.sent(ctx, decision)
            if ctx.adapter is not None:
                # Counted on the replica before any load: a full replica never unloads an adapter
                # that a request is about to run there.
                ctx.adapter_sent_to = self.adapters.touch(ctx.adapter, replica, ctx.adapter_sent_to)
                if not self.adapters.holds(ctx.adapter, replica):  # picked to take the adapter on
                    try:
                        await self._load_adapter(ctx, [replica])
                    except BaseException:
                        self.routing.done(ctx)
                        raise
            try:
                resp = await self.upstream.post(self._endpoint(replica, ctx.kind), payload,
                                                b"x-request-id: %s\r\n" % ctx.request_id.encode("latin-1"))
                return replica, resp
            except _RETRYABLE as exc:
                self.routing.done(ctx)
                last_exc = exc
                failed.add(replica.name)
                if isinstance(exc, UpstreamConnectError):
                    # Nothing listens there: take it out of routing until the health check sees it.
                    self.fleet.set_health(replica, False)
                if attempt == 0:
                    self.accounting.metrics.retries.labels(ctx.tier).inc()
                log.warning("replica %s failed before answering (try %d, %.2f s into the request: %s: %s)",
                            replica.name, attempt + 1, time.perf_counter() - ctx.started,
                            type(exc).__name__, exc)
        if last_exc is not None:
            raise UpstreamError(f"Upstream replicas failed: {type(last_exc).__name__}")
        raise self.routing.no_replica(ctx)

    async def _candidates(self, ctx: RequestContext, failed: set[str]) -> list[Replica]:
        """The routing candidates; for an adapter, those that hold its version, after loading it
        (the request waits, bounded) where no replica of the tier or its fallback holds it. A
        policy that weighs adapter affinity also gets the tier's other replicas while the adapter
        is on fewer than its placement allows, held or not: it picks where to load it."""
        route = ctx.adapter
        if route is None or ctx.pinned is not None:
            return await self.routing.targets(ctx, failed, self._failover)
        holds = lambda r: self.adapters.holds(route, r)  # noqa: E731
        candidates = await self.routing.candidates(ctx, failed, self._failover, holds)
        routable = [r for r in self.fleet.candidates(ctx.tier) if r.name not in failed] \
            or [r for r in self.fleet.fallback(ctx.tier)[1] if r.name not in failed]
        if self.routing.scores_adapters(ctx.tier) and self.adapters.may_spread(route):
            # The policy weighs the adapter's affinity against cache and load (a replica that
            # still caches the adapter's prefix from an earlier residency, a free slot): replicas
            # that would have to load it are candidates too (the pick loads it there, see `_open`).
            candidates += [r for r in routable if r not in candidates and r.tier == ctx.tier]
            if candidates:
                ctx.route.adapter_affinity = {r.name: self.adapters.affinity(route, r) for r in candidates}
        elif candidates:
            self.adapters.spread(route, routable)
        if candidates or not routable:
            return candidates
        deadline = time.monotonic() + self.config.fleet.lora.load_wait_s
        while True:
            await self._load_adapter(ctx, routable)
            candidates = await self.routing.candidates(ctx, failed, self._failover, holds)
            if candidates or time.monotonic() >= deadline:
                return candidates
            # Unloaded again before this request was routed there (another request needed the
            # slot, and this one was not counted on the replica yet): load it again.

    async def _load_adapter(self, ctx: RequestContext, replicas: list[Replica]) -> None:
        """Load the request's adapter version on one of `replicas`; the request waits (bounded)."""
        try:
            await self.adapters.ensure(ctx.adapter, replicas)
        except AdapterError as exc:
            raise ServiceUnavailable(exc.message, code=exc.code, headers={"retry-after": "1"}) from None

    def _failover(self, requested: str, served_by: str) -> None:
        self.accounting.metrics.failovers.labels(requested, served_by).inc()

    def _endpoint(self, replica: Replica, kind: str) -> Endpoint:
        """The upstream URL, parsed once per replica and path."""
        text = replica.url + APIS[kind].path
        endpoint = self._endpoints.get(text)
        if endpoint is None:
            endpoint = self._endpoints[text] = Endpoint.parse(text)
        return endpoint

    async def _unary(self, ctx: RequestContext, api: Api, payload: bytes) -> Response:
        failed: set[str] = set()  # replicas that failed this request, avoided by the next try
        for attempt in range(2):
            replica, resp = await self._open(ctx, ctx.typed, payload, failed)
            try:
                data = await resp.read()
                break
            except _RETRYABLE as exc:
                failed.add(replica.name)
                self.accounting.metrics.retries.labels(ctx.tier).inc()
                log.warning("replica %s failed while answering (%.2f s into the request: %s: %s)",
                            replica.name, time.perf_counter() - ctx.started, type(exc).__name__, exc)
                if attempt == 1:
                    raise UpstreamError("Upstream replica failed while answering.") from None
            finally:
                self.routing.done(ctx)
                resp.release()
        ctx.first_byte()
        if resp.status != 200:
            self.accounting.finish(ctx, None, f"upstream_{resp.status}")
            return api.upstream_error(resp.status, data)
        try:
            answer = _decode(data)
            usage = api.usage(answer)
        except (msgspec.DecodeError, AttributeError, TypeError):
            self.accounting.finish(ctx, None, "error")
            raise UpstreamError("Upstream replica sent an unreadable answer.") from None
        extra = self.accounting.finish(ctx, usage, "ok")
        api.decorate(answer, ctx, usage, extra)
        await self.affinity.remember(ctx, answer)
        return JSONReply(_encode(answer), self._headers(ctx))

    async def _stream(self, ctx: RequestContext, api: Api, payload: bytes, want_usage: bool,
                      owner: str) -> Response:
        lease = self.streams.acquire(owner)  # 429 when this key already holds too many streams
        try:
            replica, resp = await self._open(ctx, ctx.typed, payload)
        except BaseException:
            lease.release()
            raise
        if resp.status != 200:
            lease.release()
            try:
                data = await resp.read()
            finally:
                self.routing.done(ctx)
                resp.release()
            self.accounting.finish(ctx, None, f"upstream_{resp.status}")
            return api.upstream_error(resp.status, data)
        relay = StreamRelay(api, ctx, self.accounting, want_usage, self.routing.tokenizer)
        ended = False
        # A gateway that stops past its drain ends the stream: the relay sees UpstreamAborted.
        untrack = self.drain.track(lambda: resp.abort(UpstreamAborted("the gateway is shutting down")))

        def end(status: str) -> None:
            # Once per stream, whether the relay ran to the end, failed, or never started because
            # the client left before the first byte.
            nonlocal ended
            if ended:
                return
            ended = True
            untrack()
            lease.release()
            self._let_go(ctx)
            self.routing.done(ctx)
            resp.close()  # closing the connection makes vLLM abort the request if unfinished
            relay.end(status)

        return _RelayResponse(self._relay(ctx, replica, resp, relay, end), end, self._headers(ctx) + _STREAM_HEADERS)

    async def _relay(self, ctx: RequestContext, replica: Replica, resp: UpstreamResponse, relay: StreamRelay,
                     end: Callable[[str], None]) -> AsyncIterator[bytes]:
        status = "aborted"   # until the engine ends the stream; a client that leaves ends here
        remembered = False
        try:
            async for data in resp.iter_chunks():
                if ctx.ttft is None:
                    ctx.first_byte()
                    self.routing.first_token(ctx)
                out = relay.feed(data)
                if relay.final is not None and not remembered:
                    remembered = True  # where follow-ups go, known before the client sees the end
                    if ctx.kind == "responses":
                        await self.affinity.remember(ctx, relay.final.get("response"))
                if out:
                    yield out
            rest = relay.close()
            status = ctx.status  # billed by close()
            if rest.strip():
                yield rest
        except UpstreamAborted as exc:
            # The gateway stops (drain time over, or a second SIGTERM): billed for what was relayed.
            status = "shutdown"
            yield relay.api.stream_error(f"The gateway ended the stream: {exc}.")
        except _RETRYABLE as exc:
            # The engine died mid-stream: end the stream the way OpenAI clients understand.
            self.fleet.set_health(replica, False)
            status = "upstream_error"
            yield relay.api.stream_error(f"Upstream replica failed mid-stream: {type(exc).__name__}")
        finally:
            end(status)


_STREAM_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class _RelayResponse(Response):
    """A stream relayed as plain ASGI sends, whose `end` callback runs however it ends (even if it
    never streamed). The client's leaving cancels the relay: uvicorn drops sends to a closed
    connection without a word, so only `receive` tells, and a task waiting on it is the watch.
    (Starlette's StreamingResponse keeps the same watch with an anyio task group per stream, a
    cost benchmarks/gateway_overhead_ab.py --stream shows.)"""

    def __init__(self, chunks: AsyncIterator[bytes], end: Callable[[str], None],
                 headers: list[tuple[bytes, bytes]]) -> None:
        self.chunks = chunks
        self.end = end
        self.status_code = 200
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), *headers]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        watching, left = True, False

        def on_disconnect(watch: asyncio.Future) -> None:
            nonlocal left
            if watching and not watch.cancelled():
                left = True
                task.cancel()

        watch = asyncio.ensure_future(_disconnected(receive))
        watch.add_done_callback(on_disconnect)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            watching = False  # the last send completes the response, which ends `receive` too
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left:
                raise
            task.uncancel()  # the client left: the stream ends here, and the request with it
        finally:
            watching = False
            watch.remove_done_callback(on_disconnect)
            watch.cancel()
            await self.chunks.aclose()  # the relay's own `finally` bills what was sent
            self.end("aborted")


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
