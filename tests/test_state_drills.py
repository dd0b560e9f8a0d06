"""State that survives: PostgreSQL is the record of keys, budgets and the ledger; Redis a cache.

Drills with real PostgreSQL, real Redis and real gateway processes in front of a fake upstream
(the engine is not what is tested here): Redis emptied under load with two gateways, PostgreSQL
restarted under load with a gateway SIGKILLed, and the issue's three by-hand failures (a budget
that resets, keys that vanish, a bill that vanishes when Redis comes back empty).
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import redis

from conftest import fake_upstream_process
from needs import missing
from pg import temp_database
from yieldgate.gateway.config import Config, ServerConfig
from yieldgate.serving.config import FleetConfig, ReplicaConfig, TierConfig

ADMIN = "state-admin-" + uuid.uuid4().hex[:8]
PEPPER = uuid.uuid4().hex  # gateways sharing keys share the pepper of their HMACs
AUTH = {"authorization": f"Bearer {ADMIN}"}
FLUSH_S = 0.2  # the ledger's flush interval in these drills
BUDGET = "0.00015"  # about ten of the drills' requests
PG_BIN = Path("/usr/lib/postgresql/15/bin")


@pytest.fixture(scope="module")
def upstream():
    with fake_upstream_process("--itl-ms", "5", "--tokens", "2") as url:
        yield url


@pytest.fixture
def pg_url():
    with temp_database() as url:
        yield url


@pytest.fixture(scope="module")
def redis_url() -> str:
    """A Redis DB of the drills' own (YIELDGATE_TEST_DRILL_REDIS_DB, default 14): they FLUSHDB it, and
    the session stack's gateway on the suite's DB would notice, re-mark it and rebuild mid-drill."""
    return f"redis://127.0.0.1:6379/{os.environ.get('YIELDGATE_TEST_DRILL_REDIS_DB', '14')}"


@pytest.fixture
def redis_db(redis_url):
    """The drills' Redis DB, empty before and after (these drills FLUSHDB it)."""
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    yield r
    r.flushdb()
    r.close()


def state_config(upstream: str, redis_url: str, pg_url: str, data_dir: Path, store: str = "postgres") -> Config:
    config = Config(
        server=ServerConfig(admin_token=ADMIN, require_keys=True, redis_url=redis_url, postgres_url=pg_url,
                            data_dir=str(data_dir), cache_check_s=0.5),
        fleet=FleetConfig(model="demo", replicas=[ReplicaConfig(name="fake-0", url=upstream)],
                          tiers={"standard": TierConfig(policy="round_robin")}))
    config.pricing.ledger.store = store  # type: ignore[assignment]
    config.pricing.ledger.flush_interval_s = FLUSH_S
    config.pricing.ledger.redis_prefix = f"ygstate-{uuid.uuid4().hex[:8]}:"
    config.pricing.ledger.retry_backoff_s = 0.3
    config.pricing.limits.key_pepper = PEPPER
    return config


def ask(url: str, secret: str, i: int) -> tuple[int, str, Decimal]:
    r = httpx.post(url + "/v1/chat/completions", timeout=30, headers={"authorization": f"Bearer {secret}"},
                   json={"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": f"drill {i}"}]})
    return r.status_code, r.headers.get("x-request-id", ""), Decimal(r.headers.get("x-yieldgate-cost-usd", "0"))


def create_key(url: str, **spec) -> tuple[str, str]:
    resp = httpx.post(url + "/admin/keys", json=spec, headers=AUTH, timeout=10)
    assert resp.status_code == 201, resp.text
    return resp.json()["key"]["id"], resp.json()["secret"]


def ledger_rows(url: str) -> dict[str, list[dict[str, str]]]:
    resp = httpx.get(url + "/admin/ledger.csv", headers=AUTH, timeout=30)
    resp.raise_for_status()
    rows: dict[str, list[dict[str, str]]] = {}
    for row in csv.DictReader(io.StringIO(resp.text)):
        rows.setdefault(row["request_id"], []).append(row)
    return rows


