"""The gateway's own front door: an ASGI transport over the request pipeline (gateway/exchange.py)
that reads the body, forwards it to the routed engine (unary or streamed) and relays the answer.

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
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from yieldgate.pricing import ApiKey
from yieldgate.serving import (
    Endpoint, Replica, UpstreamAborted, UpstreamConnectionError, UpstreamPool, UpstreamResponse,
)

from .apis import APIS
from .context import RequestContext
from .drain import Drain
from .errors import PreviousResponseNotFound, ResponseNotFound, ServiceUnavailable, UpstreamError
from .exchange import Exchange, Pipeline
from .responses import JSONReply, yieldgate_headers

log = logging.getLogger("yieldgate.proxy")

# Failures before the first response byte: the request can safely go to another replica.
_RETRYABLE = (UpstreamConnectionError, TimeoutError)


class Proxy:
    """The ASGI front door: reads the body, sends it to the routed engine itself (retrying another
    replica when one fails before answering) and relays the answer; the request's life is an
    Exchange (gateway/exchange.py)."""

    def __init__(self, pipeline: Pipeline, drain: Drain | None = None, instance_id: str = ""):
        self.pipeline = pipeline
        self.config = pipeline.config
        self.drain = drain or Drain()
        self._gateway_header = (b"x-yieldgate-gateway", instance_id.encode("latin-1"))
        limits = self.config.limits
        # Keep-alive connections per engine, dropped after 4 s idle (vLLM's uvicorn closes at 5 s).
        self.upstream = UpstreamPool(connect_timeout_s=limits.upstream_connect_timeout_s,
                                     read_timeout_s=limits.upstream_read_timeout_s)
        self._retries = pipeline.accounting.metrics.retries
        self._endpoints: dict[str, Endpoint] = {}

    async def start(self) -> None:
        await self.upstream.start()

    async def close(self) -> None:
        await self.upstream.close()

    async def read_body(self, receive: Any, headers: dict[bytes, bytes]) -> bytes:
        """The request body from ASGI messages, refused past max_body_bytes."""
        check_size = self.pipeline.check_size
        declared = headers.get(b"content-length")
        if declared and declared.isdigit():
            check_size(int(declared))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            size += len(chunk)
            check_size(size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def handle(self, kind: str, scope: Any, receive: Any, key: ApiKey | None,
                     headers: dict[bytes, bytes] | None = None) -> Response:
        """One inference request, straight from its ASGI scope; `key` is the authenticated API key,
        `headers` the scope's headers as a dict (ASGI names are lower-case)."""
        started = time.perf_counter()
        if headers is None:
            headers = dict(scope["headers"])
        body = await self.read_body(receive, headers)
        exchange = self.pipeline.open(kind, headers, body, key, started)
        try:
            client = scope.get("client")
            await exchange.admit(client[0] if client else None)
            if exchange.ctx.stream:
                return await self._stream(exchange)
            return await self.unary(exchange)
        except BaseException:
            exchange.end("error")  # no-op once the answer ended it
            raise

    def _headers(self, ctx: RequestContext) -> list[tuple[bytes, bytes]]:
        """The x-yieldgate-* response headers, with this gateway's instance id."""
        return [*yieldgate_headers(ctx), self._gateway_header]

    async def stored_response(self, response_id: str) -> Response:
        """`GET /v1/responses/{id}` (the openai client's responses.retrieve): asked of the replica
        that stored it, the only engine that has it. Not billed: nothing is generated."""
        replica = None
        for pool in self.pipeline.registry:  # one model's replica stored it
            try:
                replica = await pool.affinity.replica(response_id, pool.fleet)
                break
            except PreviousResponseNotFound:
                continue
        if replica is None:
            raise ResponseNotFound(f"Response with id '{response_id}' not found.", param="response_id")
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

    async def _open(self, exchange: Exchange, payload: bytes) -> tuple[Replica, UpstreamResponse]:
        """Send to the routed replica; if that fails before any answer, try again elsewhere if
        possible. Three tries: a replica that just died often costs one, and a keep-alive
        connection that the other replica closed at the same moment can cost another."""
        ctx = exchange.ctx
        last_exc: BaseException | None = None
        for attempt in range(3):
            replica = await exchange.route()
            if replica is None:
                break
            try:
                resp = await self.upstream.post(self._endpoint(replica, ctx.kind), payload,
                                                b"x-request-id: %s\r\n%s" % (ctx.request_id.encode("latin-1"),
                                                                               exchange.traceparent))
                return replica, resp
            except _RETRYABLE as exc:
                exchange.retry(replica, exc)
                last_exc = exc
                if attempt == 0:
                    self._retries.labels(ctx.tier).inc()
                log.warning("replica %s failed before answering (try %d, %.2f s into the request: %s: %s)",
                            replica.name, attempt + 1, time.perf_counter() - ctx.started,
                            type(exc).__name__, exc)
        if last_exc is not None:
            raise UpstreamError(f"Upstream replicas failed: {type(last_exc).__name__}")
        raise exchange.no_replica()

    def _endpoint(self, replica: Replica, kind: str) -> Endpoint:
        """The upstream URL, parsed once per replica and path."""
        text = replica.url + APIS[kind].path
        endpoint = self._endpoints.get(text)
        if endpoint is None:
            endpoint = self._endpoints[text] = Endpoint.parse(text)
        return endpoint

    async def unary(self, exchange: Exchange) -> Response:
        """An admitted request answered whole (also how the batch worker sends its lines)."""
        ctx, payload = exchange.ctx, exchange.payload()
        for attempt in range(2):
            replica, resp = await self._open(exchange, payload)
            try:
                data = await resp.read()
                break
            except _RETRYABLE as exc:
                exchange.failed.add(replica.name)  # avoided by the next try
                self._retries.labels(ctx.tier).inc()
                log.warning("replica %s failed while answering (%.2f s into the request: %s: %s)",
                            replica.name, time.perf_counter() - ctx.started, type(exc).__name__, exc)
                if attempt == 1:
                    raise UpstreamError("Upstream replica failed while answering.") from None
            finally:
                exchange.try_over()
                resp.release()
        ctx.first_byte()
        if resp.status != 200:
            exchange.end(f"upstream_{resp.status}")
            return exchange.api.upstream_error(resp.status, data)
        data = exchange.answer(data)
        await exchange.remember()
        return JSONReply(data, self._headers(ctx))

    async def _stream(self, exchange: Exchange) -> Response:
        ctx = exchange.ctx
        replica, resp = await self._open(exchange, exchange.payload())
        if resp.status != 200:
            try:
                data = await resp.read()
            finally:
                exchange.try_over()
                resp.release()
            exchange.end(f"upstream_{resp.status}")
            return exchange.api.upstream_error(resp.status, data)
        exchange.stream()
        # A gateway that stops past its drain ends the stream: the relay sees UpstreamAborted.
        untrack = self.drain.track(lambda: resp.abort(UpstreamAborted("the gateway is shutting down")))

        def end(status: str) -> None:
            # Once per stream, whether the relay ran to the end, failed, or never started because
            # the client left before the first byte.
            if exchange.ended:
                return
            untrack()
            resp.close()  # closing the connection makes vLLM abort the request if unfinished
            exchange.end(status)

        return _RelayResponse(self._relay(exchange, replica, resp, end), end, self._headers(ctx) + _STREAM_HEADERS)

    async def _relay(self, exchange: Exchange, replica: Replica, resp: UpstreamResponse,
                     end: Callable[[str], None]) -> AsyncIterator[bytes]:
        ctx = exchange.ctx
        status = "aborted"   # until the engine ends the stream; a client that leaves ends here
        try:
            async for data in resp.iter_chunks():
                if ctx.ttft is None:
                    exchange.answered()
                out = exchange.feed(data)
                if exchange.stored is not None:
                    await exchange.remember()  # where follow-ups go, known before the client sees the end
                if out:
                    yield out
            rest = exchange.close_stream()
            status = ctx.status  # billed by close_stream()
            if rest.strip():
                yield rest
        except UpstreamAborted as exc:
            # The gateway stops (drain time over, or a second SIGTERM): billed for what was relayed.
            status = "shutdown"
            yield exchange.api.stream_error(f"The gateway ended the stream: {exc}.")
        except _RETRYABLE as exc:
            # The engine died mid-stream: end the stream the way OpenAI clients understand.
            exchange.pool.fleet.set_health(replica, False)
            status = "upstream_error"
            yield exchange.api.stream_error(f"Upstream replica failed mid-stream: {type(exc).__name__}")
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
