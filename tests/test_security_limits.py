"""Request limits from config: body size, message count, max_tokens, concurrent streams per key."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from yieldgate.gateway.config import Config, RequestLimits
from yieldgate.gateway.errors import TooManyRequests
from yieldgate.gateway.limits import StreamLimiter, stream_owner
from yieldgate.serving.config import FleetConfig, ReplicaConfig


def limited_config(stack, **limits) -> Config:
    return Config(limits=RequestLimits(**limits), fleet=FleetConfig(model=stack.model, replicas=[
        ReplicaConfig(name="std-0", tier="standard", url=stack.engines["standard"])]))


def assert_openai_error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code:
        assert err["code"] == code
    return err


def chat(content: str = "hi", **extra) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def test_safe_defaults():
    limits = RequestLimits()
    assert 0 < limits.max_body_bytes <= 16 * 1024 * 1024
    assert 0 < limits.max_messages <= 10_000
    assert 0 < limits.max_tokens <= 32_768
    assert 0 < limits.streams_per_key <= 256
    assert 0 < limits.upstream_read_timeout_s <= 600


def test_body_messages_and_max_tokens_limits(stack, gateway_factory):
    gw = gateway_factory(limited_config(stack, max_body_bytes=2048, max_messages=3, max_tokens=8))
    url = gw.url + "/v1/chat/completions"
    assert_openai_error(httpx.post(url, json=chat("x" * 4096), timeout=30), 413, "payload_too_large")
    # Chunked upload without content-length: counted while streaming in.
    chunks = iter([b'{"model":"demo","messages":[{"role":"user","content":"', b"y" * 4096, b'"}]}'])
    assert_openai_error(httpx.post(url, content=chunks, timeout=30), 413, "payload_too_large")
    too_many = {"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "m"}] * 4}
    err = assert_openai_error(httpx.post(url, json=too_many, timeout=30), 400)
    assert err["param"] == "messages"
    err = assert_openai_error(httpx.post(url, json=chat(max_tokens=9), timeout=30), 400, "invalid_value")
    assert err["param"] == "max_tokens"
    err = assert_openai_error(httpx.post(url, json=chat(max_tokens=None, max_completion_tokens=9), timeout=30), 400)
    assert err["param"] == "max_tokens"
    ok = httpx.post(url, json={"model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": "m"}] * 3},
                    timeout=60)
    assert ok.status_code == 200, ok.text


def test_stream_limiter_counts_per_owner():
    limiter = StreamLimiter(2)
    a1, a2 = limiter.acquire("key:a"), limiter.acquire("key:a")
    limiter.acquire("key:b")
    with pytest.raises(TooManyRequests) as exc:
        limiter.acquire("key:a")
    assert exc.value.status == 429 and exc.value.code == "too_many_streams"
    a1.release()
    a1.release()  # idempotent
    assert limiter.open_streams("key:a") == 1
    limiter.acquire("key:a")
    a2.release()
    assert stream_owner(None, "10.0.0.1") == "ip:10.0.0.1"
    assert StreamLimiter(0).acquire("x") is not None  # 0 disables the limit


def test_concurrent_streams_per_key_are_capped(stack, gateway_factory):
    gw = gateway_factory(limited_config(stack, streams_per_key=2))
    url = gw.url + "/v1/chat/completions"
    # Several MB of events (top_logprobs): more than socket buffers hold, so an unread stream stays
    # open at the gateway until its client closes it (and the engine aborts it).
    long = chat("tell me a long story", max_tokens=4000, stream=True, ignore_eos=True, logprobs=True,
                top_logprobs=20)
    with contextlib.ExitStack() as held, httpx.Client(timeout=60) as http:
        s1 = held.enter_context(held.enter_context(httpx.Client(timeout=60)).stream("POST", url, json=long))
        s2 = held.enter_context(held.enter_context(httpx.Client(timeout=60)).stream("POST", url, json=long))
        readers = []  # dropping a half-read iterator would close its stream: keep them
        for s in (s1, s2):
            assert s.status_code == 200
            readers.append(s.iter_raw())
            next(readers[-1])  # the stream is really open
        third = http.post(url, json=chat(stream=True))
        err = assert_openai_error(third, 429, "too_many_streams")
        assert err["type"] == "rate_limit_error" and third.headers.get("retry-after")
        # Unary requests are not streams: still served.
        assert http.post(url, json=chat()).status_code == 200
        s1.close()
        # The closed stream's slot comes back once the gateway notices the disconnect.
        deadline = time.monotonic() + 30
        while gw.gateway.pipeline.streams.open_streams("ip:127.0.0.1") > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        again = http.post(url, json=chat(stream=True))
        assert again.status_code == 200 and b"data: [DONE]" in again.content
    deadline = time.monotonic() + 30
    while gw.gateway.pipeline.streams.open_streams("ip:127.0.0.1") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gw.gateway.pipeline.streams.open_streams("ip:127.0.0.1") == 0
