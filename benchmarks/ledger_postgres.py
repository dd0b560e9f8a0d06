"""The ledger at fleet scale: N gateway ledger writers (the gateway's own Ledger: journal, flusher,
PostgresStore) writing into one PostgreSQL on loopback at once.

Each writer process builds its records first (what finished requests hand the ledger), then, at a
common start time, record()s them as fast as it can (1% twice, as a retried request would) and
waits until its flusher has stored them all. Measured: rows per second from the first record() to
the last writer's last confirmed batch, rows lost and doubled (counted in the table against what
was sent), and bytes per row on disk (pg_total_relation_size of every partition / rows).

Goals (issue #45): >= 10,000 rows/s sustained from 8 writers, 0 lost, 0 doubled, <= 400 bytes/row.
Every run of an invocation is kept in benchmarks/results/ledger_postgres.json with the harness's
meta (commit, machine, load), summarized as median and range.

    .venv/bin/python benchmarks/ledger_postgres.py --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import secrets
import statistics
import tempfile
import time
from decimal import Decimal
from pathlib import Path

import harness  # benchmarks/harness.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "ledger_postgres.json"
MEASURES = ["pricing/ledger.py", "pricing/journal.py", "pricing/record.py", "pricing/stores/",
            "benchmarks/ledger_postgres.py"]
GOAL_ROWS_PER_S = 10_000
GOAL_BYTES_PER_ROW = 400


def make_records(writer: int, n: int):
    from yieldgate.pricing import LedgerRecord, PriceBook, Usage

    book = PriceBook()
    prefix = f"req-{secrets.token_hex(10)}"  # as gateway/intake.py names requests
    gateway = f"gw-{writer}-{os.getpid()}"
    now = time.time()
    records = []
    for j in range(n):
        usage = Usage(prompt_tokens=200 + j % 900, cached_tokens=(j % 5) * 32, completion_tokens=20 + j % 300)
        tier = "fast" if j % 4 == 0 else "standard"
        records.append(LedgerRecord.priced(
            request_id=f"{prefix}{j:012x}", usage=usage, cost=book.cost("demo", tier, usage), ts=now + j * 1e-4,
            key_id=f"{(j * 7919 + writer) % 1000:012x}", team=f"team-{j % 50}", model="demo", tier=tier,
            replica=f"{tier}-{j % 4}", weight_version="v3", gateway=gateway,
            session_id=f"sess-{writer}-{j // 8}" if j % 3 else None, route="chat",
            ttft_ms=round(20 + (j % 97) * 0.731, 3), latency_ms=round(200 + (j % 389) * 1.37, 3)))
    return records


def writer(index: int, url: str, n: int, journal_dir: str, start_at: float, batch_size: int,
           flush_interval_s: float, out: mp.Queue) -> None:
    from yieldgate.pricing import Ledger, PostgresStore

    records = make_records(index, n)

    async def run() -> dict:
        ledger = Ledger(PostgresStore(url, max_connections=2), journal_dir, batch_size=batch_size,
                        flush_interval_s=flush_interval_s)
        await ledger.start()
        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.time()
        for j, rec in enumerate(records):
            ledger.record(rec)
            if j % 100 == 0:
                ledger.record(rec)  # a retried request: billed once
                await asyncio.sleep(0)  # the flusher runs on this loop, as in the gateway
        recorded = time.time()
        await ledger.flush(timeout=600)
        t1 = time.time()
        stats = {"writer": index, "t0": t0, "recorded": recorded, "t1": t1, "stored": ledger.stored,
                 "duplicates": ledger.duplicates, "store_errors": ledger.store_errors}
        await ledger.close()
        return stats

    out.put(asyncio.run(run()))


async def measure_table(url: str, expected: int) -> dict:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        rows, distinct = await conn.fetchrow("SELECT count(*), count(DISTINCT request_id) FROM yg_ledger")
        size = await conn.fetchval("SELECT sum(pg_total_relation_size(inhrelid)) FROM pg_inherits "
                                   "WHERE inhparent = 'yg_ledger'::regclass")
        heap = await conn.fetchval("SELECT sum(pg_relation_size(inhrelid)) FROM pg_inherits "
                                   "WHERE inhparent = 'yg_ledger'::regclass")
        partitions = await conn.fetchval("SELECT count(*) FROM pg_inherits WHERE inhparent = 'yg_ledger'::regclass")
    finally:
        await conn.close()
    return {"rows": rows, "lost": expected - distinct, "doubled": rows - distinct,
            "bytes_on_disk": int(size), "heap_bytes": int(heap), "partitions": partitions,
            "bytes_per_row": round(int(size) / rows, 1) if rows else None,
            "heap_bytes_per_row": round(int(heap) / rows, 1) if rows else None}


async def admin(server: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(server + "/postgres")
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def one_run(args: argparse.Namespace) -> dict:
    db = f"{args.db_prefix}_{secrets.token_hex(4)}"
    asyncio.run(admin(args.server, f'CREATE DATABASE "{db}"'))
    url = f"{args.server}/{db}"
    try:
        # Schema first, so the writers measure writes, not eight racing CREATE TABLEs.
        from yieldgate.pricing import PostgresStore

        async def schema() -> None:
            store = PostgresStore(url)
            await store.open()
            await store.close()
        asyncio.run(schema())
        ctx = mp.get_context("spawn")
        out: mp.Queue = ctx.Queue()
        start_at = time.time() + args.warmup_s
        with tempfile.TemporaryDirectory(prefix="yg-ledger-bench-") as tmp:
            procs = [ctx.Process(target=writer, args=(i, url, args.rows_per_writer, f"{tmp}/j{i}", start_at,
                                                      args.batch_size, args.flush_interval_s, out))
                     for i in range(args.writers)]
            for p in procs:
                p.start()
            stats = [out.get(timeout=900) for _ in procs]
            for p in procs:
                p.join(60)
        expected = args.writers * args.rows_per_writer
        t0 = min(s["t0"] for s in stats)
        t1 = max(s["t1"] for s in stats)
        table = asyncio.run(measure_table(url, expected))
        return {
            "writers": args.writers, "rows_sent": expected,
            "retries_sent": sum(s["duplicates"] for s in stats),
            "seconds": round(t1 - t0, 3), "rows_per_s": round(expected / (t1 - t0)),
            "stored_by_writers": sum(s["stored"] for s in stats),
            "store_errors": sum(s["store_errors"] for s in stats), **table,
            "batch_size": args.batch_size, "flush_interval_s": args.flush_interval_s,
        }
    finally:
        asyncio.run(admin(args.server, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))


def summarize(runs: list[dict]) -> dict:
    rates = [r["rows_per_s"] for r in runs]
    sizes = [r["bytes_per_row"] for r in runs]
    return {
        "runs": len(runs),
        "rows_per_s": {"median": round(statistics.median(rates)), "min": min(rates), "max": max(rates)},
        "bytes_per_row": {"median": round(statistics.median(sizes), 1), "min": min(sizes), "max": max(sizes)},
        "lost": sum(r["lost"] for r in runs), "doubled": sum(r["doubled"] for r in runs),
        "goal": {"rows_per_s": GOAL_ROWS_PER_S, "bytes_per_row": GOAL_BYTES_PER_ROW},
        "goal_met": statistics.median(rates) >= GOAL_ROWS_PER_S and max(sizes) <= GOAL_BYTES_PER_ROW
                    and all(r["lost"] == 0 and r["doubled"] == 0 for r in runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default="postgresql://postgres@127.0.0.1:5432",
                    help="PostgreSQL server (a database of the benchmark's own is created and dropped)")
    ap.add_argument("--db-prefix", default="yg_bench_ledger")
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--rows-per-writer", type=int, default=100_000)  # about 13 s a run here: sustained, not a burst
    ap.add_argument("--batch-size", type=int, default=500, help="records per INSERT (pricing.ledger.batch_size)")
    ap.add_argument("--flush-interval-s", type=float, default=0.2)
    ap.add_argument("--warmup-s", type=float, default=5.0, help="writers build their records before this")
    ap.add_argument("--runs", type=int, default=harness.DEFAULT_RUNS)
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--no-record", action="store_true", help="print only; keep the result file as it is")
    args = ap.parse_args()
    rec = harness.Recording("ledger_postgres", MEASURES, out=args.out)
    runs = []
    for i in range(args.runs):
        run = one_run(args)
        run["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
        print(f"run {i + 1}/{args.runs}: {run['rows_per_s']:,} rows/s over {run['seconds']} s from "
              f"{run['writers']} writers; {run['lost']} lost, {run['doubled']} doubled; "
              f"{run['bytes_per_row']} bytes/row on disk ({run['heap_bytes_per_row']} heap); "
              f"load {run['load_avg_after']}", flush=True)
        runs.append(run)
    s = summarize(runs)
    print(f"all {s['runs']} runs: rows/s median {s['rows_per_s']['median']:,} "
          f"(range {s['rows_per_s']['min']:,}-{s['rows_per_s']['max']:,}); bytes/row median "
          f"{s['bytes_per_row']['median']} (range {s['bytes_per_row']['min']}-{s['bytes_per_row']['max']}); "
          f"{s['lost']} lost, {s['doubled']} doubled; goal met: {s['goal_met']}")
    if not args.no_record:
        rec.write(runs=runs, summary=s, setup=f"{args.writers} writers x {args.rows_per_writer:,} rows, "
                                              f"batches of {args.batch_size}, one PostgreSQL on loopback")


if __name__ == "__main__":
    main()
