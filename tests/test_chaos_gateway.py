"""Faults of the gateway's own state: the gateway SIGKILLed, Redis stopped under load.

Both end with the same reconciliation: every request a client got an answer for is in the ledger
exactly once, and the ledger's cost equals the sum of the costs the clients were told, exactly.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from decimal import Decimal

import httpx
import pytest

from conftest import record_counts

from yieldgate.gateway.config import Config, ServerConfig
from needs import missing
from yieldgate.serving.config import FleetConfig, ReplicaConfig

ADMIN = "chaos-admin-" + uuid.uuid4().hex[:8]


def chaos_config(stack, tmp_path, redis_url: str, store: str) -> Config:
    config = Config(
        server=ServerConfig(admin_token=ADMIN, redis_url=redis_url, data_dir=str(tmp_path / "data")),
        fleet=FleetConfig(model=stack.model, health_interval_s=0.5, replicas=[
            ReplicaConfig(name="std", tier="standard", url=stack.engines["standard"])]))
    config.pricing.ledger.store = store
    config.pricing.ledger.redis_url = redis_url
    config.pricing.ledger.redis_prefix = f"ygchaos-{uuid.uuid4().hex[:8]}:"
    config.pricing.limits.redis_url = redis_url
    return config


def ask(url: str, i: int, secret: str | None = None) -> tuple[int, str, Decimal]:
    headers = {"authorization": f"Bearer {secret}"} if secret else {}
    r = httpx.post(url + "/v1/chat/completions", timeout=60, headers=headers, json={
        "model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": f"chaos {i}"}]})
    cost = Decimal(r.headers.get("x-yieldgate-cost-usd", "0"))
    return r.status_code, r.headers.get("x-request-id", ""), cost


def create_key(url: str, **spec) -> str:
    resp = httpx.post(url + "/admin/keys", json=spec, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert resp.status_code == 201, resp.text
    return resp.json()["secret"]


def ledger(url: str) -> dict[str, list[dict[str, str]]]:
    resp = httpx.get(url + "/admin/ledger.csv", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)
    resp.raise_for_status()
    rows: dict[str, list[dict[str, str]]] = {}
    for row in csv.DictReader(io.StringIO(resp.text)):
        rows.setdefault(row["request_id"], []).append(row)
    return rows


def reconcile(url: str, answered: list[tuple[int, str, Decimal]], timeout: float = 60) -> None:
    wanted = {rid: cost for status, rid, cost in answered if status == 200}
    deadline = time.monotonic() + timeout
    while True:
        rows = ledger(url)
        if all(rid in rows for rid in wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    missing = [rid for rid in wanted if rid not in rows]
    assert missing == [], f"{len(missing)} answered requests missing from the ledger"
    assert all(len(rows[rid]) == 1 for rid in wanted), "a request was recorded twice"
    ledger_total = sum(Decimal(rows[rid][0]["cost_total"]) for rid in wanted)
    assert ledger_total == sum(wanted.values())


def test_gateway_sigkill_loses_no_acknowledged_record(stack, redis_url, tmp_path, gateway_process_factory):
    config = chaos_config(stack, tmp_path, redis_url, "sqlite")
    first = gateway_process_factory(config)
    answered = [ask(first.url, i) for i in range(25)]
    assert all(status == 200 for status, _, _ in answered)
    # Killed right after the last answer: no chance to flush the ledger or close anything.
    os.kill(first.process.pid, signal.SIGKILL)
    first.process.wait(10)
    second = gateway_process_factory(config)  # same data_dir: replays the journal at start
    reconcile(second.url, answered)
    print(f"\n[chaos] gateway SIGKILL after {len(answered)} answers: all {len(answered)} in the ledger once")
    record_counts("chaos_gateway", "tests/test_chaos_gateway.py::test_gateway_sigkill_loses_no_acknowledged_record",
                  [*["gateway/", "cache/", "serving/", "pricing/"], "tests/test_chaos_gateway.py"],
                  {"answered": len(answered), "in_ledger_once": len(answered)})


@pytest.fixture
def private_redis(tmp_path):
    """A Redis of our own that the test can stop and start (append-only file: data survives)."""
    server = shutil.which("redis-server")
    if not server:
        missing("redis-server not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tmp_path / "redis"
    workdir.mkdir()
    cmd = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
           "--dir", str(workdir)]

    class Redis:
        url = f"redis://127.0.0.1:{port}/0"
        proc: subprocess.Popen | None = None

        def start(self) -> None:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 10
            while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout.strip() != b"PONG":
                assert time.monotonic() < deadline, "private redis did not start"
                time.sleep(0.1)

        def stop(self) -> None:
            subprocess.run(["redis-cli", "-p", str(port), "shutdown"], capture_output=True)
            if self.proc is not None:
                self.proc.wait(10)

    r = Redis()
    r.start()
    yield r
    if r.proc is not None and r.proc.poll() is None:
        r.proc.kill()


def test_redis_outage_under_load_keeps_serving_and_reconciles(stack, tmp_path, private_redis,
                                                               gateway_process_factory):
    config = chaos_config(stack, tmp_path, private_redis.url, "redis")
    gw = gateway_process_factory(config)
    # Every second request is keyed with a limit and a budget: both need Redis, and the default
    # on_redis_error = "open" serves them unenforced while it is gone.
    secret = create_key(gw.url, team="chaos", rpm=100_000, budget_usd="100", budget_period="total")
    answered: list[tuple[int, str, Decimal]] = []
    errors: list[str] = []  # a timeout or dropped connection: a failed request, not a dead thread
    answered_at: list[tuple[float, bool]] = []  # when each 200 came back, and whether it was keyed
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            keyed = i % 2 == 1
            try:
                a = ask(gw.url, i, secret if keyed else None)
            except Exception as exc:
                errors.append(f"request {i}: {type(exc).__name__}: {exc}")
            else:
                answered.append(a)
                if a[0] == 200:
                    answered_at.append((time.monotonic(), keyed))
            i += 1

    worker = threading.Thread(target=load)
    worker.start()
    try:
        time.sleep(3)
        private_redis.stop()
        down_at = time.monotonic()
        time.sleep(30)  # Redis is gone for 30 s while requests keep coming
        up_at = time.monotonic()
        private_redis.start()
        time.sleep(5)
    finally:
        stop.set()
        worker.join(60)
    assert not worker.is_alive(), "the load thread did not finish"
    failed = [a for a in answered if a[0] != 200]
    during = [keyed for t, keyed in answered_at if down_at < t < up_at]
    print(f"\n[chaos] Redis down 30 s: {len(answered)} requests ({len(during)} answered during the outage, "
          f"{sum(during)} of them keyed), {len(failed)} failed, {len(errors)} errors")
    # Documented policy: anonymous traffic needs no Redis; keyed traffic fails open by default
    # (a key cached before the outage is honoured past its cache TTL).
    assert errors == [] and failed == []
    assert during.count(False) > 0, "no anonymous request was answered while Redis was down"
    assert during.count(True) > 0, "no keyed request was answered while Redis was down"
    reconcile(gw.url, answered, timeout=90)
    record_counts("chaos_redis", "tests/test_chaos_gateway.py::test_redis_outage_under_load_keeps_serving_and_reconciles",
                  [*["gateway/", "cache/", "serving/", "pricing/"], "tests/test_chaos_gateway.py"],
                  {"requests": len(answered), "answered_during_outage": len(during), "keyed_during_outage": sum(during),
                   "failed": len(failed), "errors": len(errors), "ledger_matches_clients": len(answered)})


def test_redis_outage_in_closed_mode_refuses_keyed_requests_only(stack, tmp_path, private_redis, gateway_factory):
    config = chaos_config(stack, tmp_path, private_redis.url, "sqlite")
    config.pricing.limits.on_redis_error = "closed"
    gw = gateway_factory(config)
    secret = create_key(gw.url, team="closed", rpm=100_000, budget_usd="100", budget_period="total")
    assert ask(gw.url, 0, secret)[0] == 200
    private_redis.stop()
    try:
        for i in range(4):
            r = httpx.post(gw.url + "/v1/chat/completions", timeout=60,
                           headers={"authorization": f"Bearer {secret}"},
                           json={"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["type"] == "service_unavailable"
            # The key is cached (limits unknown: limiter) or its cache entry expired (key store).
            assert err["code"] in ("limiter_unavailable", "key_store_unavailable")
            assert ask(gw.url, i)[0] == 200  # anonymous traffic needs no Redis
    finally:
        private_redis.start()
    deadline = time.monotonic() + 20  # the gateway's Redis pool reconnects on its next use
    while (status := ask(gw.url, 9, secret)[0]) != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert status == 200
