"""Ledger: journal durability, exactly-once storage, outages, crash recovery and reports.
The same contract runs against SQLiteStore, RedisStore (real Redis, DB 14) and PostgresStore (a
database of the test's own, tests/pg.py)."""

import asyncio
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from decimal import Decimal

import pytest

from pg import temp_database
from yieldgate.pricing import (Ledger, LedgerRecord, PostgresStore, PriceBook, RedisStore, SQLiteStore,
                               StoreUnavailable, Usage)

# Fixtures live on the session loop (pyproject: asyncio_default_fixture_loop_scope); so do tests.
pytestmark = pytest.mark.asyncio(loop_scope="session")
REDIS_URL = os.environ.get("YG_TEST_REDIS_URL", "redis://127.0.0.1:6379/14")
BOOK = PriceBook()


def make_record(i: int, ts: float = 1_700_000_000.0, **over) -> LedgerRecord:
    usage = Usage(prompt_tokens=100 + i % 7, cached_tokens=i % 50, completion_tokens=10 + i % 3)
    fields = dict(key_id=f"k{i % 3}", team=f"t{i % 2}", model="demo", tier=("standard", "fast")[i % 2],
                  replica=f"r{i % 2}", weight_version="v1", session_id=f"s{i % 5}",
                  ttft_ms=12.5, latency_ms=40.0)
    fields.update(over)
    return LedgerRecord.priced(request_id=over.pop("request_id", f"req-{i}"), ts=ts + i, usage=usage,
                               cost=BOOK.cost("demo", fields["tier"], usage),
                               **{k: v for k, v in fields.items() if k != "request_id"})


def store_factory(kind: str, tmp_path, prefix: str):
    if kind == "sqlite":
        return lambda: SQLiteStore(tmp_path / "ledger.sqlite3")
    if kind == "postgres":
        return lambda: PostgresStore(prefix)
    return lambda: RedisStore(REDIS_URL, prefix=prefix)


@pytest.fixture(params=["sqlite", "redis", "postgres"])
async def new_store(request, tmp_path):
    if request.param == "postgres":
        with temp_database() as url:
            yield store_factory("postgres", tmp_path, url)
        return
    prefix = f"yg-test-ledger:{uuid.uuid4().hex[:8]}:"
    factory = store_factory(request.param, tmp_path, prefix)
    yield factory
    if request.param == "redis":
        cleaner = RedisStore(REDIS_URL, prefix=prefix)
        await cleaner.clear()
        await cleaner.close()


async def started(factory, journal_dir, **kw) -> Ledger:
    ledger = Ledger(factory(), journal_dir, flush_interval_s=kw.pop("flush_interval_s", 0.01), **kw)
    await ledger.start()
    return ledger


async def test_concurrent_records_are_stored_exactly_once(new_store, tmp_path):
    ledger = await started(new_store, tmp_path / "j")

    async def client(c: int) -> None:
        for n in range(20):
            rec = make_record(c * 20 + n)
            ledger.record(rec)
            if n % 5 == 0:
                ledger.record(rec)  # a retried request: same request_id must be billed once
            await asyncio.sleep(0)

    await asyncio.gather(*(client(c) for c in range(50)))
    await ledger.flush(timeout=30)
    assert await ledger.store.count() == 1000
    assert ledger.stored == 1000 and ledger.duplicates == 200
    got = await ledger.store.get("req-7")
    assert got == make_record(7)
    await ledger.close()

    # Lose the checkpoint: start-up replays the whole journal; nothing is counted twice.
    (tmp_path / "j" / "journal.checkpoint").unlink()
    ledger = await started(new_store, tmp_path / "j")
    await ledger.flush(timeout=30)
    assert ledger.stored == 0 and ledger.duplicates == 1200
    assert await ledger.store.count() == 1000
    rows = await ledger.usage(())
    assert rows[0].requests == 1000
    assert rows[0].cost_total == sum((make_record(i).cost_total for i in range(1000)), Decimal(0))
    await ledger.close()


async def test_record_before_start_raises(new_store, tmp_path):
    from yieldgate.pricing import LedgerError
    with pytest.raises(LedgerError):
        Ledger(new_store(), tmp_path).record(make_record(1))


async def test_second_ledger_on_same_journal_is_refused(new_store, tmp_path):
    from yieldgate.pricing import LedgerError
    ledger = await started(new_store, tmp_path / "j")
    with pytest.raises(LedgerError):
        await started(new_store, tmp_path / "j")
    await ledger.close()


async def test_journal_is_compacted_once_flushed(new_store, tmp_path):
    ledger = await started(new_store, tmp_path / "j", compact_bytes=0)
    for i in range(30):
        ledger.record(make_record(i))
    await ledger.flush(timeout=30)
    assert os.path.getsize(tmp_path / "j" / "journal.jsonl") == 0
    ledger.record(make_record(30))
    await ledger.flush(timeout=30)
    assert await ledger.store.count() == 31
    await ledger.close()
    # The checkpoint went large -> 0 -> one record's length, overwritten in place each time: a restart
    # reads the last value and replays nothing.
    ledger = await started(new_store, tmp_path / "j", compact_bytes=0)
    await ledger.flush(timeout=30)
    assert ledger.stored == 0 and ledger.duplicates == 0
    await ledger.close()


