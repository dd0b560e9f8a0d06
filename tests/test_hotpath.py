"""The gateway's hot path, functionally: streams are relayed chunk by chunk, upstream connections
are reused, and nothing (connections, asyncio tasks) leaks after many requests.

The upstream is benchmarks/fake_upstream.py in a subprocess: these tests are about the gateway's own
plumbing, which a real engine would only make slower and noisier. No timing thresholds: the
stream test paces the upstream by what the client has received.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
import urllib.request

import aiohttp
import pytest

from conftest import fake_upstream_process
from yieldgate.gateway.config import Config, RequestLimits, ServerConfig
from yieldgate.serving.config import FleetConfig, ReplicaConfig, TierConfig

ITL_MS = 50
TOKENS = 8
MAX_BODY = 64 * 1024


def _counters(url: str) -> dict[str, int]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {line.split()[0].removeprefix("fake_upstream_"): int(line.split()[1])
            for line in text.splitlines() if line}


@pytest.fixture(scope="module")
def fake_upstream():
    with fake_upstream_process("--itl-ms", str(ITL_MS), "--tokens", str(TOKENS)) as url:
        yield url


@pytest.fixture
def hot_gateway(gateway_factory, fake_upstream, redis_url, tmp_path):
    """An in-process gateway whose one-replica fleet is the fake upstream (round robin: no tokenizer)."""
    config = Config(
        server=ServerConfig(redis_url=redis_url, data_dir=str(tmp_path)),
        limits=RequestLimits(streams_per_key=1000, max_body_bytes=MAX_BODY),
        fleet=FleetConfig(model="demo", replicas=[ReplicaConfig(name="fake-0", url=fake_upstream)],
                          tiers={"standard": TierConfig(policy="round_robin")}),
    )
    config.pricing.ledger.journal_dir = str(tmp_path / "journal")
    return gateway_factory(config)


def _in_gateway_loop(gw, coro_fn):
    """Run coro_fn() on the in-process gateway's event loop (it runs in another thread)."""
    loop = gw.gateway.proxy.upstream.loop
    return asyncio.run_coroutine_threadsafe(coro_fn(), loop).result(10)


async def _chat(session: aiohttp.ClientSession, url: str, stream: bool, max_tokens: int = 2) -> bytes:
    # Two tokens: a stream then lasts one upstream ITL, so a thousand of them stay quick.
    body = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
            "stream": stream}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.read()


