"""Faults a gateway meets in production, against a vLLM engine this module starts for itself:
clients that leave mid-stream, clients that read slowly, an engine SIGKILLed under load, and an
engine whose core process dies mid-stream.

One engine start (~60-90 s here) and one restart for the whole module; the kill tests run last.
"""

from __future__ import annotations

import asyncio
import csv
import io
import logging
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import record_counts

from yieldgate.gateway.config import Config
from yieldgate.serving.config import FleetConfig, LaunchSpec, ReplicaConfig
from yieldgate.serving.launcher import Launcher

CHAOS_PORT = int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000")) + 201  # beside the test stack's ports
# A small KV cache (2,048 blocks of 32 tokens) that a test can overflow: the engine then evicts
# cached blocks and announces BlockRemoved. Room enough for the drills' 4,000-token streams.
KV_BLOCKS = 2048
ENGINE_ARGS = ["--gpu-memory-utilization", "0.3", "--max-model-len", "4096", "--max-num-seqs", "32",
               "--enable-prefix-caching", "--enable-prompt-tokens-details",
               "--num-gpu-blocks-override", str(KV_BLOCKS), "--enforce-eager"]  # starts sooner (tests/engines.py)


def engine_metric(url: str, name: str) -> float:
    for attempt in range(3):  # an engine busy streaming can take a while to answer /metrics
        try:
            text = urllib.request.urlopen(url + "/metrics", timeout=20).read().decode()
            break
        except OSError:
            if attempt == 2:
                raise
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name in (name, name + "_total"))


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except OSError:  # an engine busy streaming can be slow to answer /metrics: ask again
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class ChaosEngine:
    """One vLLM engine started through serving.Launcher, so it can be killed and started again."""

    def __init__(self, model_dir: Path, log_dir: Path):
        self.replica = ReplicaConfig(name="chaos-0", tier="standard",
                                     launch=LaunchSpec(port=CHAOS_PORT, args=ENGINE_ARGS, kv_events=True,
                                                       startup_timeout_s=300))
        self.fleet = FleetConfig(model="demo", replicas=[self.replica])
        self.model_dir, self.log_dir = str(model_dir), log_dir
        self.launcher: Launcher | None = None

    @property
    def url(self) -> str:
        return self.replica.base_url

    def start(self) -> None:
        self.launcher = Launcher(self.fleet, self.model_dir, self.log_dir)
        self.launcher.start()
        self.launcher.wait_healthy(timeout=300)

    def ensure_running(self) -> None:
        """Start the engine again if an earlier test killed it and failed before restarting it: one
        failure should not fail every later test of the module."""
        if self.launcher is None or self.launcher.engines[0].process.poll() is not None:
            self.stop()
            self.start()

    def sigkill(self) -> None:
        assert self.launcher is not None
        os.killpg(self.launcher.engines[0].process.pid, signal.SIGKILL)
        # A killed process always goes, but unmapping a few GB of engine memory on a loaded 2-core
        # machine outlasted 10 s once in CI.
        self.launcher.engines[0].process.wait(60)

    def stop(self) -> None:
        if self.launcher is not None:
            self.launcher.stop()


@pytest.fixture(scope="module")
def chaos_engine_process(stack, tmp_path_factory):
    engine = ChaosEngine(stack.model_dir, tmp_path_factory.mktemp("chaos-logs"))
    try:
        engine.start()
        yield engine
    finally:
        engine.stop()


@pytest.fixture
def chaos_engine(chaos_engine_process):
    chaos_engine_process.ensure_running()
    return chaos_engine_process


def gateway_config(stack, *urls: tuple[str, str], **limits) -> Config:
    config = Config(fleet=FleetConfig(model=stack.model, health_interval_s=0.5, replicas=[
        ReplicaConfig(name=name, tier="standard", url=url) for name, url in urls]))
    for key, value in limits.items():
        setattr(config.limits, key, value)
    return config


# -- a client that leaves ----------------------------------------------------------------------

