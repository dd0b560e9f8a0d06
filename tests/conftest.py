"""Session fixtures: the real demo stack (two vLLM engines + the gateway), started once.

`yieldgate up` runs as a child process with a test config (its own ports), exactly as a user runs
it. Set YIELDGATE_TEST_GATEWAY=http://host:port to reuse a stack that is already running (dev loop).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from yieldgate.gateway.embedded import EmbeddedGateway as InProcessGateway
from yieldgate.gateway.embedded import GatewayProcess, http_status, stop_process_group

ROOT = Path(__file__).resolve().parent.parent
# YIELDGATE_TEST_PORT_BASE moves every port of the test stack (two suites on one machine).
GATEWAY_PORT = int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000"))
ENGINE_BASE_PORT = GATEWAY_PORT + 101
# Each engine on a loopback address of its own, like engines on hosts of their own (tests/test_multihost.py).
ENGINE_HOSTS = ("127.0.2.1", "127.0.2.2")
STARTUP_TIMEOUT_S = 900


@contextlib.contextmanager
def fake_upstream_process(*flags: str) -> Iterator[str]:
    """benchmarks/fake_upstream.py in a subprocess (e.g. flags "--itl-ms", "10"); yields its URL.
    For tests of the gateway's or the load tester's own plumbing, where a real engine would only be
    slower and noisier."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "fake_upstream.py"), "--port", str(port),
                             *flags], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("fake upstream did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def record_result(path: Path, doc: dict) -> None:
    """Write a benchmark result that a test measured, when YIELDGATE_RECORD_RESULTS=1
    (`benchmarks/run_all.py` sets it): a plain test run leaves benchmarks/results/ as committed."""
    if os.environ.get("YIELDGATE_RECORD_RESULTS") == "1":
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\n[result] {path}")


def bench_harness():
    """benchmarks/harness.py (result meta, freshness), loaded once."""
    import importlib.util

    if "harness" not in sys.modules:  # benchmarks/harness.py; its dataclasses look their module up
        spec = importlib.util.spec_from_file_location("harness", ROOT / "benchmarks" / "harness.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["harness"] = module
        spec.loader.exec_module(module)
    return sys.modules["harness"]


def record_counts(name: str, test: str, measures: list[str], counts: dict, **extra) -> None:
    """What an asserting test measured (requests, failures, cases), as benchmarks/results/NAME.json
    with the harness's meta: the README row of a figure a test asserts is computed from this record,
    never typed. `test` is the node id that measured it; `measures` the code it exercises."""
    if os.environ.get("YIELDGATE_RECORD_RESULTS") != "1":
        return
    harness = bench_harness()
    meta = harness.meta(measures, command=f"python -m pytest {test}")  # taken as the test ends
    record_result(harness.RESULTS / f"{name}.json", {"meta": meta, "test": test, "counts": counts, **extra})


@dataclass
class Stack:
    gateway_url: str
    engines: dict[str, str]
    model: str
    model_dir: Path
    kv_events_endpoint: str
    admin_token: str
    process: subprocess.Popen | None = None
    home: Path | None = None
    config_path: Path | None = None
    extra: dict = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return self.gateway_url + "/v1"

    def admin_client(self, timeout: float = 300) -> httpx.Client:
        """A client of the gateway that sends the admin credential."""
        return httpx.Client(base_url=self.gateway_url, timeout=timeout,
                            headers={"Authorization": f"Bearer {self.admin_token}"})


def stack_config(admin_token: str, redis_url: str, postgres_url: str) -> str:
    return f"""
[server]
host = "127.0.0.1"
port = {GATEWAY_PORT}
admin_token = "{admin_token}"
redis_url = "{redis_url}"
postgres_url = "{postgres_url}"

[pricing]
fast_min_speedup = 0   # the fast price as listed; its floor has a test of its own (test_fast_price_floor.py)

[pricing.ledger]
store = "postgres"

[fleet]
model = "demo"
block_size = 32
demo_base_port = {ENGINE_BASE_PORT}
demo_hosts = {list(ENGINE_HOSTS)}

# Both tiers route cache-aware, so a sampled fast request reaches the fast engine (the demo's own
# speculation-aware fast tier has tests of its own: test_fast_tier_speculation.py).
[fleet.tiers.standard]
fallback = "fast"

[fleet.tiers.fast]
fallback = "standard"
"""


@pytest.fixture(scope="module")
def admin(stack) -> Iterator[httpx.Client]:
    """The session stack's gateway with the admin credential (a module may add its own clean-up)."""
    with stack.admin_client() as client:
        yield client


@pytest.fixture(scope="session")
def redis_url() -> str:
    # YIELDGATE_TEST_REDIS_DB keeps two suites on one machine from sharing keys.
    return f"redis://127.0.0.1:6379/{os.environ.get('YIELDGATE_TEST_REDIS_DB', '15')}"


@pytest.fixture(scope="session")
def stack(tmp_path_factory, redis_url, request) -> Stack:
    from yieldgate.serving.demo_model import ensure_demo_model

    reuse = os.environ.get("YIELDGATE_TEST_GATEWAY")
    if reuse:
        yield Stack(
            gateway_url=reuse.rstrip("/"),
            engines={"standard": os.environ.get("YIELDGATE_TEST_STANDARD", "http://127.0.0.1:8101"),
                     "fast": os.environ.get("YIELDGATE_TEST_FAST", "http://127.0.0.1:8102")},
            model="demo", model_dir=ensure_demo_model(),
            kv_events_endpoint=os.environ.get("YIELDGATE_TEST_KV", "tcp://127.0.0.1:5557"),
            admin_token=os.environ.get("YIELDGATE_TEST_ADMIN_TOKEN", ""),
        )
        return

    import redis

    from pg import temp_database

    # PostgreSQL is the stack's record of keys, budgets and the ledger: a database of its own.
    postgres = temp_database()
    postgres_url = postgres.__enter__()
    request.addfinalizer(lambda: postgres.__exit__(None, None, None))  # after the stack stopped
    # The adapter registry outlives a gateway in Redis: a new stack starts with none.
    with redis.Redis.from_url(redis_url) as r:
        stale = list(r.scan_iter("yg:adapters:*"))
        if stale:
            r.delete(*stale)
    home = tmp_path_factory.mktemp("yieldgate-home")
    # The generated model is shared across runs; engine logs and ledger stay in the temp home.
    model_dir = ensure_demo_model()
    admin_token = "test-admin-" + secrets.token_hex(8)
    config_path = home / "yieldgate.toml"
    config_path.write_text(stack_config(admin_token, redis_url, postgres_url))
    env = dict(os.environ, YIELDGATE_HOME=str(home), PYTHONUNBUFFERED="1")
    env["YIELDGATE_FLEET__MODEL_PATH"] = str(model_dir)
    log_path = home / "up.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "yieldgate.gateway.cli", "up", "--config", str(config_path)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    gateway_url = f"http://127.0.0.1:{GATEWAY_PORT}"
    started = time.monotonic()
    while http_status(gateway_url + "/readyz") != 200:  # every tier can serve
        if proc.poll() is not None:
            pytest.fail(f"yieldgate up exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        if time.monotonic() - started > STARTUP_TIMEOUT_S:
            proc.kill()
            pytest.fail(f"stack not healthy after {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")
        time.sleep(2)
    print(f"\n[stack] up in {time.monotonic() - started:.0f}s", file=sys.stderr)
    stack = Stack(
        gateway_url=gateway_url,
        engines={"standard": f"http://{ENGINE_HOSTS[0]}:{ENGINE_BASE_PORT}",
                 "fast": f"http://{ENGINE_HOSTS[1]}:{ENGINE_BASE_PORT + 1}"},
        model="demo", model_dir=model_dir,
        kv_events_endpoint=f"ipc://{home / 'run' / 'kv-events-standard-0.sock'}",
        admin_token=admin_token, process=proc, home=home, config_path=config_path,
        extra={"log_path": log_path, "started_s": time.monotonic() - started},
    )
    try:
        yield stack
    finally:
        stop_process_group(proc)
        log.close()


@pytest.fixture(scope="session")
def client(stack):
    import openai

    return openai.OpenAI(base_url=stack.base_url, api_key=stack.extra.get("api_key", "unused"),
                         max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def async_client(stack):
    import openai

    return openai.AsyncOpenAI(base_url=stack.base_url, api_key=stack.extra.get("api_key", "unused"),
                              max_retries=0, timeout=120)


# A second gateway (uvicorn in a thread) with its own config, for fault and multi-gateway tests.


@pytest.fixture
def gateway_factory():
    started: list[InProcessGateway] = []

    def make(config) -> InProcessGateway:
        gw = InProcessGateway(config)
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.stop()


@pytest.fixture
def gateway_process_factory(tmp_path):
    started: list[GatewayProcess] = []

    def make(config) -> GatewayProcess:
        gw = GatewayProcess(config, tmp_path / "gateways")
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.stop()