class LockstepUpstream:
    """An engine stand-in (own thread and loop) whose chat stream sends each token only once the
    client at the far side of the gateway has received the one before: a gateway that buffered
    the stream would deliver nothing, and the upstream gives up after 10 s of waiting."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.sent = 0
        self.gave_up = 0
        self.loop = asyncio.new_event_loop()
        self._acks: asyncio.Queue[None] | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(10)

    def ack(self) -> None:
        """Called by the client for each token it received."""
        self.loop.call_soon_threadsafe(self._acks.put_nowait, None)

    def _run(self, started: threading.Event) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self.loop)
        self._acks = asyncio.Queue()

        async def health(_: web.Request) -> web.Response:
            return web.Response(text="")

        async def chat(request: web.Request) -> web.StreamResponse:
            await request.read()
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(self.tokens):
                delta = {"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}
                self.sent += 1  # before the write: the client may read it before write() returns
                await resp.write(b"data: " + json.dumps(delta, separators=(",", ":")).encode() + b"\n\n")
                if i + 1 < self.tokens:
                    try:
                        await asyncio.wait_for(self._acks.get(), 10)
                    except TimeoutError:
                        self.gave_up += 1
                        break
            usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": self.sent,
                                              "total_tokens": 3 + self.sent}}
            await resp.write(b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", health)
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        self._runner = runner
        started.set()
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


async def test_stream_is_relayed_chunk_by_chunk(gateway_factory, redis_url, tmp_path):
    upstream = LockstepUpstream(TOKENS)
    try:
        config = Config(server=ServerConfig(redis_url=redis_url, data_dir=str(tmp_path)),
                        fleet=FleetConfig(model="demo", replicas=[ReplicaConfig(name="lockstep-0", url=upstream.url)],
                                          tiers={"standard": TierConfig(policy="round_robin")}))
        config.pricing.ledger.journal_dir = str(tmp_path / "journal")
        gw = gateway_factory(config)
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS,
                "stream": True}
        seen: list[int] = []  # tokens the upstream had sent when each token reached the client
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                async for chunk in resp.content.iter_any():
                    for _ in range(chunk.count(b'"delta":{"content"')):
                        seen.append(upstream.sent)
                        upstream.ack()
                tail = chunk
        # Every token reached the client while the upstream still held back the next one.
        assert upstream.gave_up == 0
        assert seen == list(range(1, TOKENS + 1))
        assert tail.endswith(b"data: [DONE]\n\n")
    finally:
        upstream.stop()


def _connection(url: str) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=10)


def _post(conn: http.client.HTTPConnection, body: bytes | list[bytes]) -> tuple[http.client.HTTPResponse, bytes]:
    """POST on one kept-alive connection; a list body goes out in HTTP chunks, one per item."""
    chunked = isinstance(body, list)
    headers = {"content-type": "application/json"}
    if chunked:
        headers["transfer-encoding"] = "chunked"
    conn.request("POST", "/v1/chat/completions", body=iter(body) if chunked else body, headers=headers,
                 encode_chunked=chunked)
    resp = conn.getresponse()
    return resp, resp.read()


CHAT = b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'


def test_unary_answers_share_one_client_connection(hot_gateway):
    conn = _connection(hot_gateway.url)
    try:
        sockets = set()
        for body in (CHAT, [CHAT[:10], CHAT[10:40], CHAT[40:]], CHAT):  # whole, then in three chunks
            resp, data = _post(conn, body)
            sockets.add(id(conn.sock))
            assert resp.status == 200, data
            assert resp.getheader("content-type") == "application/json"
            assert int(resp.getheader("content-length")) == len(data)
            answer = json.loads(data)
            assert answer["usage"]["cost"]["currency"] == "USD"
            assert resp.getheader("x-yieldgate-tier") == "standard"
            assert resp.getheader("x-yieldgate-replica") == "fake-0"
            assert resp.getheader("x-request-id") and resp.getheader("x-yieldgate-cost-usd")
            assert resp.getheader("x-yieldgate-predicted-cached-tokens") == "0"
        assert len(sockets) == 1 and conn.sock is not None  # kept alive across all three
    finally:
        conn.close()


def test_an_idle_client_connection_outlives_the_usual_client_pool_expiry(hot_gateway):
    """httpx (and so the openai client) keeps idle connections 5 s, aiohttp 15 s. A gateway that
    closes them after uvicorn's default 5 s races those clients: a request sent on a connection the
    gateway closes at that moment gets "connection reset by peer" instead of an answer."""
    assert hot_gateway.gateway.config.server.keep_alive_s > 15
    conn = _connection(hot_gateway.url)
    try:
        resp, data = _post(conn, CHAT)
        assert resp.status == 200, data
        first = conn.sock
        time.sleep(6)  # idle past uvicorn's 5 s default
        resp, data = _post(conn, CHAT)  # on a socket the gateway closed: BrokenPipeError or RemoteDisconnected
        assert resp.status == 200, data
        assert conn.sock is first
    finally:
        conn.close()


def test_errors_are_openai_shaped_and_keep_the_connection(hot_gateway):
    conn = _connection(hot_gateway.url)
    try:
        cases = [
            (b'{"model": "demo", "messages": [', 400, "invalid_json"),
            (b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', 404, "model_not_found"),
            (b'{"model": "demo", "messages": []}', 400, None),
            ([b'{"model": "demo", "messages": [{"role": "user", "content": "', b"x" * MAX_BODY, b'"}]}'],
             413, "payload_too_large"),
        ]
        sockets = set()
        for body, status, code in cases:
            resp, data = _post(conn, body)
            assert resp.status == status, data
            assert resp.getheader("content-type") == "application/json"
            error = json.loads(data)["error"]
            assert error["message"] and error["type"] == "invalid_request_error" and "param" in error
            if code:
                assert error["code"] == code
            if status != 413:  # a body refused half-read may cost the connection
                sockets.add(id(conn.sock))
        assert len(sockets) == 1
        resp, data = _post(conn, CHAT)
        assert resp.status == 200, data
    finally:
        conn.close()


def _last_request(url: str) -> bytes:
    with urllib.request.urlopen(url + "/last-request", timeout=5) as r:
        return r.read()


async def test_request_bytes_are_forwarded_unless_a_field_must_change(hot_gateway, fake_upstream):
    url = hot_gateway.url + "/v1/chat/completions"
    headers = {"content-type": "application/json"}
    # Key order, spacing and fields the gateway does not know reach the engine byte for byte.
    unary = (b'{"messages": [{"role": "user", "content": "hi"}],  "model": "demo", "max_tokens": 2,'
             b' "top_k": 5, "vendor_x": {"a": [1, 2.50]}}')
    usage_stream = (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,'
                    b' "stream": true, "stream_options": {"include_usage": true}, "top_k": 5}')
    bare_stream = b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": true, "top_k": 5}'
    async with aiohttp.ClientSession() as s:
        for raw in (unary, usage_stream):
            async with s.post(url, data=raw, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
            assert _last_request(fake_upstream) == raw
        # A stream that did not ask for usage: the engine is asked for it (every token is billed),
        # the client still does not get it.
        async with s.post(url, data=bare_stream, headers=headers) as resp:
            assert resp.status == 200
            relayed = await resp.read()
    sent = json.loads(_last_request(fake_upstream))
    assert sent["stream_options"] == {"include_usage": True} and sent["top_k"] == 5
    assert b'"usage"' not in relayed and relayed.endswith(b"data: [DONE]\n\n")


async def test_upstream_connections_are_reused(hot_gateway, fake_upstream):
    pool = hot_gateway.gateway.proxy.upstream
    # The pool drops connections idle for 2 s (vLLM closes them at 5 s); the fake upstream never
    # does, so with no expiry every sequential request must find the one connection idle.
    pool.keepalive_s = 3600.0
    before = _counters(fake_upstream)["requests_total"]
    async with aiohttp.ClientSession() as s:
        for i in range(200):
            await _chat(s, hot_gateway.url, stream=i % 10 == 1)
    assert _counters(fake_upstream)["requests_total"] - before >= 200
    assert (pool.opened, pool.stale_retries, pool.open) == (1, 0, 1)


class ClosingUpstream:
    """An engine stand-in (own thread and loop) that answers the first request of each connection
    and closes the connection, unanswered, when a second request arrives on it: what a request
    meets when it goes out on a kept-alive connection just as the engine's idle timer closes it."""

    ANSWER = (b'{"id":"x","object":"chat.completion","model":"demo","choices":[{"index":0,"message":'
              b'{"role":"assistant","content":"hi"},"finish_reason":"stop"}],'
              b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}')

    def __init__(self) -> None:
        self.answered = self.dropped = 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        posts = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                await reader.readexactly(length)
                if head.startswith(b"POST"):
                    posts += 1
                    if posts == 2:
                        self.dropped += 1
                        return  # closed with not a byte of answer
                    self.answered += 1
                    body, status = self.ANSWER, b"200 OK"
                else:  # the fleet's /health, /metrics, /weight_info probes
                    body, status = b"", (b"200 OK" if head.startswith(b"GET /health") else b"404 Not Found")
                writer.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._server = server
        started.set()
        self.loop.run_forever()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