async def test_torn_tail_line_is_skipped(new_store, tmp_path):
    jdir = tmp_path / "j"
    jdir.mkdir()
    good = b"".join(__import__("msgspec").json.encode(make_record(i)) + b"\n" for i in range(3))
    (jdir / "journal.jsonl").write_bytes(good + b'{"request_id":"req-torn","ts":1')  # power cut
    ledger = await started(new_store, jdir)
    ledger.record(make_record(3))
    await ledger.flush(timeout=30)
    assert await ledger.store.count() == 4
    assert ledger.journal.bad_lines == 1
    await ledger.close()


CRASH_CHILD = r'''
import asyncio, os, sys, time
sys.path.insert(0, sys.argv[4])
from test_pricing_ledger import make_record
from yieldgate.pricing import Ledger, RedisStore, SQLiteStore

async def main():
    kind, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = SQLiteStore(path + "/ledger.sqlite3") if kind == "sqlite" else RedisStore(sys.argv[5], prefix=sys.argv[6])
    # A flusher that never gets to run: everything must come back from the journal alone.
    ledger = Ledger(store, path + "/j", flush_interval_s=3600)
    await ledger.start()
    for i in range(n):
        ledger.record(make_record(i))
    print("recorded", flush=True)
    time.sleep(600)  # block the loop; the parent SIGKILLs us

asyncio.run(main())
'''


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_sigkill_after_record_loses_nothing(kind, tmp_path):
    prefix = f"yg-test-ledger:{uuid.uuid4().hex[:8]}:"
    n = 500
    child = subprocess.Popen(
        [sys.executable, "-c", CRASH_CHILD, kind, str(tmp_path), str(n), os.path.dirname(__file__),
         REDIS_URL, prefix], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "recorded"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    factory = store_factory(kind, tmp_path, prefix)
    ledger = await started(factory, tmp_path / "j")
    await ledger.flush(timeout=30)
    assert await ledger.store.count() == n
    assert ledger.stored == n
    await ledger.close()
    if kind == "redis":
        await RedisStore(REDIS_URL, prefix=prefix).clear()


def _free_port(preferred: int = 6391) -> int:
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return s.getsockname()[1]
            except OSError:
                continue
    raise RuntimeError("no free port")


class OwnRedis:
    """A private redis-server (AOF on, so a graceful stop/start keeps data) we may stop at will."""

    def __init__(self, tmp_path):
        self.port = _free_port()
        self.dir = tmp_path / "redis"
        self.dir.mkdir()
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("own redis-server did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture
def own_redis(tmp_path):
    server = OwnRedis(tmp_path)
    server.start()
    yield server
    server.stop()


async def test_store_outage_keeps_records_and_replays(own_redis, tmp_path):
    store = RedisStore(own_redis.url, prefix="yg-test-outage:", timeout_s=0.5)
    ledger = Ledger(store, tmp_path / "j", flush_interval_s=0.01, retry_backoff_s=0.05)
    await ledger.start()
    for i in range(100):
        ledger.record(make_record(i))
    await ledger.flush(timeout=30)

    own_redis.stop()
    for i in range(100, 300):
        ledger.record(make_record(i))
    with pytest.raises(StoreUnavailable):
        await ledger.flush(timeout=1.0)
    assert ledger.pending_bytes > 0 and ledger.store_errors > 0

    own_redis.start()
    await ledger.flush(timeout=30)
    assert await store.count() == 300
    assert ledger.stored == 300 and ledger.duplicates == 0
    await ledger.close()


async def test_grouping_time_range_and_filters(new_store, tmp_path):
    ledger = await started(new_store, tmp_path / "j")
    day = 86400.0
    base = 1_700_006_400.0  # 2023-11-15 00:00:00 UTC
    for i in range(10):
        ledger.record(make_record(i, ts=base - 2 * i))  # ts = base - i: i>0 lands on the previous day
    ledger.record(make_record(99, ts=base + day - 99, status="error"))
    await ledger.flush(timeout=30)

    by_day = {r.group["day"]: r for r in await ledger.usage(("day",))}
    assert sorted(by_day) == ["2023-11-14", "2023-11-15", "2023-11-16"]
    by_team_tier = await ledger.usage(["team", "tier"])
    assert [(r.group["team"], r.group["tier"], r.requests) for r in by_team_tier] == [
        ("t0", "standard", 5), ("t1", "fast", 6)]
    fast = [r for r in by_team_tier if r.group["tier"] == "fast"][0]
    assert fast.errors == 1
    assert fast.cost_total == sum(
        (make_record(i).cost_total for i in (1, 3, 5, 7, 9, 99)), Decimal(0))
    assert fast.cost_total == fast.cost_uncached_input + fast.cost_cached_input + fast.cost_output

    in_range = await ledger.usage(("model",), since=base, until=base + 10)
    assert in_range[0].requests == 1  # only record 0 (ts=base)
    only_k1 = await ledger.usage(("key_id",), where={"key_id": "k1"})
    assert [r.group for r in only_k1] == [{"key_id": "k1"}]
    by_replica_version = await ledger.usage(("replica", "weight_version"))
    assert sum(r.prompt_tokens for r in by_replica_version) == sum(
        make_record(i).prompt_tokens for i in [*range(10), 99])
    with pytest.raises(ValueError):
        await ledger.usage(("colour",))
    await ledger.close()


async def test_csv_export(new_store, tmp_path):
    import csv
    ledger = await started(new_store, tmp_path / "j")
    for i in range(5):
        ledger.record(make_record(i))
    await ledger.flush(timeout=30)
    out = io.StringIO()
    assert await ledger.export_csv(out) == 5
    rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert [r["request_id"] for r in rows] == [f"req-{i}" for i in range(5)]
    assert Decimal(rows[2]["cost_total"]) == make_record(2).cost_total
    assert rows[0]["session_id"] == "s0"
    out = io.StringIO()
    assert await ledger.export_csv(out, since=1_700_000_003.0) == 2
    await ledger.close()


async def test_intelligence_per_dollar(new_store, tmp_path):
    ledger = await started(new_store, tmp_path / "j")
    # v1: three single-request tasks (2 pass); v2: one 2-request session (pass) + one ungraded request
    recs = [make_record(i, request_id=f"a{i}", session_id=None, weight_version="v1", tier="standard")
            for i in range(3)]
    recs += [make_record(10 + i, request_id=f"b{i}", session_id="sess-b", weight_version="v2",
                         tier="standard") for i in range(2)]
    recs.append(make_record(20, request_id="c0", session_id=None, weight_version="v2", tier="standard"))
    for r in recs:
        ledger.record(r)
    await ledger.flush(timeout=30)
    await ledger.attach_outcome(request_id="a0", passed=True)
    await ledger.attach_outcome(request_id="a1", score=0.9)
    await ledger.attach_outcome(request_id="a2", score=0.1)
    await ledger.attach_outcome(session_id="sess-b", passed=True, score=1.0)
    await ledger.attach_outcome(request_id="b0", passed=False)  # the session verdict wins
    rows = {r.group["weight_version"]: r for r in await ledger.success()}
    v1, v2 = rows["v1"], rows["v2"]
    assert (v1.tasks_graded, v1.successes) == (3, 2)
    assert v1.success_rate == pytest.approx(2 / 3)
    assert v1.usd_per_success == sum((r.cost_total for r in recs[:3]), Decimal(0)) / 2
    assert v1.mean_score == pytest.approx(0.5)
    assert (v2.tasks_graded, v2.successes, v2.requests) == (1, 1, 3)
    assert v2.usd_per_success == recs[3].cost_total + recs[4].cost_total
    assert v2.tokens_per_success == recs[3].total_tokens + recs[4].total_tokens
    assert v2.spend_usd == v2.usd_per_success + recs[5].cost_total
    with pytest.raises(ValueError):
        await ledger.attach_outcome(request_id="a0", session_id="s")
    await ledger.close()


async def test_focus_billing_export(new_store, tmp_path):
    import csv
    import json

    ledger = await started(new_store, tmp_path / "j")
    records = [make_record(i, ts=1_764_892_800.0 + i * 3600) for i in range(60)]  # 2025-12-05, 60 hours
    for r in records:
        ledger.record(r)
    await ledger.flush(timeout=30)
    out = io.StringIO()
    n = await ledger.export_focus_csv(out)
    rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert n == len(rows) > 0
    # Billed = effective = list (no discounts), and the whole export sums to the ledger, exactly.
    assert sum(Decimal(r["BilledCost"]) for r in rows) == sum((r.cost_total for r in records), Decimal(0))
    assert all(r["BilledCost"] == r["EffectiveCost"] == r["ListCost"] for r in rows)
    assert {r["ChargePeriodStart"][:10] for r in rows} == {"2025-12-05", "2025-12-06", "2025-12-07"}
    first = rows[0]
    assert first["ChargePeriodStart"].endswith("T00:00:00Z") and first["BillingPeriodStart"] == "2025-12-01T00:00:00Z"
    assert first["ChargeCategory"] == "Usage" and first["ConsumedUnit"] == "Tokens" and first["BillingCurrency"] == "USD"
    # Tokens per SKU kind add up to the records' tokens; every row is one key, team, model, tier, version, day.
    by_kind = {k: sum(int(r["ConsumedQuantity"]) for r in rows if r["SkuId"].endswith(":" + k))
               for k in ("input", "cached_input", "output")}
    assert by_kind == {"input": sum(r.prompt_tokens - r.cached_tokens for r in records),
                       "cached_input": sum(r.cached_tokens for r in records),
                       "output": sum(r.completion_tokens for r in records)}
    tags = json.loads(first["Tags"])
    assert tags["key_id"] == first["x_KeyId"] and tags["weight_version"] == "v1"
    assert len({(r["x_KeyId"], r["x_Team"], r["x_Model"], r["x_Tier"], r["x_WeightVersion"],
                 r["ChargePeriodStart"], r["SkuId"]) for r in rows}) == len(rows)
    await ledger.close()
