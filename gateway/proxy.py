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
import itertools
import logging
import os
import time
from typing import Any, AsyncIterator, Callable

import msgspec
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from yieldgate.cache import RouteRequest
from yieldgate.pricing import ApiKey

from yieldgate.serving.fleet import Fleet, Replica
from yieldgate.serving.upstream import (Endpoint, UpstreamAborted, UpstreamConnectError, UpstreamConnectionError,
                                       UpstreamPool, UpstreamResponse)

from .accounting import Accounting
from .affinity import ResponseAffinity
from .apis import APIS, Api
from .context import RequestContext, Usage
from .config import Config
from .drain import Drain
from .errors import (InvalidRequest, ModelNotFound, PayloadTooLarge, PreviousResponseNotFound,
                     ServiceUnavailable, UpstreamError, param_from_msgspec)
from .limits import StreamLimiter, stream_owner
from .responses import JSONReply
from .routing import Routing
from .schemas import ChatShaped
from .sse import EVENT_END, EventSplitter, events
from .tiers import resolve_tier

log = logging.getLogger("yieldgate.proxy")

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder(decimal_format="number").encode
# Failures before the first response byte: the request can safely go to another replica.
_RETRYABLE = (UpstreamConnectionError, TimeoutError)


class Proxy:
    def __init__(self, config: Config, fleet: Fleet, routing: Routing, accounting: Accounting,
                 drain: Drain | None = None, instance_id: str = ""):
        self.config = config
        self.drain = drain or Drain()
        self._gateway_header = (b"x-yieldgate-gateway", instance_id.encode("latin-1"))
        self.fleet = fleet
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
        if not body:
            raise InvalidRequest("Request body is empty; expected a JSON object.")
        try:
            raw = _decode(body)
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"Request body is not valid JSON: {exc}", code="invalid_json") from None
        except RecursionError:  # msgspec refuses nesting deeper than ~1000 levels
            raise InvalidRequest("Request body is nested too deeply.", code="invalid_json") from None
        if not isinstance(raw, dict):
            raise InvalidRequest("Request body must be a JSON object.", code="invalid_json")
        try:
            typed = msgspec.convert(raw, APIS[kind].request)
        except msgspec.ValidationError as exc:
            message = str(exc)
            raise InvalidRequest(message, param=param_from_msgspec(message), code="invalid_value") from None
        limits = self.config.limits
        if kind != "completions":
            items, name = (typed.input, "input") if kind == "responses" else (typed.messages, "messages")
            if not isinstance(items, str) and len(items) > limits.max_messages:
                raise InvalidRequest(f"Too many {name}: at most {limits.max_messages}.", param=name)
        if (typed.output_limit or 0) > limits.max_tokens:
            param = "max_output_tokens" if kind == "responses" else "max_tokens"
            raise InvalidRequest(f"{param} must be at most {limits.max_tokens}.", param=param,
                                 code="invalid_value")
        if kind == "completions" and not typed.prompt:
            raise InvalidRequest("prompt must not be empty.", param="prompt")
        if kind == "responses":
            if not typed.input:
                raise InvalidRequest("input must not be empty.", param="input")
            if typed.background:
                # A background response is answered before it is generated: nothing would bill it.
                raise InvalidRequest("background responses are not served by this gateway; stream "
                                     "instead.", param="background", code="unsupported_value")
        return raw, typed

    # -- the request path ------------------------------------------------------------------------

    async def handle(self, kind: str, scope: Any, receive: Any, key: ApiKey | None) -> Response:
        """One inference request, straight from its ASGI scope; `key` is the authenticated API key."""
        started = time.perf_counter()
        # One pass over the raw header list (ASGI names are lower-case); Starlette's Headers
        # would scan and decode the whole list again for every lookup.
        headers = dict(scope["headers"])
        body = await self.read_body(receive, headers)
        raw, typed = self.parse(kind, body)
        model, tier = resolve_tier(typed.model, typed.requested_service_tier)
        if model != self.fleet.config.model:
            raise ModelNotFound(f"The model '{typed.model}' does not exist.", param="model")
        ctx = RequestContext(
            request_id=_request_id(headers),
            kind=kind, model=model, tier=tier, started=started, stream=typed.stream,
            session_id=_header(headers, b"x-session-id") or typed.user or "",
            key=key,
            max_tokens=typed.output_limit, typed=typed,
        )
        api = APIS[kind]
        if kind == "count_tokens":
            return await self._count_tokens(ctx, api, body)
        if kind == "responses" and typed.previous_response_id:
            ctx.pinned = await self._stored_on(typed.previous_response_id)
            ctx.serve_from(ctx.pinned.tier)  # priced and labelled as the tier of the replica that has it
        await self.accounting.admit(ctx)
        # Responses and Messages requests route on their prompt rendered as chat messages.
        ctx.route = self.routing.prepare(ctx, {"messages": typed.chat_messages()}
                                         if isinstance(typed, ChatShaped) else raw)
        want_usage = typed.shows_usage
        if model == typed.model and want_usage:
            payload = body  # nothing to change: forward the client's bytes as they came
        else:
            raw["model"] = model
            if typed.stream and not want_usage:
                # Always ask the engine for usage: every streamed token is billed, even if the
                # client did not ask to see the usage event.
                options = raw.get("stream_options") or {}
                options["include_usage"] = True
                raw["stream_options"] = options
            payload = _encode(raw)
        try:
            if typed.stream:
                client = scope.get("client")
                owner = stream_owner(ctx.key, client[0] if client else None)
                return await self._stream(ctx, api, payload, want_usage, owner)
            return await self._unary(ctx, api, payload)
        except BaseException:
            if not ctx.finished:
                self.accounting.finish(ctx, None, "error")
            raise

    async def _stored_on(self, response_id: str) -> Replica:
        """The replica holding a stored response; 404 when no gateway recorded it or its replica
        is gone (what OpenAI answers for an unknown previous_response_id)."""
        name = await self.affinity.lookup(response_id)
        if name is None:
            raise PreviousResponseNotFound(f"Previous response with id '{response_id}' not found.",
                                           param="previous_response_id")
        replica = self.fleet.replicas.get(name)
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
            if ctx.pinned is not None:
                # A follow-up to a stored response: only the replica that stored it can answer.
                if ctx.pinned.name in failed or not ctx.pinned.routable:
                    raise PreviousResponseNotFound(
                        f"Previous response not found: replica {ctx.pinned.name}, which stored it, "
                        "failed.", param="previous_response_id")
                candidates = [ctx.pinned]
            else:
                candidates = await self._candidates(ctx, failed)
            if not candidates:
                break
            decision = self.routing.pick(ctx, ctx.route, candidates)
            replica = decision.replica
            ctx.bind(replica, decision.predicted_cached_tokens)
            self.routing.sent(ctx, decision)
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
        fallback = self.config.fleet.tier(ctx.tier).fallback
        raise ServiceUnavailable(f"No healthy replica in tier '{ctx.tier}'"
                                 + (f" nor in its fallback tier '{fallback}'." if fallback else "."),
                                 headers={"retry-after": "1"})

    async def _candidates(self, ctx: RequestContext, failed: set[str]) -> list[Replica]:
        """The replicas this try may go to: the tier's routable ones that have not failed this
        request, else its fallback tier's, else (a last try) any routable one of the tier."""
        routable = self.fleet.candidates(ctx.tier)
        if not routable:
            if not await self.fleet.wait_released(self.config.limits.weight_swap_hold_s):
                raise ServiceUnavailable(
                    f"Every replica of tier '{ctx.tier}' is swapping to new weights; the request "
                    f"waited {self.config.limits.weight_swap_hold_s:g} s. Retry shortly.",
                    code="weight_swap_in_progress", headers={"retry-after": "1"})
            routable = self.fleet.candidates(ctx.tier)  # an all-at-once weight swap just ended
        candidates = [r for r in routable if r.name not in failed]
        if not candidates:
            # None of the tier's replicas can take it (down, or failed this request): its
            # fallback tier serves it, priced and labelled as that tier.
            served_by, spare = self.fleet.fallback(ctx.tier)
            candidates = [r for r in spare if r.name not in failed]
            if candidates:
                ctx.serve_from(served_by)
                self.accounting.metrics.failovers.labels(ctx.requested_tier, served_by).inc()
            else:
                candidates = routable
        return candidates

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
        await self._remember(ctx, answer)
        return JSONReply(_encode(answer), self._headers(ctx))

    async def _remember(self, ctx: RequestContext, response: Any) -> None:
        """A Responses answer the engine stored: where follow-ups naming it must go."""
        if ctx.kind == "responses" and ctx.typed.stores and ctx.replica is not None \
                and isinstance(response, dict) and isinstance(response.get("id"), str):
            await self.affinity.record(response["id"], ctx.replica.name)

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
        ended = False
        # A gateway that stops past its drain ends the stream: the relay sees UpstreamAborted.
        untrack = self.drain.track(lambda: resp.abort(UpstreamAborted("the gateway is shutting down")))

        def end(status: str, usage: Usage | None) -> None:
            # Once per stream, whether the relay ran to the end, failed, or never started because
            # the client left before the first byte.
            nonlocal ended
            if ended:
                return
            ended = True
            untrack()
            lease.release()
            self.routing.done(ctx)
            resp.close()  # closing the connection makes vLLM abort the request if unfinished
            if not ctx.finished:
                self.accounting.finish(ctx, usage, status)

        response = _RelayResponse(self._relay(ctx, api, replica, resp, want_usage, end), end,
                                  media_type="text/event-stream")
        response.raw_headers += self._headers(ctx)
        response.raw_headers += _STREAM_HEADERS
        return response

    async def _relay(self, ctx: RequestContext, api: Api, replica: Replica, resp: UpstreamResponse,
                     want_usage: bool, end: Callable[[str, Usage | None], None]) -> AsyncIterator[bytes]:
        final, token, prefix = api.final_marker, api.token_marker, api.event_prefix
        splitter = EventSplitter()
        usage: Usage | None = None
        status = "aborted"   # until the engine says [DONE]; a client that leaves ends here
        prev = block = b""   # the last two blocks relayed: where an engine's error event would be
        try:
            async for data in resp.iter_chunks():
                if ctx.ttft is None:
                    ctx.first_byte()
                    self.routing.first_token(ctx)
                got = splitter.feed(data)
                if not got:
                    continue
                prev, block = block, got
                if final not in block:
                    ctx.chunks += block.count(token)
                    yield block
                    continue
                out = []
                for event in events(block):
                    if final in event and event.startswith(prefix):
                        usage, rewritten = await self._final_event(ctx, api, event, want_usage)
                        if rewritten:
                            out.append(rewritten)
                    else:
                        event += EVENT_END
                        ctx.chunks += event.count(token)
                        out.append(event)
                if out:
                    yield b"".join(out)
            rest = splitter.rest()
            if rest.strip():
                yield rest
            if usage is not None:
                status = "ok"
            else:
                # The engine ended the stream without its usage: vLLM ends a generation that failed
                # with an error event and [DONE]. Billed like an abandoned stream (the tokens
                # relayed), not as an "ok" with none; the error event and [DONE] are not tokens.
                if token == EVENT_END:  # every event was counted
                    tail = prev + block
                    ctx.chunks -= tail.count(b"data: [DONE]") + tail.count(b'data: {"error"')
                status = "upstream_error"
        except UpstreamAborted as exc:
            # The gateway stops (drain time over, or a second SIGTERM): billed for what was relayed.
            status = "shutdown"
            yield api.stream_error(f"The gateway ended the stream: {exc}.")
        except _RETRYABLE as exc:
            # The engine died mid-stream: end the stream the way OpenAI clients understand.
            self.fleet.set_health(replica, False)
            status = "upstream_error"
            yield api.stream_error(f"Upstream replica failed mid-stream: {type(exc).__name__}")
        finally:
            end(status, usage)

    async def _final_event(self, ctx: RequestContext, api: Api, event: bytes,
                           want_usage: bool) -> tuple[Usage, bytes | None]:
        """The event with the stream's final usage: bill it, and rewrite it with tier and cost."""
        at = event.index(b"data: ") + 6
        chunk = _decode(event[at:])
        usage = api.final_usage(chunk)
        extra = self.accounting.finish(ctx, usage, "ok")
        if ctx.kind == "responses":
            await self._remember(ctx, chunk.get("response"))
        if not want_usage:
            return usage, None
        api.decorate_final(chunk, ctx, usage, extra)
        return usage, event[:at] + _encode(chunk) + EVENT_END

    def _headers(self, ctx: RequestContext) -> list[tuple[bytes, bytes]]:
        """The x-yieldgate-* response headers, as the raw ASGI list."""
        headers = [
            (b"x-request-id", ctx.request_id.encode("latin-1")),
            (b"x-yieldgate-tier", ctx.tier.encode("latin-1")),
            (b"x-yieldgate-replica", ctx.replica_name.encode("latin-1")),
            (b"x-yieldgate-weight-version", ctx.weight_version.encode("latin-1")),
            (b"x-yieldgate-predicted-cached-tokens", b"%d" % ctx.predicted_cached_tokens),
            self._gateway_header,
        ]
        if ctx.requested_tier:
            headers.append((b"x-yieldgate-requested-tier", ctx.requested_tier.encode("latin-1")))
        if ctx.cost_header:
            headers.append((b"x-yieldgate-cost-usd", ctx.cost_header.encode("latin-1")))
        if ctx.reservation is not None and ctx.reservation.over_soft_budget:
            headers.append((b"x-yieldgate-budget", b"soft-exceeded"))
        return headers


_STREAM_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class _RelayResponse(StreamingResponse):
    """A streaming response that always runs its `end` callback, even if it never streamed."""

    def __init__(self, content: AsyncIterator[bytes], end: Callable[[str, Any], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._end = end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._end("aborted", None)


# Request ids: a random prefix per process and a counter (the ledger keys records by request id,
# so ids must not repeat across processes or restarts; a syscall per request is not needed for that).
_ID_PREFIX = f"req-{os.urandom(10).hex()}"
_ids = itertools.count()


def _new_id_prefix() -> None:  # a forked worker gets a prefix of its own
    global _ID_PREFIX
    _ID_PREFIX = f"req-{os.urandom(10).hex()}"


os.register_at_fork(after_in_child=_new_id_prefix)


def _request_id(headers: dict[bytes, bytes]) -> str:
    """The client's x-request-id if it is printable (it is forwarded upstream as a header line)."""
    given = _header(headers, b"x-request-id")
    return given if given and given.isprintable() else f"{_ID_PREFIX}{next(_ids):012x}"


def _header(headers: dict[bytes, bytes], name: bytes) -> str:
    value = headers.get(name)
    return value.decode("latin-1") if value else ""
