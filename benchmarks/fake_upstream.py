"""A fast fake OpenAI-compatible upstream, only for measuring the gateway's own overhead.

Raw asyncio protocol + httptools parser on uvloop (no framework), so that it costs far less per
request than any gateway in front of it. Every request gets a fixed time to first token and a fixed
per-token interval; streams send each token as its own SSE event in its own HTTP chunk.

    python benchmarks/fake_upstream.py --port 9100 --ttft-ms 0 --itl-ms 0 --tokens 16

Endpoints: POST /v1/chat/completions, POST /v1/completions (stream or not; usage includes
prompt_tokens_details.cached_tokens), GET /health, GET /metrics (connection/request counters, the
tests use them to check the gateway's connection reuse), GET /last-request (the last request body
as received), GET /v1/models.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

import httptools
import msgspec

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


class Settings(msgspec.Struct, kw_only=True):
    ttft_s: float = 0.0           # delay before the first token (unary: before the whole answer)
    itl_s: float = 0.0            # delay between tokens
    tokens: int = 16              # completion tokens when the request sets no smaller max_tokens
    cached_ratio: float = 0.5     # reported cached share of the prompt
    model: str = "demo"


class Counters:
    __slots__ = ("connections_total", "connections_open", "requests_total", "streams_open", "last_body")
    COUNTERS = __slots__[:4]

    def __init__(self) -> None:
        self.connections_total = 0
        self.connections_open = 0
        self.requests_total = 0
        self.streams_open = 0
        self.last_body = b""

    def render(self) -> bytes:
        return "".join(f"fake_upstream_{name} {getattr(self, name)}\n" for name in self.COUNTERS).encode()


def _usage(prompt_tokens: int, completion: int, cached_ratio: float) -> dict:
    cached = int(prompt_tokens * cached_ratio) // 32 * 32  # whole KV blocks, as vLLM reports
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class _Request:
    __slots__ = ("url", "method", "body", "keep_alive")

    def __init__(self) -> None:
        self.url = b""
        self.method = b""
        self.body: list[bytes] = []
        self.keep_alive = True


class UpstreamProtocol(asyncio.Protocol):
    """One TCP connection: HTTP/1.1 keep-alive, one request at a time (clients don't pipeline)."""

    def __init__(self, settings: Settings, counters: Counters) -> None:
        self.settings = settings
        self.counters = counters
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.req = _Request()
        self.task: asyncio.Task | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.counters.connections_total += 1
        self.counters.connections_open += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.counters.connections_open -= 1
        self.transport = None
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._send(400, b'{"error":{"message":"bad request"}}', close=True)

    # -- httptools callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.req = _Request()

    def on_url(self, url: bytes) -> None:
        self.req.url += url

    def on_body(self, body: bytes) -> None:
        self.req.body.append(body)

    def on_message_complete(self) -> None:
        req = self.req
        req.method = self.parser.get_method()
        req.keep_alive = self.parser.should_keep_alive()
        self.counters.requests_total += 1
        self.dispatch(req)

    # -- responses -----------------------------------------------------------------------------
    def _send(self, status: int, body: bytes, content_type: bytes = b"application/json",
              close: bool = False) -> None:
        if self.transport is None:
            return
        reason = b"OK" if status == 200 else b"ERR"
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n"
                % (status, reason, content_type, len(body),
                   b"connection: close\r\n" if close else b""))
        self.transport.write(head + body)
        if close:
            self.transport.close()

    def dispatch(self, req: _Request) -> None:
        path = req.url.split(b"?", 1)[0]
        if req.method == b"GET":
            if path == b"/health":
                self._send(200, b"", close=not req.keep_alive)
            elif path == b"/metrics":
                self._send(200, self.counters.render(), b"text/plain", close=not req.keep_alive)
            elif path == b"/last-request":  # what the gateway sent last (tests check forwarding)
                self._send(200, self.counters.last_body, close=not req.keep_alive)
            elif path == b"/v1/models":
                self._send(200, _encode({"object": "list", "data": [
                    {"id": self.settings.model, "object": "model", "owned_by": "fake"}]}),
                    close=not req.keep_alive)
            else:
                self._send(404, b'{"error":{"message":"not found"}}', close=not req.keep_alive)
            return
        if path not in (b"/v1/chat/completions", b"/v1/completions"):
            self._send(404, b'{"error":{"message":"not found"}}', close=not req.keep_alive)
            return
        raw = self.counters.last_body = b"".join(req.body)
        try:
            body = _decode(raw)
        except msgspec.DecodeError:
            self._send(400, b'{"error":{"message":"invalid json","type":"invalid_request_error"}}',
                       close=not req.keep_alive)
            return
        chat = path == b"/v1/chat/completions"
        s = self.settings
        n = min(int(body.get("max_tokens") or body.get("max_completion_tokens") or s.tokens), s.tokens)
        n = max(n, 1)
        prompt_tokens = max(len(raw) // 4, 1)  # about 4 bytes per token
        model = body.get("model") or s.model
        if body.get("stream"):
            options = body.get("stream_options") or {}
            self.task = asyncio.get_running_loop().create_task(
                self._stream(chat, model, n, prompt_tokens, bool(options.get("include_usage")),
                             req.keep_alive))
            return
        delay = s.ttft_s + s.itl_s * (n - 1)
        answer = self._unary(chat, model, n, prompt_tokens)
        if delay > 0:
            asyncio.get_running_loop().call_later(delay, self._send, 200, answer, b"application/json",
                                                  not req.keep_alive)
        else:
            self._send(200, answer, close=not req.keep_alive)

    def _unary(self, chat: bool, model: str, n: int, prompt_tokens: int) -> bytes:
        text = " tok" * n
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                  if chat else {"index": 0, "text": text, "finish_reason": "length"})
        return _encode({"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
                        "created": int(time.time()), "model": model, "choices": [choice],
                        "usage": _usage(prompt_tokens, n, self.settings.cached_ratio)})

    async def _stream(self, chat: bool, model: str, n: int, prompt_tokens: int, include_usage: bool,
                      keep_alive: bool) -> None:
        s = self.settings
        t = self.transport
        if t is None:
            return
        self.counters.streams_open += 1
        try:
            t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                    + (b"" if keep_alive else b"connection: close\r\n") + b"\r\n")
            head = (b'{"id":"chatcmpl-fake","object":"chat.completion.chunk","created":%d,"model":"%s","choices":'
                    if chat else b'{"id":"cmpl-fake","object":"text_completion","created":%d,"model":"%s","choices":'
                    ) % (int(time.time()), model.encode())
            if s.ttft_s > 0:
                await asyncio.sleep(s.ttft_s)
            if chat:
                self._chunk(head + b'[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}')
            for i in range(n):
                if i and s.itl_s > 0:
                    await asyncio.sleep(s.itl_s)
                last = b'"length"' if i == n - 1 else b"null"
                if chat:
                    self._chunk(head + b'[{"index":0,"delta":{"content":" tok"},"finish_reason":%s}]}' % last)
                else:
                    self._chunk(head + b'[{"index":0,"text":" tok","finish_reason":%s}]}' % last)
            if include_usage:
                self._chunk(head + b"[],\"usage\":" + _encode(_usage(prompt_tokens, n, s.cached_ratio)) + b"}")
            if self.transport is not None:
                self.transport.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
                if not keep_alive:
                    self.transport.close()
        finally:
            self.counters.streams_open -= 1
            self.task = None

    def _chunk(self, payload: bytes) -> None:
        if self.transport is None:
            raise asyncio.CancelledError  # the client left
        event = b"data: " + payload + b"\n\n"
        self.transport.write(b"%x\r\n%s\r\n" % (len(event), event))


async def serve(host: str, port: int, settings: Settings, ready: bool = True) -> None:
    counters = Counters()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: UpstreamProtocol(settings, counters), host, port,
                                      backlog=4096, reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready:
        print(f"fake upstream listening on http://{host}:{port}", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9100)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--cached-ratio", type=float, default=0.5)
    p.add_argument("--model", default="demo")
    a = p.parse_args(argv)
    settings = Settings(ttft_s=a.ttft_ms / 1000, itl_s=a.itl_ms / 1000, tokens=a.tokens,
                        cached_ratio=a.cached_ratio, model=a.model)
    try:
        import uvloop
        uvloop.run(serve(a.host, a.port, settings))
    except ImportError:  # pragma: no cover
        asyncio.run(serve(a.host, a.port, settings))


if __name__ == "__main__":
    sys.exit(main())