def reconcile(url: str, answered: list[tuple[int, str, Decimal]], within_s: float) -> dict[str, list[dict[str, str]]]:
    """Every answered request in the ledger exactly once, at the cost its client was told."""
    wanted = {rid: cost for status, rid, cost in answered if status == 200}
    deadline = time.monotonic() + within_s
    while True:
        rows = ledger_rows(url)
        if all(rid in rows for rid in wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    lost = [rid for rid in wanted if rid not in rows]
    assert lost == [], f"{len(lost)} of {len(wanted)} answered requests missing from the ledger"
    doubled = [rid for rid in wanted if len(rows[rid]) != 1]
    assert doubled == [], f"{len(doubled)} requests recorded more than once"
    assert sum(Decimal(rows[rid][0]["cost_total"]) for rid in wanted) == sum(wanted.values())
    return rows


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def test_redis_emptied_loses_no_key_budget_or_bill(upstream, redis_url, redis_db, pg_url, tmp_path,
                                                   gateway_process_factory):
    """The issue's by-hand drill: a hard budget spent, then Redis loses its data and the gateway restarts."""
    config = state_config(upstream, redis_url, pg_url, tmp_path / "data")
    gw = gateway_process_factory(config)
    key_id, secret = create_key(gw.url, team="drill", budget_usd="0.0001", budget_period="total")
    answered = []
    for i in range(40):
        answered.append(ask(gw.url, secret, i))
        if answered[-1][0] == 429:
            break
    served = sum(a[0] == 200 for a in answered)
    assert 0 < served < 40 and answered[-1][0] == 429
    redis_db.flushdb()  # what a restart of a Redis without persistence does
    # The budget does not reset: the counter is re-seeded from the ledger before it admits anything.
    assert [ask(gw.url, secret, 100 + i)[0] for i in range(5)] == [429] * 5
    gw.stop()
    redis_db.flushdb()
    gw = gateway_process_factory(config)
    keys = httpx.get(gw.url + "/admin/keys", headers=AUTH, timeout=10).json()["data"]
    assert [k["key"]["id"] for k in keys] == [key_id], "keys vanished with Redis"
    spend = httpx.get(gw.url + "/admin/spend", headers=AUTH, timeout=10).json()
    assert spend["requests"] == served
    assert Decimal(str(spend["total_usd"])) == sum(a[2] for a in answered)
    assert keys[0]["budget"]["spent_usd"] == spend["total_usd"]
    assert ask(gw.url, secret, 200)[0] == 429
    assert metric(gw.url, "yieldgate_cache_rebuilds_total") >= 1
    # The bill, as FinOps tools read it (admin credential required).
    assert httpx.get(gw.url + "/admin/billing/focus.csv", timeout=10).status_code == 401
    focus = list(csv.DictReader(io.StringIO(
        httpx.get(gw.url + "/admin/billing/focus.csv", headers=AUTH, timeout=10).text)))
    assert sum(Decimal(r["BilledCost"]) for r in focus) == Decimal(str(spend["total_usd"]))
    assert {r["x_KeyId"] for r in focus} == {key_id} and {r["SubAccountId"] for r in focus} == {"drill"}
    cli = subprocess.run([sys.executable, "-m", "yieldgate.gateway.cli", "spend", "--focus", "--url", gw.url,
                          "--admin-token", ADMIN], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert list(csv.DictReader(io.StringIO(cli.stdout))) == focus


def test_redis_ledger_store_emptied_replays_the_journal(upstream, redis_url, redis_db, pg_url, tmp_path,
                                                        gateway_process_factory):
    """With the ledger in Redis, its journal checkpoint does not hide records the store lost, and a
    budget counter rebuilt from that store waits for the replay."""
    config = state_config(upstream, redis_url, pg_url, tmp_path / "data", store="redis")
    gw = gateway_process_factory(config)
    _, secret = create_key(gw.url, team="drill")
    _, capped = create_key(gw.url, team="drill", budget_usd="0.00005", budget_period="total")
    answered = [ask(gw.url, secret, i) for i in range(6)]
    answered += [ask(gw.url, capped, 10 + i) for i in range(6)]
    assert answered[-1][0] == 429
    reconcile(gw.url, answered, within_s=5)
    redis_db.flushdb()
    assert ask(gw.url, capped, 20)[0] == 429  # seeded from the store once the journal is back in it
    answered.append(ask(gw.url, secret, 6))
    reconcile(gw.url, answered, within_s=5)
    gw.stop()
    redis_db.flushdb()
    gw = gateway_process_factory(config)  # and at start: the store's mark is not the journal's
    reconcile(gw.url, answered, within_s=5)
    assert ask(gw.url, capped, 21)[0] == 429


def test_drill_redis_emptied_under_load_two_gateways(upstream, redis_url, redis_db, pg_url, tmp_path,
                                                     gateway_process_factory):
    """Drill (a): two gateways under keyed load, Redis emptied mid-load."""
    gws = [gateway_process_factory(state_config(upstream, redis_url, pg_url, tmp_path / f"data-{i}"))
           for i in range(2)]
    plain = [create_key(gws[0].url, team=f"t{i}") for i in range(4)]
    budget_id, budget_secret = create_key(gws[1].url, team="capped", budget_usd=BUDGET, budget_period="total")
    answered: list[tuple[int, str, Decimal]] = []
    budget_answers: list[tuple[int, str, Decimal]] = []
    unauthorized: list[str] = []
    errors: list[str] = []
    stop = threading.Event()
    clients_per_key = 2

    def load(c: int) -> None:
        gw = gws[c % 2]
        i = 0
        while not stop.is_set():
            capped = c < clients_per_key
            secret = budget_secret if capped else plain[c % len(plain)][1]
            try:
                a = ask(gw.url, secret, c * 100_000 + i)
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            else:
                (budget_answers if capped else answered).append(a)
                if a[0] == 401:
                    unauthorized.append(a[1])
            i += 1

    def wait_for(condition, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)

    threads = [threading.Thread(target=load, args=(c,)) for c in range(6)]
    for t in threads:
        t.start()
    try:
        # Redis is emptied with the capped key about half spent, under load on both gateways.
        wait_for(lambda: sum(a[0] == 200 for a in budget_answers) >= 5 and len(answered) >= 10, 60)
        before = len(answered) + len(budget_answers)
        redis_db.flushdb()
        wait_for(lambda: sum(a[0] == 429 for a in budget_answers) >= 4
                 and len(answered) + len(budget_answers) >= before + 30, 60)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    after = len(answered) + len(budget_answers) - before
    ok = [a for a in answered if a[0] == 200]
    capped_ok = [a for a in budget_answers if a[0] == 200]
    print(f"\n[drill a] {before} requests before FLUSHDB, {after} after; {len(ok)} + {len(capped_ok)} "
          f"(capped key) served, {sum(a[0] == 429 for a in budget_answers)} refused for the budget")
    assert errors == [] and unauthorized == [], "a key was lost with Redis"
    assert all(a[0] == 200 for a in answered)
    assert all(a[0] in (200, 429) for a in budget_answers)
    # The ledger = what clients were told, exactly, within a flush interval (and a bit of scheduling).
    rows = reconcile(gws[0].url, answered + budget_answers, within_s=FLUSH_S + 1.0)
    # The capped key: over its budget by no more than the requests in flight at the loss.
    spent = sum(Decimal(rows[rid][0]["cost_total"]) for s, rid, _ in capped_ok)
    biggest = max(a[2] for a in capped_ok)
    print(f"[drill a] capped key: ${spent} spent of ${BUDGET} ({len(capped_ok)} served, largest ${biggest})")
    assert spent <= Decimal(BUDGET) + clients_per_key * biggest, (spent, biggest)
    assert budget_answers[-1][0] == 429
    for gw in gws:
        assert metric(gw.url, "yieldgate_cache_rebuilds_total") >= 1
        status = httpx.get(gw.url + "/admin/keys", headers=AUTH, timeout=10).json()["data"]
        assert len(status) == 5
        capped = next(k for k in status if k["key"]["id"] == budget_id)
        assert Decimal(str(capped["budget"]["spent_usd"])) == spent  # the counter equals the ledger


@pytest.fixture
def private_postgres():
    """A PostgreSQL cluster of the test's own (initdb + pg_ctl) on a loopback port, which the test
    may stop and start; the shared server is never touched."""
    if not (PG_BIN / "initdb").exists():
        missing("PostgreSQL 15 server binaries not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Not under pytest's tmp_path: as root the server runs as user postgres, which cannot enter it.
    root = Path(tempfile.mkdtemp(prefix="yg-test-pg-"))
    data = root / "data"
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if as_user:
        shutil.chown(root, "postgres")
    subprocess.run([*as_user, str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                    "-E", "UTF8"], check=True, capture_output=True)

    class Cluster:
        url = f"postgresql://postgres@127.0.0.1:{port}/postgres"

        def ctl(self, *args: str) -> None:
            subprocess.run([*as_user, str(PG_BIN / "pg_ctl"), "-D", str(data), "-w", "-l", str(root / "log"),
                            *args], check=True, capture_output=True)

        def start(self) -> None:
            self.ctl("-o", f"-p {port} -k {root} -c listen_addresses=127.0.0.1", "start")

        def stop(self) -> None:
            self.ctl("-m", "fast", "stop")

    cluster = Cluster()
    cluster.start()
    yield cluster
    subprocess.run([*as_user, str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                   capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


def test_drill_postgres_restarted_under_load_and_gateway_sigkilled(upstream, redis_url, redis_db, private_postgres,
                                                                   tmp_path, gateway_process_factory):
    """Drill (b): PostgreSQL away under keyed load, one gateway SIGKILLed meanwhile; 0 lost, 0 doubled."""
    configs = [state_config(upstream, redis_url, private_postgres.url, tmp_path / f"data-{i}") for i in range(2)]
    gws = [gateway_process_factory(c) for c in configs]
    keys = [create_key(gws[0].url, team="pg", budget_usd="100", budget_period="monthly", rpm=100_000)
            for _ in range(2)]
    answered: list[list[tuple[int, str, Decimal]]] = [[], []]
    errors: list[str] = []
    stop = [threading.Event(), threading.Event()]

    def load(g: int) -> None:
        i = 0
        while not stop[g].is_set():
            try:
                answered[g].append(ask(gws[g].url, keys[i % 2][1], g * 100_000 + i))
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            i += 1

    threads = [threading.Thread(target=load, args=(g,)) for g in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.5)
        private_postgres.stop()
        down = [len(a) for a in answered]
        time.sleep(1.0)
        # While PostgreSQL is away: keys change only in their record, so creating one is refused...
        r = httpx.post(gws[0].url + "/admin/keys", json={"team": "late"}, headers=AUTH, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "key_record_unavailable", r.text
        time.sleep(1.0)
        # ...and one gateway dies with records only in its journal.
        stop[1].set()
        threads[1].join(30)
        os.kill(gws[1].process.pid, signal.SIGKILL)
        gws[1].process.wait(10)
        time.sleep(1.0)
        during = [len(a) - d for a, d in zip(answered, down)]
        private_postgres.start()
        time.sleep(1.5)
    finally:
        for s in stop:
            s.set()
        for t in threads:
            t.join(30)
    print(f"\n[drill b] PostgreSQL down ~3 s: {during} keyed requests per gateway while it was away; "
          f"the second SIGKILLed during the outage; {sum(map(len, answered))} requests in all")
    assert errors == []
    # ...while keyed requests are served from the cache (key in Redis, counters seeded).
    assert all(a[0] == 200 for g in answered for a in g)
    assert min(during) > 0
    gws.append(gateway_process_factory(configs[1]))  # same data dir: replays its journal at start
    reconcile(gws[0].url, answered[0] + answered[1], within_s=10)