async def test_a_request_on_a_kept_alive_connection_closed_under_it_is_re_sent(gateway_factory, redis_url, tmp_path):
    upstream = ClosingUpstream()
    try:
        config = Config(server=ServerConfig(redis_url=redis_url, data_dir=str(tmp_path)),
                        fleet=FleetConfig(model="demo", replicas=[ReplicaConfig(name="closing-0", url=upstream.url)],
                                          tiers={"standard": TierConfig(policy="round_robin")}))
        config.pricing.ledger.journal_dir = str(tmp_path / "journal")
        gw = gateway_factory(config)
        pool = gw.gateway.proxy.upstream
        pool.keepalive_s = 3600.0  # every request after the first goes out on a kept-alive connection
        async with aiohttp.ClientSession() as s:
            for _ in range(4):
                answer = json.loads(await _chat(s, gw.url, stream=False))
                assert answer["choices"][0]["message"]["content"] == "hi"
            async with s.get(gw.url + "/metrics") as resp:
                metrics = await resp.text()
        # Each request after the first met a closed connection and was sent again on a new one, to
        # the same replica: not a retry on another replica, and no client saw an error.
        assert (upstream.answered, upstream.dropped) == (4, 3)
        assert (pool.stale_retries, pool.opened) == (3, 4)
        assert 'yieldgate_upstream_retries_total{tier="standard"}' not in metrics
    finally:
        upstream.stop()