def test_client_disconnect_aborts_the_engine_request(stack, chaos_engine, gateway_factory):
    gw = gateway_factory(gateway_config(stack, ("chaos-0", chaos_engine.url)))
    # On a loaded machine the engine can generate every token before the client's third event, or
    # between the client leaving and the abort reaching the engine core: such an attempt cannot show
    # an abort, so the client tries again (3 tries).
    # A gateway that does not pass the client's leaving on lets every try run to the end.
    max_tokens = 3500
    for attempt in range(3):
        before = engine_metric(chaos_engine.url, "vllm:generation_tokens")
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", gw.url + "/v1/chat/completions", json={
                    "model": "demo", "messages": [{"role": "user", "content": "go on forever"}],
                    "max_tokens": max_tokens, "ignore_eos": True, "stream": True}) as resp:
                assert resp.status_code == 200
                events = 0
                for line in resp.iter_lines():
                    events += line.startswith("data: ")
                    if events >= 3:
                        break
                left_mid_generation = engine_metric(chaos_engine.url, "vllm:num_requests_running") >= 1
        # The gateway closed its upstream connection; vLLM aborts the request on disconnect.
        wait_until(lambda: engine_metric(chaos_engine.url, "vllm:num_requests_running") == 0, 30,
                   "the engine to stop running the abandoned request")
        generated = engine_metric(chaos_engine.url, "vllm:generation_tokens") - before
        print(f"\n[chaos] tokens generated for an abandoned {max_tokens}-token stream: {generated:.0f}"
              f"{'' if left_mid_generation else ' (the engine had finished before the client left)'}")
        if left_mid_generation and generated < max_tokens:
            break
    assert left_mid_generation, "the engine finished all 3 streams before their client read 3 events"
    assert 2 <= generated < max_tokens  # 3 events read: the role chunk and two tokens; then the abort
    assert wait_until(lambda: gw.gateway.fleet.replicas["chaos-0"].inflight == 0, 10, "inflight back to 0")


# -- a client that reads slowly ------------------------------------------------------------------

