"""The request path: validate → tier → route → forward (unary or streamed) → account.

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

from yieldgate.pricing import ApiKey

from yieldgate.serving.fleet import Fleet, Replica
from yieldgate.serving.upstream import (Endpoint, UpstreamConnectError, UpstreamConnectionError, UpstreamPool,
                              UpstreamResponse)

from .accounting import Accounting
from .context import RequestContext, Usage
from .config import Config
from .errors import (APIError, InvalidRequest, ModelNotFound, PayloadTooLarge, ServiceUnavailable,
                     UpstreamError, error_body, param_from_msgspec)
from .limits import StreamLimiter, stream_owner
from .responses import JSONReply
from .routing import Routing
from .schemas import ChatCompletionRequest, CompletionRequest
from .sse import DONE, EventSplitter, data_event, events
from .tiers import RESPONSE_SERVICE_TIER, resolve_tier

log = logging.getLogger("yieldgate.proxy")

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder(decimal_format="number").encode
_REQUEST_TYPES = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# Failures before the first response byte: the request can safely go to another replica.
_RETRYABLE = (UpstreamConnectionError, TimeoutError)


class Proxy:
    def __init__(self, config: Config, fleet: Fleet, routing: Routing, accounting: Accounting):
        self.config = config
        self.fleet = fleet
        self.routing = routing
        self.accounting = accounting
        limits = config.limits
        # Keep-alive connections per engine, dropped after 4 s idle (vLLM's uvicorn closes at 5 s).
        self.upstream = UpstreamPool(connect_timeout_s=limits.upstream_connect_timeout_s,
                                     read_timeout_s=limits.upstream_read_timeout_s)
        self.streams = StreamLimiter(config.limits.streams_per_key)
        self._endpoints: dict[str, Endpoint] = {}

    async def start(self) -> None:
        await self.upstream.start()

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
            typed = msgspec.convert(raw, _REQUEST_TYPES[kind])
        except msgspec.ValidationError as exc:
            message = str(exc)
            raise InvalidRequest(message, param=param_from_msgspec(message), code="invalid_value") from None
        limits = self.config.limits
        if kind == "chat" and len(typed.messages) > limits.max_messages:
            raise InvalidRequest(f"Too many messages: at most {limits.max_messages}.", param="messages")
        if (typed.output_limit or 0) > limits.max_tokens:
            raise InvalidRequest(f"max_tokens must be at most {limits.max_tokens}.", param="max_tokens",
                                 code="invalid_value")
        if kind == "completions" and not typed.prompt:
            raise InvalidRequest("prompt must not be empty.", param="prompt")
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
        model, tier = resolve_tier(typed.model, typed.service_tier)
        if model != self.fleet.config.model:
            raise ModelNotFound(f"The model '{typed.model}' does not exist.", param="model")
        ctx = RequestContext(
            request_id=_request_id(headers),
            kind=kind, model=model, tier=tier, started=started, stream=typed.stream,
            session_id=_header(headers, b"x-session-id") or typed.user or "",
            key=key,
            max_tokens=typed.output_limit, typed=typed,
        )
        await self.accounting.admit(ctx)
        ctx.route = self.routing.prepare(ctx, raw)
        want_usage = bool(typed.stream_options and typed.stream_options.include_usage)
        if model == typed.model and (want_usage or not typed.stream):
            payload = body  # nothing to change: forward the client's bytes as they came
        else:
            raw["model"] = model
            if typed.stream:
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
                return await self._stream(ctx, typed, payload, want_usage, owner)
            return await self._unary(ctx, typed, payload)
        except BaseException:
            if not ctx.finished:
                self.accounting.finish(ctx, None, "error")
            raise

    async def _open(self, ctx: RequestContext, typed: Any, payload: bytes,
                    failed: set[str] | None = None) -> tuple[Replica, UpstreamResponse]:
        """Send to the routed replica; if that fails before any answer, try again elsewhere if
        possible. Three tries: a replica that just died often costs one, and a keep-alive
        connection that the other replica closed at the same moment can cost another."""
        failed = set() if failed is None else failed
        last_exc: BaseException | None = None
        for attempt in range(3):
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

    def _endpoint(self, replica: Replica, kind: str) -> Endpoint:
        """The upstream URL, parsed once per replica and path."""
        text = replica.url + _PATHS[kind]
        endpoint = self._endpoints.get(text)
        if endpoint is None:
            endpoint = self._endpoints[text] = Endpoint.parse(text)
        return endpoint

    async def _unary(self, ctx: RequestContext, typed: Any, payload: bytes) -> Response:
        failed: set[str] = set()  # replicas that failed this request, avoided by the next try
        for attempt in range(2):
            replica, resp = await self._open(ctx, typed, payload, failed)
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
            return _upstream_error(resp.status, data)
        try:
            answer = _decode(data)
            usage = Usage.from_wire(answer.get("usage"))
        except (msgspec.DecodeError, AttributeError, TypeError):
            self.accounting.finish(ctx, None, "error")
            raise UpstreamError("Upstream replica sent an unreadable answer.") from None
        extra = self.accounting.finish(ctx, usage, "ok")
        self._decorate(answer, ctx, usage, extra)
        return JSONReply(_encode(answer), self._headers(ctx))

    async def _stream(self, ctx: RequestContext, typed: Any, payload: bytes, want_usage: bool,
                      owner: str) -> Response:
        lease = self.streams.acquire(owner)  # 429 when this key already holds too many streams
        try:
            replica, resp = await self._open(ctx, typed, payload)
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
            return _upstream_error(resp.status, data)
        ended = False

        def end(status: str, usage: Usage | None) -> None:
            # Once per stream, whether the relay ran to the end, failed, or never started because
            # the client left before the first byte.
            nonlocal ended
            if ended:
                return
            ended = True
            lease.release()
            self.routing.done(ctx)
            resp.close()  # closing the connection makes vLLM abort the request if unfinished
            if not ctx.finished:
                self.accounting.finish(ctx, usage, status)

        response = _RelayResponse(self._relay(ctx, replica, resp, want_usage, end), end,
                                  media_type="text/event-stream")
        response.raw_headers += self._headers(ctx)
        response.raw_headers += _STREAM_HEADERS
        return response

    async def _relay(self, ctx: RequestContext, replica: Replica, resp: UpstreamResponse,
                     want_usage: bool, end: Callable[[str, Usage | None], None]) -> AsyncIterator[bytes]:
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
                if b'"usage":{' not in block:
                    ctx.chunks += block.count(b"\n\n")
                    yield block
                    continue
                out = []
                for event in events(block):
                    if b'"usage":{' in event and event.startswith(b"data: {"):
                        usage, rewritten = self._usage_event(ctx, event[6:], want_usage)
                        if rewritten:
                            out.append(rewritten)
                    else:
                        ctx.chunks += 1
                        out.append(event + b"\n\n")
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
                tail = prev + block
                ctx.chunks -= tail.count(b"data: [DONE]") + tail.count(b'data: {"error"')
                status = "upstream_error"
        except _RETRYABLE as exc:
            # The engine died mid-stream: end the stream the way OpenAI clients understand.
            self.fleet.set_health(replica, False)
            status = "upstream_error"
            yield data_event(error_body(f"Upstream replica failed mid-stream: {type(exc).__name__}",
                                        "upstream_error", None, "upstream_error"))
            yield DONE
        finally:
            end(status, usage)

    def _usage_event(self, ctx: RequestContext, payload: bytes, want_usage: bool) -> tuple[Usage, bytes | None]:
        chunk = _decode(payload)
        usage = Usage.from_wire(chunk.get("usage"))
        extra = self.accounting.finish(ctx, usage, "ok")
        if not want_usage:
            return usage, None
        self._decorate(chunk, ctx, usage, extra)
        return usage, data_event(_encode(chunk))

    def _decorate(self, answer: dict[str, Any], ctx: RequestContext, usage: Usage, extra: dict[str, Any]) -> None:
        answer["service_tier"] = RESPONSE_SERVICE_TIER[ctx.tier]
        answer["system_fingerprint"] = f"yieldgate-{ctx.weight_version}"
        wire = answer.get("usage")
        if isinstance(wire, dict):
            details = wire.get("prompt_tokens_details")
            if not isinstance(details, dict):
                details = wire["prompt_tokens_details"] = {}
            details["cached_tokens"] = usage.cached_tokens
            wire.update(extra)

    def _headers(self, ctx: RequestContext) -> list[tuple[bytes, bytes]]:
        """The x-yieldgate-* response headers, as the raw ASGI list."""
        headers = [
            (b"x-request-id", ctx.request_id.encode("latin-1")),
            (b"x-yieldgate-tier", ctx.tier.encode("latin-1")),
            (b"x-yieldgate-replica", ctx.replica_name.encode("latin-1")),
            (b"x-yieldgate-weight-version", ctx.weight_version.encode("latin-1")),
            (b"x-yieldgate-predicted-cached-tokens", b"%d" % ctx.predicted_cached_tokens),
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


def _upstream_error(status: int, data: bytes) -> Response:
    """Pass the engine's OpenAI-shaped error through; wrap anything else."""
    try:
        body = _decode(data)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            err = body["error"]
            code = err.get("code")
            return Response(error_body(str(err.get("message", "")), "invalid_request_error" if status < 500 else "upstream_error",
                                       err.get("param"), code if isinstance(code, str) else None),
                            status_code=status if status < 500 else 502, media_type="application/json")
    except msgspec.DecodeError:
        pass
    return APIError(f"Upstream replica answered HTTP {status}.", status=502 if status >= 500 else status,
                    code="upstream_error").response()
