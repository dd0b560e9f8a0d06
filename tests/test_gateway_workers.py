"""`server.workers = 2`: two gateway processes on one port (SO_REUSEPORT) in front of a real vLLM
engine, serving the official openai client. Both workers answer; /metrics, whichever worker
answers the scrape, counts the requests of both exactly; one SIGTERM to the parent drains both
(streams in flight on each finish whole), the parent exits 0 and leaves no process behind.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import threading

import httpx
import openai
import psutil
import pytest

from engines import running_engine
from polling import exit_code, until
from yieldgate.gateway.config import Config, ServerConfig
from yieldgate.gateway.embedded import GatewayProcess, http_status
from yieldgate.serving.config import FleetConfig, ReplicaConfig

BASE = int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000"))
# A vLLM engine of its own and gateway processes: start-up alone can take minutes on a busy host.
pytestmark = pytest.mark.timeout(1500)
ENGINE_HOST, ENGINE_PORT = "127.0.13.5", BASE + 421
GATEWAY_HOST = "127.0.13.6"
STREAM_TOKENS = 300


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from yieldgate.serving.demo_model import ensure_demo_model

    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with running_engine(ensure_demo_model(), ENGINE_PORT, log, plugin=False, host=ENGINE_HOST) as url:
        yield url


def workers_config(engine: str, redis_url: str, data: str) -> Config:
    from yieldgate.serving.demo_model import ensure_demo_model

    return Config(
        server=ServerConfig(host=GATEWAY_HOST, redis_url=redis_url, admin_token=secrets.token_hex(8), data_dir=data,
                            workers=2, drain_s=1.0, stop_timeout_s=60.0),
        fleet=FleetConfig(model="demo", model_path=str(ensure_demo_model()), health_interval_s=0.5,
                          replicas=[ReplicaConfig(name="std-1", tier="standard", url=engine)]))


def start_workers(engine, redis_url, tmp_path, port: int) -> tuple[GatewayProcess, list[psutil.Process]]:
    """The gateway parent and every process under it (the two workers and multiprocessing's
    resource tracker), to check that none outlives the stop."""
    gw = GatewayProcess(workers_config(engine, redis_url, str(tmp_path / "data")), tmp_path / "gw", port=port,
                        start_timeout_s=240)
    try:
        parent = psutil.Process(gw.process.pid)
        workers = [c for c in parent.children(recursive=True) if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) == 2, parent.children(recursive=True)

        def listening(w: psutil.Process) -> bool:
            return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in w.net_connections("tcp"))

        until(lambda: all(map(listening, workers)), "both workers listening on the port", 2400)
        return gw, parent.children(recursive=True)
    except BaseException:
        gw.stop()
        raise


def assert_all_gone(processes: list[psutil.Process]) -> None:
    """Every process that was under the gateway has exited (multiprocessing's resource tracker ends
    a moment after the parent, when its pipe closes)."""
    _, alive = psutil.wait_procs(processes, timeout=20)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


def served_by(url: str, n: int) -> list[str]:
    """`n` chat completions, each on a connection of its own (a fresh client), and the gateway
    instance (worker) that answered each."""
    who = []
    for i in range(n):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            raw = client.chat.completions.with_raw_response.create(
                model="demo", max_tokens=4, messages=[{"role": "user", "content": f"worker {i}"}])
            assert raw.parse().choices[0].message.content is not None
            who.append(raw.headers["x-yieldgate-gateway"])
    return who


def requests_counted(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r'^yieldgate_requests_total\{[^}]*endpoint="chat"[^}]*\} (\S+)$',
                                            text, re.M))


def test_two_workers_serve_the_client_and_metrics_count_both_exactly(engine, redis_url, tmp_path):
    gw, workers = start_workers(engine, redis_url, tmp_path, BASE + 422)
    try:
        who = served_by(gw.url, 24)
        assert len(set(who)) == 2, f"one worker answered everything: {set(who)}"
        # Each scrape is answered by either worker; every one of them counts all 24 (a worker
        # publishes its counts at least once a second).
        until(lambda: requests_counted(gw.url) == 24, "/metrics counting the requests of both workers", 100)
        assert [requests_counted(gw.url) for _ in range(6)] == [24.0] * 6
        text = httpx.get(gw.url + "/metrics", timeout=10).text
        assert len(re.findall(r"^yieldgate_gateway_info\{", text, re.M)) == 2  # one series per live worker
        assert re.search(r'^yieldgate_replica_up\{replica="std-1",tier="standard"\} 1\.0$', text, re.M)
    finally:
        gw.stop()
    assert gw.process.returncode == 0
    assert_all_gone(workers)


def test_one_sigterm_drains_both_workers_with_no_failed_request_and_no_orphan(engine, redis_url, tmp_path):
    gw, workers = start_workers(engine, redis_url, tmp_path, BASE + 423)
    results: dict[int, tuple[str, int, str | None]] = {}
    errors: list[BaseException] = []
    started = threading.Barrier(13)

    def stream(i: int) -> None:
        try:
            with openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
                raw = client.chat.completions.with_raw_response.create(
                    model="demo", max_tokens=STREAM_TOKENS, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": f"drain {i}"}])
                chunks = raw.parse()
                first, finish, tokens = True, None, 0
                for chunk in chunks:
                    if first:
                        first = False
                        started.wait(120)
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                results[i] = (raw.headers["x-yieldgate-gateway"], tokens, finish)
        except BaseException as exc:  # noqa: BLE001  (reported by the test below)
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    try:
        started.wait(120)  # every stream has its first token
        gw.process.send_signal(signal.SIGTERM)
        until(lambda: http_status(gw.url + "/readyz") in (503, 0), "readiness false while draining", 100)
        for t in threads:
            t.join(300)
        assert exit_code(gw.process, 120, gw.log_path) == 0
    finally:
        gw.stop()
    assert not errors, errors
    assert len(results) == 12
    assert all(tokens == STREAM_TOKENS and finish == "length" for _, tokens, finish in results.values()), results
    assert len({who for who, _, _ in results.values()}) == 2, "the streams did not reach both workers"
    assert_all_gone(workers)


def test_workers_refuse_a_port_something_already_listens_on(tmp_path):
    """SO_REUSEPORT would let the workers bind beside a stale gateway and share its traffic: the
    parent checks the port first and exits 2 with the reason."""
    import subprocess
    import sys

    from yieldgate.gateway.workers import reuseport_socket

    port = BASE + 424
    stale = reuseport_socket(GATEWAY_HOST, port)  # as a stale worker's listener would be
    stale.listen()
    config = tmp_path / "gateway.toml"
    config.write_text(f'[server]\nhost = "{GATEWAY_HOST}"\nport = {port}\nworkers = 2\ndata_dir = "{tmp_path}"\n')
    try:
        out = subprocess.run([sys.executable, "-m", "yieldgate.gateway.cli", "gateway", "--config", str(config)],
                             capture_output=True, text=True, timeout=120)
    finally:
        stale.close()
    assert out.returncode == 2, out.stderr
    assert f"{GATEWAY_HOST}:{port} is in use" in out.stderr