class CountingRelay:
    """TCP relay gateway -> engine counting, per connection, the bytes sent towards the gateway."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.sent: dict[int, int] = {}
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                down, _ = self.sock.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.target_port))
            conn = len(self.sent)
            self.sent[conn] = 0
            threading.Thread(target=self._pump, args=(down, up, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, conn), daemon=True).start()

    @property
    def to_gateway(self) -> int:
        # The stream's connection; health probes and /metrics scrapes use other, smaller ones.
        return max(self.sent.values(), default=0)

    def _pump(self, src: socket.socket, dst: socket.socket, conn: int | None) -> None:
        try:
            while data := src.recv(16384):
                dst.sendall(data)  # blocks while the gateway does not read: backpressure passes
                if conn is not None:
                    self.sent[conn] += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self.sock.close()


def kernel_queued(*ports: int) -> int:
    """Bytes in kernel socket queues (Recv-Q + Send-Q) of every TCP socket on these ports."""
    filt = " or ".join(f"sport = :{p} or dport = :{p}" for p in ports)
    out = subprocess.run(["ss", "-tnH", "state", "established", f"( {filt} )"],
                         capture_output=True, text=True, check=True).stdout
    total = 0
    for line in out.splitlines():
        fields = line.split()
        total += int(fields[0]) + int(fields[1])
    return total


def test_slow_client_does_not_make_the_gateway_buffer(stack, chaos_engine, gateway_factory):
    relay = CountingRelay(CHAOS_PORT)
    gw = gateway_factory(gateway_config(stack, ("chaos-0", f"http://127.0.0.1:{relay.port}")))
    body = (b'{"model":"demo","stream":true,"max_tokens":3000,"ignore_eos":true,"logprobs":true,'
            b'"top_logprobs":20,"messages":[{"role":"user","content":"talk"}]}')
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)  # a slow reader with a small window
    client.connect(("127.0.0.1", gw.port))
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    received = client.recv(4096)
    gen_before = engine_metric(chaos_engine.url, "vllm:generation_tokens")
    try:
        # Stop reading while the engine generates all 3000 tokens.
        wait_until(lambda: engine_metric(chaos_engine.url, "vllm:num_requests_running") == 0
                   and engine_metric(chaos_engine.url, "vllm:generation_tokens") > gen_before, 120,
                   "the engine to finish generating", interval=0.5)
        time.sleep(1.0)
        taken_while_paused = relay.to_gateway
        in_kernel = kernel_queued(gw.port, relay.port)
        # What the relay sent and the client has not read sits in socket queues or in the gateway.
        held = taken_while_paused - len(received) - in_kernel
        client.settimeout(60)
        while not received.endswith(b"0\r\n\r\n"):  # the chunked stream's last chunk
            chunk = client.recv(65536)
            if not chunk:
                break
            received += chunk
    finally:
        client.close()
        relay.close()
    total = len(received)
    print(f"\n[chaos] slow client: stream {total / 1e6:.1f} MB; while the client was not reading, "
          f"{taken_while_paused / 1e6:.2f} MB left the engine, {in_kernel / 1e6:.2f} MB sat in kernel socket "
          f"queues, {held / 1e3:.0f} kB in the gateway process")
    assert b"data: [DONE]" in received
    assert total > 3_000_000, "the stream must be much larger than any buffer for this to mean anything"
    # Backpressure: the gateway holds its upstream reader (64 KB, then it stops reading) and uvicorn
    # writer buffers plus what it has in hand (measured 0.6-1.3 MB here, depending on machine
    # load), never the stream.
    assert held < 2_000_000 and held < total / 2


# -- an engine that stalls ---------------------------------------------------------------------

def test_a_stalled_replica_is_ejected_only_after_repeated_probe_timeouts(stack, chaos_engine, gateway_factory,
                                                                         caplog):
    """A busy engine on a loaded host can stall for seconds; one slow /health must not eject it (a
    tier with one replica would answer 503s meanwhile), several in a row must."""
    config = gateway_config(stack, ("chaos-0", chaos_engine.url))
    config.fleet.health_timeout_s, config.fleet.health_timeouts_to_eject = 0.5, 4
    gw = gateway_factory(config)
    victim = gw.gateway.fleet.replicas["chaos-0"]
    wait_until(lambda: victim.healthy, 20, "the replica healthy")
    caplog.set_level(logging.INFO, logger="yieldgate.fleet")
    caplog.clear()
    group = chaos_engine.launcher.engines[0].process.pid
    answers: list[int] = []
    os.killpg(group, signal.SIGSTOP)
    try:
        # A request that arrives during the stall waits for the engine instead of failing.
        waiting = threading.Thread(target=lambda: answers.append(httpx.post(
            gw.url + "/v1/completions", timeout=120,
            json={"model": "demo", "prompt": "stalled", "max_tokens": 3}).status_code))
        waiting.start()
        wait_until(lambda: not victim.healthy, 30, "a replica that stops answering to be ejected")
        assert victim.probe_timeouts >= 4
    finally:
        os.killpg(group, signal.SIGCONT)
    # The fleet's own record of the probes, in order: three timeouts tolerated, the fourth ejects.
    probes = [r.getMessage() for r in caplog.records if r.name == "yieldgate.fleet" and "chaos-0" in r.getMessage()]
    assert probes[:4] == [f"replica chaos-0: health probe timed out ({n} in a row)" for n in (1, 2, 3)] + [
        "replica chaos-0 is down"], probes
    wait_until(lambda: victim.healthy, 30, "the gateway to re-admit the resumed replica")
    assert victim.probe_timeouts == 0
    waiting.join(120)
    assert answers == [200]


# -- an engine whose KV cache overflows ------------------------------------------------------------

async def test_blocks_the_engine_evicts_leave_the_prefix_index(chaos_engine):
    """vLLM evicts the least recently used cached blocks when a new prompt needs room and announces
    BlockRemoved: the index fed by its events drops them too, instead of predicting hits there."""
    import random

    from yieldgate.cache import KVEventSubscriber, PrefixIndex

    from yieldgate.serving.fleet import parse_engine_metrics

    text = urllib.request.urlopen(chaos_engine.url + "/metrics", timeout=20).read().decode()
    assert parse_engine_metrics(text)[1] == KV_BLOCKS, "the engine did not take the KV cache size override"
    index = PrefixIndex()  # no capacity of its own set: what it holds is what the events say
    subscriber = KVEventSubscriber("chaos-0", chaos_engine.replica.kv_events, index)
    subscriber.start()
    rng = random.Random(7)
    blocks_per_prompt = 60

    async def cached_after(prompt_ids: list[int]) -> set:
        before = set(index.blocks("chaos-0"))
        async with httpx.AsyncClient(timeout=120) as http:
            r = await http.post(chaos_engine.url + "/v1/completions",
                                json={"model": "demo", "prompt": prompt_ids, "max_tokens": 1})
            r.raise_for_status()
        for _ in range(200):  # the engine's events arrive a little after its answer
            new = set(index.blocks("chaos-0")) - before
            if len(new) >= blocks_per_prompt:
                return new
            await asyncio.sleep(0.05)
        raise AssertionError(f"only {len(new)} of {blocks_per_prompt} blocks announced")

    def fresh_prompt() -> list[int]:  # random ids: no block of it is cached anywhere yet
        return [rng.randrange(10, 1000) for _ in range(blocks_per_prompt * 32 + 5)]

    try:
        for attempt in range(3):  # PUB/SUB joins asynchronously: a first prompt can go unseen
            try:
                first = await cached_after(fresh_prompt())
                break
            except AssertionError:
                if attempt == 2:
                    raise
        # Enough new prompts to fill the whole cache again: the first prompt's blocks are the
        # least recently used, so they go first.
        for _ in range(KV_BLOCKS // blocks_per_prompt + 6):
            last = await cached_after(fresh_prompt())
        held = set(index.blocks("chaos-0"))
        stats = index.stats()
        print(f"\n[chaos] KV cache of {KV_BLOCKS} blocks overflowed: index holds {len(held)} blocks, "
              f"{stats.removed} removed by BlockRemoved events")
        assert stats.removed > 0
        assert not first & held, f"{len(first & held)} evicted blocks still in the index"
        assert last <= held
        assert len(held) <= KV_BLOCKS
    finally:
        await subscriber.stop()


# -- an engine that dies under load --------------------------------------------------------------

def gateway_log(caplog, t0: float) -> list[str]:
    """The gateway's log records so far, each with its time in seconds after `t0` (monotonic)."""
    offset = time.monotonic() - time.time()
    return [f"{r.created + offset - t0:.2f} {r.name} {r.getMessage()}" for r in caplog.records
            if r.name.startswith(("yieldgate", "gateway", "serving"))]