async def test_no_leaked_connections_or_tasks(hot_gateway, fake_upstream):
    async def count_tasks() -> int:
        return len(asyncio.all_tasks())

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(_chat(s, hot_gateway.url, stream=False) for _ in range(20)))
        baseline = _in_gateway_loop(hot_gateway, count_tasks)
        sem = asyncio.Semaphore(100)

        async def one(i: int) -> None:
            async with sem:
                await _chat(s, hot_gateway.url, stream=i % 2 == 0)

        await asyncio.gather(*(one(i) for i in range(1000)))
    # The client pool is closed: the gateway must come to hold no request task and no stream open
    # (finished streams' cleanup callbacks may still be running on a loaded machine: up to 10 s).
    deadline = time.monotonic() + 10
    while True:
        after = _in_gateway_loop(hot_gateway, count_tasks)
        counters = _counters(fake_upstream)
        if (after <= baseline + 2 and counters["streams_open"] == 0) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert after <= baseline + 2, (baseline, after)
    assert counters["streams_open"] == 0
    # Open upstream connections are the gateway's keep-alive pool (+ health checks), bounded by
    # the client concurrency, not growing with the request count.
    assert counters["connections_open"] <= 110, counters
    assert hot_gateway.gateway.proxy.upstream.in_use == 0


async def test_ledger_and_request_metrics_can_be_switched_off(gateway_factory, fake_upstream, redis_url, tmp_path):
    # The benchmark measures each feature's cost by switching it off; the gateway must still serve.
    config = Config(
        server=ServerConfig(redis_url=redis_url, data_dir=str(tmp_path), admin_token="t0ken",
                            ledger=False, request_metrics=False),
        fleet=FleetConfig(model="demo", replicas=[ReplicaConfig(name="fake-0", url=fake_upstream)],
                          tiers={"standard": TierConfig(policy="round_robin")}),
    )
    gw = gateway_factory(config)
    async with aiohttp.ClientSession() as s:
        answer = json.loads(await _chat(s, gw.url, stream=False))
        assert "cost" in answer["usage"]  # pricing stays on
        await _chat(s, gw.url, stream=True)
        async with s.get(gw.url + "/admin/spend", headers={"authorization": "Bearer t0ken"}) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "ledger_disabled"
        async with s.get(gw.url + "/metrics") as resp:
            assert 'yieldgate_requests_total{' not in await resp.text()
    assert gw.gateway.accounting.ledger is None


def test_batched_histogram_observations_export_as_prometheus_observe_would():
    """The request path counts histogram observations into buckets and adds them at the scrape
    (gateway.metrics.CounterBatch): the exposition must equal observing each value directly."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from yieldgate.gateway.metrics import CounterBatch

    def exposition(registry: CollectorRegistry) -> list[str]:
        return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]

    direct_registry, batched_registry = CollectorRegistry(), CollectorRegistry()
    direct = Histogram("h", "doc", ["tier"], buckets=(0.005, 0.01, 1, 5), registry=direct_registry)
    batched = Histogram("h", "doc", ["tier"], buckets=(0.005, 0.01, 1, 5), registry=batched_registry)
    batch = CounterBatch()
    for values in ([0.0, 0.005, 0.0051, 0.3, 7.0, 1e9, 2.5], [0.01, 0.01, 4.99]):
        for v in values:
            for tier in ("standard", "fast"):
                direct.labels(tier).observe(v)
                batch.observe(batched.labels(tier), v)
        assert exposition(batched_registry) != exposition(direct_registry)  # not applied before the scrape
        batch.apply()
        assert exposition(batched_registry) == exposition(direct_registry)
    assert 'h_bucket{le="0.005",tier="fast"} 2.0' in exposition(batched_registry)
