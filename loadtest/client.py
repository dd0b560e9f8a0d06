"""Pooled aiohttp client that sends one OpenAI request and times it (streaming or not)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import msgspec

from .sse import SSEDecoder
from .target import Target


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Cost(msgspec.Struct):
    total: float | str | None = None  # the gateway writes a Decimal; accept it as number or string


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None
    cost: _Cost | float | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    message: _Delta | None = None
    text: str | None = None


class _Error(msgspec.Struct):
    message: str = ""
    type: str | None = None
    code: str | int | None = None


class _Body(msgspec.Struct):
    """Both a full response and a stream chunk; unknown fields are ignored on purpose."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: _Error | str | None = None


_decode_body = msgspec.json.Decoder(_Body).decode
_encode = msgspec.json.Encoder().encode


class Outcome(msgspec.Struct, kw_only=True):
    """Raw timing of one HTTP exchange (perf_counter seconds)."""

    start: float
    end: float = 0.0
    first_token: float | None = None
    token_times: list[float] = []
    status: int = 0
    error: str | None = None
    error_detail: str | None = None
    text: str = ""
    usage: _Usage | None = None
    replica: str | None = None
    weight_version: str | None = None
    predicted_cached_tokens: int | None = None

    @property
    def cost(self) -> float | None:
        c = self.usage.cost if self.usage else None
        if isinstance(c, _Cost):
            c = c.total
        return float(c) if c is not None else None


def _choice_text(choice: _Choice) -> str | None:
    d = choice.delta or choice.message
    if d is not None:
        if d.content is not None:
            return d.content
        return d.reasoning_content
    return choice.text


class OpenAIClient:
    """One pooled connection set per target; keep it for the whole run (keep-alive matters at 1k RPS)."""

    def __init__(self, target: Target, *, timeout_s: float = 120.0, max_connections: int = 0) -> None:
        self.target = target
        self._url = target.endpoint
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        headers = {"Content-Type": "application/json", **target.headers}
        if target.api_key:
            headers["Authorization"] = f"Bearer {target.api_key}"
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

    def build_body(self, messages: list[dict[str, str]] | None, prompt: str | None, max_tokens: int,
                   extra: dict[str, Any] | None = None) -> bytes:
        t = self.target
        body: dict[str, Any] = {"model": t.model, "max_tokens": max_tokens, "stream": t.stream}
        if t.api == "chat":
            body["messages"] = messages
        else:
            body["prompt"] = prompt
        if t.stream and t.include_usage:
            body["stream_options"] = {"include_usage": True}
        if t.ignore_eos:
            body["ignore_eos"] = True
        if t.extra_body:
            body.update(t.extra_body)
        if extra:
            body.update(extra)
        return _encode(body)

    async def send(self, body: bytes) -> Outcome:
        assert self._session is not None, "use `async with OpenAIClient(...)`"
        out = Outcome(start=time.perf_counter())
        try:
            async with self._session.post(self._url, data=body) as resp:
                out.status = resp.status
                out.replica = resp.headers.get("x-yieldgate-replica")
                out.weight_version = resp.headers.get("x-yieldgate-weight-version")
                predicted = resp.headers.get("x-yieldgate-predicted-cached-tokens")
                out.predicted_cached_tokens = int(predicted) if predicted and predicted.isdigit() else None
                if resp.status != 200:
                    raw = await resp.read()
                    out.error = f"http_{resp.status}"
                    out.error_detail = _error_message(raw)
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

    def _read_body(self, raw: bytes, out: Outcome) -> None:
        try:
            body = _decode_body(raw)
        except msgspec.DecodeError as exc:
            out.error, out.error_detail = "bad_response", str(exc)
            return
        if body.error is not None:
            out.error, out.error_detail = "response_error", _err_text(body.error)
            return
        out.usage = body.usage
        if body.choices:
            out.text = _choice_text(body.choices[0]) or ""

    async def _read_stream(self, resp: aiohttp.ClientResponse, out: Outcome) -> None:
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
            out.error, out.error_detail = "incomplete_stream", "stream ended without [DONE]"

    def _event(self, name: str, data: bytes, now: float, parts: list[str], times: list[float], out: Outcome) -> bool:
        if data == b"[DONE]":
            return True
        if name == "error":
            out.error, out.error_detail = "stream_error", data.decode(errors="replace")[:500]
            return False
        try:
            chunk = _decode_body(data)
        except msgspec.DecodeError as exc:
            out.error, out.error_detail = "bad_chunk", str(exc)
            return False
        if chunk.error is not None:
            out.error, out.error_detail = "stream_error", _err_text(chunk.error)
            return False
        if chunk.choices:
            # Like vllm bench serve: every chunk with choices is a token event; the first is TTFT.
            if out.first_token is None:
                out.first_token = now
            times.append(now)
            text = _choice_text(chunk.choices[0])
            if text:
                parts.append(text)
        if chunk.usage is not None:
            out.usage = chunk.usage
        return False


def _err_text(err: _Error | str) -> str:
    return err if isinstance(err, str) else err.message


def _error_message(raw: bytes) -> str:
    try:
        body = _decode_body(raw)
        if body.error is not None:
            return _err_text(body.error)[:500]
    except msgspec.DecodeError:
        pass
    return raw[:500].decode(errors="replace")
