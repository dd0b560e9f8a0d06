"""Pooled aiohttp client that sends one request and times it (streaming or not), in the target's
wire format (chat completions, completions, Responses or Messages: loadtest/wire.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import msgspec

from .sse import SSEDecoder
from .target import Target
from .wire import WIRES, BadAnswer, WireUsage, error_message

_encode = msgspec.json.Encoder().encode


class RequestOutcome(msgspec.Struct, kw_only=True):
    """Raw timing of one HTTP exchange (perf_counter seconds)."""

    start: float
    end: float = 0.0
    first_token: float | None = None
    token_times: list[float] = []
    status: int = 0
    error: str | None = None
    error_detail: str | None = None
    text: str = ""
    usage: WireUsage | None = None
    replica: str | None = None
    request_id: str | None = None
    weight_version: str | None = None
    predicted_cached_tokens: int | None = None

    @property
    def cost(self) -> float | None:
        return self.usage.cost if self.usage else None


class OpenAIClient:
    """One pooled connection set per target; keep it for the whole run (keep-alive matters at 1k RPS)."""

    def __init__(self, target: Target, *, timeout_s: float = 120.0, max_connections: int = 0) -> None:
        self.target = target
        self._url = target.endpoint
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.wire = WIRES[target.api]
        headers = {"Content-Type": "application/json", **target.headers}
        if target.api_key:
            headers["Authorization"] = f"Bearer {target.api_key}"
            if target.api == "messages":
                headers["x-api-key"] = target.api_key  # Anthropic's own header
        if target.api == "messages":
            headers.setdefault("anthropic-version", "2023-06-01")
        self._headers = headers
        self._session: aiohttp.ClientSession | None = None
        self._max_connections = max_connections

    async def __aenter__(self) -> "OpenAIClient":
        connector = aiohttp.TCPConnector(limit=self._max_connections, ttl_dns_cache=300, keepalive_timeout=60)
        # No cookie jar and no auto-decompression work: keep per-request client CPU low.
        self._session = aiohttp.ClientSession(
            connector=connector, headers=self._headers, timeout=self._timeout,
            cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    def build_body(self, messages: list[dict[str, Any]] | None, prompt: str | None, max_tokens: int,
                   extra: dict[str, Any] | None = None, tools: list[dict] | None = None) -> bytes:
        """The request in the target's wire format; `prompt` (completions only) overrides the
        transcript the completions wire would render from `messages`."""
        t = self.target
        body = self.wire.body(t.model, messages or [], tools, max_tokens, t.stream, t.include_usage)
        if prompt is not None and t.api == "completions":
            body["prompt"] = prompt
        if t.ignore_eos:
            body["ignore_eos"] = True
        if t.extra_body:
            body.update(t.extra_body)
        if extra:
            body.update(extra)
        return _encode(body)

    async def send(self, body: bytes) -> RequestOutcome:
        assert self._session is not None, "use `async with OpenAIClient(...)`"
        out = RequestOutcome(start=time.perf_counter())
        try:
            async with self._session.post(self._url, data=body) as resp:
                out.status = resp.status
                out.replica = resp.headers.get("x-yieldgate-replica")
                out.request_id = resp.headers.get("x-request-id")
                out.weight_version = resp.headers.get("x-yieldgate-weight-version")
                predicted = resp.headers.get("x-yieldgate-predicted-cached-tokens")
                out.predicted_cached_tokens = int(predicted) if predicted and predicted.isdigit() else None
                if resp.status != 200:
                    raw = await resp.read()
                    out.error = f"http_{resp.status}"
                    out.error_detail = error_message(raw)
                elif self.target.stream:
                    await self._read_stream(resp, out)
                else:
                    raw = await resp.read()
                    out.first_token = time.perf_counter()
                    self._read_body(raw, out)
        except asyncio.TimeoutError:
            out.error, out.error_detail = "timeout", "request exceeded timeout"
        except aiohttp.ClientPayloadError as exc:
            out.error, out.error_detail = "stream_broken", str(exc)
        except aiohttp.ClientConnectionError as exc:
            out.error, out.error_detail = "connection", str(exc) or type(exc).__name__
        except aiohttp.ClientError as exc:
            out.error, out.error_detail = "client", str(exc) or type(exc).__name__
        out.end = time.perf_counter()
        return out

    def _read_body(self, raw: bytes, out: RequestOutcome) -> None:
        try:
            out.text, out.usage = self.wire.answer(raw)
        except BadAnswer as exc:
            out.error, out.error_detail = "response_error", str(exc)

    async def _read_stream(self, resp: aiohttp.ClientResponse, out: RequestOutcome) -> None:
        decoder = SSEDecoder()
        parts: list[str] = []
        times = out.token_times
        done = False
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            for ev in decoder.feed(chunk):
                if self._event(ev.event, ev.data, now, parts, times, out):
                    done = True
        for ev in decoder.flush():
            done = self._event(ev.event, ev.data, time.perf_counter(), parts, times, out) or done
        out.text = "".join(parts)
        if out.error is None and not done:
            out.error, out.error_detail = "incomplete_stream", "stream ended without its end event"

    def _event(self, name: str, data: bytes, now: float, parts: list[str], times: list[float], out: RequestOutcome) -> bool:
        if name == "error":
            try:
                detail = self.wire.event(name, data).error
            except BadAnswer:
                detail = None
            out.error, out.error_detail = "stream_error", (detail or data.decode(errors="replace"))[:500]
            return False
        try:
            piece = self.wire.event(name, data)
        except BadAnswer as exc:
            out.error, out.error_detail = "bad_chunk", str(exc)
            return False
        if piece.error is not None:
            out.error, out.error_detail = "stream_error", piece.error[:500]
            return False
        if piece.token:
            if out.first_token is None:
                out.first_token = now
            times.append(now)
            if piece.text:
                parts.append(piece.text)
        if piece.usage is not None:
            out.usage = piece.usage if out.usage is None else out.usage.merged(piece.usage)
        return piece.done