def test_replica_sigkill_under_load(stack, chaos_engine, gateway_factory, caplog):
    config = gateway_config(stack, ("chaos-0", chaos_engine.url), ("std-1", stack.engines["standard"]))
    config.fleet.replicas[0].kv_events_endpoint = chaos_engine.replica.kv_events
    gw = gateway_factory(config)
    fleet = gw.gateway.fleet
    wait_until(lambda: all(r.healthy for r in fleet.replicas.values()), 20, "both replicas healthy")
    subscriber = gw.gateway.routing.subscribers["chaos-0"]
    long_prompt = " ".join(f"word{i}" for i in range(200))  # several full KV blocks: BlockStored events

    def fill_cache(tag: str) -> None:
        httpx.post(chaos_engine.url + "/v1/completions", timeout=60,
                   json={"model": "demo", "prompt": f"{tag} {long_prompt}", "max_tokens": 1}).raise_for_status()

    caplog.set_level(logging.INFO, logger="yieldgate.serving.upstream")
    fill_cache("before")
    wait_until(lambda: subscriber.events > 0, 30, "KV events from the engine before the kill")
    stop = threading.Event()
    unary: list[tuple[int, str, str]] = []
    unary_times: list[tuple[float, float, int, str]] = []  # (start, end, status, replica): read on failure
    streams: list[tuple[int, str, bytes, bool]] = []  # (status, replica, body, the client left it at the stop)
    url = gw.url + "/v1/chat/completions"
    lock = threading.Lock()
    # Start times of the streams being read from the replica about to be killed. A stream whose
    # client is still reading may already be finished at the engine (the rest sits in socket
    # buffers), so the kill waits for one that started recently: less than 0.3x the time the engine
    # takes for 4000 tokens alone (on a fast machine it generates all 4000 tokens of the only stream
    # there in under 2 s while the client still reads: nothing is cut; under load it only gets slower).
    live_on_victim: dict[tuple[int, int], float] = {}
    timed = time.monotonic()
    httpx.post(chaos_engine.url + "/v1/completions", timeout=300, json={
        "model": "demo", "prompt": "how long", "max_tokens": 4000, "ignore_eos": True}).raise_for_status()
    recent_s = 0.3 * (time.monotonic() - timed)

    def unary_worker(i: int) -> None:
        # As long as the gateway waits for an engine (upstream_read_timeout_s): on a loaded 2-core
        # machine a few unary requests queued on the busy survivor can take minutes; a client that
        # gives up first measures the machine, not a request the gateway lost.
        with httpx.Client(timeout=300) as http:
            n = 0
            while not stop.is_set():
                n += 1
                started = time.monotonic()
                try:
                    r = http.post(url, json={"model": "demo", "max_tokens": 24, "ignore_eos": True,
                                             "messages": [{"role": "user", "content": f"unary {i} {n}"}]})
                    unary.append((r.status_code, r.headers.get("x-yieldgate-replica", ""), r.text[:300]))
                except httpx.HTTPError as exc:
                    unary.append((0, "", repr(exc)))
                unary_times.append((started, time.monotonic(), unary[-1][0], unary[-1][1]))

    def stream_worker(i: int) -> None:
        with httpx.Client(timeout=120) as http:
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    with http.stream("POST", url, json={
                            "model": "demo", "max_tokens": 4000, "ignore_eos": True, "stream": True,
                            "messages": [{"role": "user", "content": f"stream {i} {n}"}]}) as r:
                        replica = r.headers.get("x-yieldgate-replica", "")
                        key = (i, n)
                        if replica == "chaos-0":
                            with lock:
                                live_on_victim[key] = time.monotonic()
                        try:
                            # At the stop the client leaves a stream it is still reading: waiting
                            # for thousands more tokens from the busy survivor tests nothing.
                            body, left = bytearray(), False
                            for chunk in r.iter_bytes():
                                body += chunk
                                if stop.is_set():
                                    left = not body.rstrip().endswith(b"data: [DONE]")
                                    break
                            streams.append((r.status_code, replica, bytes(body), left))
                        finally:
                            with lock:
                                live_on_victim.pop(key, None)
                except httpx.HTTPError as exc:
                    streams.append((0, "", repr(exc).encode(), False))

    threads = [threading.Thread(target=unary_worker, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=stream_worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        victim = fleet.replicas["chaos-0"]
        # Kill only once a stream is mid-flight there (on a quiet machine streams finish quickly).
        def fresh_stream_on_victim() -> bool:
            with lock:
                started = list(live_on_victim.values())
            return any(time.monotonic() - t < recent_s for t in started)

        try:
            wait_until(lambda: fresh_stream_on_victim() and victim.inflight >= 2 and len(unary) >= 2, 180,
                       "a stream that just started and other load on the victim replica", interval=0.05)
        except AssertionError as exc:
            with lock:
                ages = [round(time.monotonic() - t, 2) for t in live_on_victim.values()]
            raise AssertionError(f"{exc}; recent = {recent_s:.2f} s; on the victim now: {ages} s old, "
                                 f"{victim.inflight} in flight; {len(unary)} unary done; "
                                 f"streams by replica: {[s[1] for s in streams]}") from None
        inflight_at_kill = victim.inflight
        kill_started = time.monotonic()
        chaos_engine.sigkill()
        killed_at = time.monotonic()  # the engine's API server is reaped: its sockets are closed
        try:
            # A request or a probe finds it gone at once on a quiet machine; a busy one needs longer.
            wait_until(lambda: not victim.healthy, 30, "the gateway to eject the killed replica")
            ejected_after = time.monotonic() - killed_at
            # The survivor keeps the gateway up (a probe of the busy survivor may time out now and then).
            def survivor_serves() -> bool:
                health = httpx.get(gw.url + "/healthz", timeout=10).json()
                return health["replicas"]["chaos-0"]["healthy"] is False and health["status"] == "ok"

            wait_until(survivor_serves, 30, "/healthz: the killed replica out, the gateway ok")
            wait_until(lambda: time.monotonic() - killed_at > 4, 10, "load after the kill")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the kill took {killed_at - kill_started:.2f} s; gateway log (s "
                                 f"after the kill): {gateway_log(caplog, killed_at)}") from None
    finally:
        inflight_at_stop = {name: r.inflight for name, r in fleet.replicas.items()}
        stop.set()
        deadline = time.monotonic() + 330
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a client was still waiting 330 s after the load stopped"

    failed_unary = [u for u in unary if u[0] != 200]
    cut_streams = [s for s in streams if b'"upstream_error"' in s[2]]
    left = sum(s[3] for s in streams)
    print(f"\n[chaos] SIGKILL with {inflight_at_kill} requests in flight on the victim: "
          f"{len(unary)} unary ({len(failed_unary)} failed), {len(streams)} streams "
          f"({len(cut_streams)} cut mid-stream with an error event, {left} left by the client at the stop); the kill took "
          f"{killed_at - kill_started:.2f} s, ejected {ejected_after:.2f} s after; slowest unary "
          f"{max((b - a for a, b, _, _ in unary_times), default=0):.1f} s; killed when a stream there was "
          f"< {recent_s:.2f} s old; requests re-sent on a new "
          f"connection after a kept-alive one closed: {gw.gateway.proxy.upstream.stale_retries}")
    record_counts("chaos_faults", "tests/test_chaos_faults.py::test_replica_sigkill_under_load",
                  ["gateway/", "cache/", "serving/", "pricing/", "tests/test_chaos_faults.py"], {
                      "in_flight_at_kill": inflight_at_kill, "unary": len(unary), "unary_failed": len(failed_unary),
                      "streams": len(streams), "streams_cut_with_error_event": len(cut_streams),
                      "streams_left_by_client_at_stop": left,
                      # Failures the gateway avoided by sending again, counted apart from the requests.
                      "gateway_retries_on_another_replica": int(engine_metric(gw.url, "yieldgate_upstream_retries")),
                      "gateway_resends_after_closed_keepalive": gw.gateway.proxy.upstream.stale_retries})
    timeline = [(round(a - killed_at, 2), round(b - a, 2), status, replica)
                for a, b, status, replica in unary_times]
    log_lines = gateway_log(caplog, killed_at)
    print("[chaos] gateway log (s after the kill):", *log_lines, sep="\n  ")
    assert failed_unary == [], (f"in flight at the stop: {inflight_at_stop}; unary requests (start after "
                                f"the kill s, duration s, status, replica): {timeline}; gateway log "
                                f"(s after the kill): {log_lines}")
    for status, replica, body, left_at_stop in streams:
        assert status == 200, body[:300]
        assert left_at_stop or body.rstrip().endswith(b"data: [DONE]"), body[-300:]
        if b'"upstream_error"' in body:
            assert replica == "chaos-0"
            error_event = [line for line in body.split(b"\n\n") if b'"error"' in line][0]
            assert error_event.startswith(b'data: {"error":{"message":')
            assert b'"type":"upstream_error","param":null,"code":"upstream_error"' in error_event
    assert cut_streams, ("no stream was cut on the killed replica; streams there: "
                         f"{[(status, body[-200:]) for status, replica, body, _ in streams if replica == 'chaos-0']}")

    # Re-admission: the health check brings the replica back once it answers again.
    chaos_engine.start()
    wait_until(lambda: victim.healthy, 30, "the gateway to re-admit the restarted replica")
    # The KV-event subscriber notices the new engine process (its event sequence starts over) and
    # forgets the blocks the dead one held.
    fill_cache("after")
    wait_until(lambda: subscriber.restarts >= 1, 30, "the KV-event subscriber to notice the restart")
    assert httpx.get(gw.url + "/healthz", timeout=10).json()["replicas"]["chaos-0"]["healthy"] is True
    # The prompt just cached on the restarted engine: cache-aware routing sends it there once the
    # replica is routable again and its new KV events are indexed (the warm survivor would win any
    # other prompt, so "4 chat requests, one of them there" depended on the routing's tie-breaks).
    served_by = [httpx.post(gw.url + "/v1/completions", timeout=60, json={
        "model": "demo", "prompt": f"after {long_prompt}", "max_tokens": 2}).headers["x-yieldgate-replica"]
        for _ in range(4)]
    assert "chaos-0" in served_by, served_by


# -- an engine whose core dies mid-stream (runs last: the engine stays dead) ----------------------

def test_engine_core_death_mid_stream_bills_the_relayed_tokens(stack, chaos_engine, gateway_factory, tmp_path):
    """vLLM's API server outlives its engine core for a moment: a stream then ends with vLLM's own
    error event and [DONE] but no usage event. The gateway relays them and bills the tokens it
    relayed (status upstream_error), as for a stream the client abandons, not an "ok" with none."""
    admin = "chaos-admin-" + secrets.token_hex(4)
    config = gateway_config(stack, ("chaos-0", chaos_engine.url))
    config.server.admin_token, config.server.data_dir = admin, str(tmp_path / "data")
    gw = gateway_factory(config)
    wait_until(lambda: gw.gateway.fleet.replicas["chaos-0"].healthy, 60, "the replica healthy")
    group = chaos_engine.launcher.engines[0].process.pid
    cores = subprocess.run(["pgrep", "-g", str(group), "-f", "VLLM::EngineCor"],
                           capture_output=True, text=True).stdout.split()
    assert cores, "no engine core process in the engine's process group"
    rid = "req-core-death-" + uuid.uuid4().hex
    events: list[str] = []
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", gw.url + "/v1/chat/completions", headers={"x-request-id": rid}, json={
                "model": "demo", "messages": [{"role": "user", "content": "go on"}],
                "max_tokens": 4000, "ignore_eos": True, "stream": True}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 10:
                        for pid in cores:
                            os.kill(int(pid), signal.SIGKILL)
    assert events[-1] == "data: [DONE]"
    assert events[-2].startswith('data: {"error"'), events[-3:]  # vLLM's, relayed as it is
    assert not any('"usage":{' in e for e in events)
    # The first event carries only the role; every other one before the error carries tokens.
    relayed = len(events) - 3
    assert 9 <= relayed < 4000
    deadline = time.monotonic() + 30
    while True:
        rows = [r for r in csv.DictReader(io.StringIO(httpx.get(
            gw.url + "/admin/ledger.csv", headers={"authorization": f"Bearer {admin}"}, timeout=30).text))
            if r["request_id"] == rid]
        if rows or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(rows) == 1
    row = rows[0]
    assert row["status"] == "upstream_error"
    assert int(row["completion_tokens"]) == relayed
    assert int(row["prompt_tokens"]) > 0 and Decimal(row["cost_total"]) > 0
