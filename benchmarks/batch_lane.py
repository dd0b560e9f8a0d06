"""Interactive time to first token with a batch job queued behind it, against interactive alone
(docs/batch.md), side by side in one run on one engine.

One demo engine launched as `yieldgate up` launches standard-0 (priority scheduling), with
`--max-num-seqs` small (default 4) so that the engine saturates at a load these cores can make.
Two gateways in front of it, each with a PostgreSQL database of its own:

- `lanes`: the gateway as shipped — batch lines at engine priority 2, admitted only while the
  engine has no request waiting, `--lines-per-replica` of them at most;
- `lanes_1`: the same with one batch line at a time per replica (the trade-off's other end);
- `naive`: the same job run the way a batch system without lanes would (no priority, admitted
  regardless of the engine's queue, 16 lines at once).

Targets, interleaved (benchmarks/harness.py), `--runs` rounds: `alone` (the interactive workload,
no job), `lanes`, `lanes_1` and `naive` (a job of `--batch-lines` lines submitted first, the interactive workload
while it runs; the job is cancelled afterwards). The interactive workload: `--concurrency` clients
sending streamed chat requests back to back, `--interactive` in all; TTFT per request. Batch lines
finished during the interactive window are counted too. Result: benchmarks/results/batch_lane.json.

    python benchmarks/batch_lane.py [--runs 3] [--interactive 40] [--concurrency 2] [--batch-lines 400]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

import harness  # benchmarks/harness.py, beside this script

from yieldgate.gateway.config import Config, ServerConfig
from yieldgate.gateway.embedded import GatewayProcess
from yieldgate.loadtest.stats import percentile
from yieldgate.serving.config import FleetConfig, ReplicaConfig

HOST = "127.0.12.1"
PG_SERVER = os.environ.get("YIELDGATE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432")
ADMIN = "bench-admin-" + secrets.token_hex(6)
TERMINAL = ("completed", "failed", "cancelled", "expired")
SYSTEM = "You answer support tickets for a printer company in one short paragraph. " * 4


def pg(statement: str) -> None:
    import asyncpg

    async def go() -> None:
        conn = await asyncpg.connect(PG_SERVER + "/postgres")
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(go())


@contextmanager
def database(name: str):
    pg(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG_SERVER}/{name}"
    finally:
        pg(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def engine(port: int, max_num_seqs: int, log_path: Path):
    """The demo fleet's standard-0 as `yieldgate up` launches it, on HOST:port."""
    from yieldgate.serving.config import LoraConfig
    from yieldgate.serving.demo_model import ensure_demo_model
    from yieldgate.serving.launcher import answers_health, engine_command, engine_env

    fleet = FleetConfig(demo_base_port=port, demo_hosts=[HOST])
    replica = fleet.replicas[0]
    spec = LoraConfig(enabled=False)
    command = engine_command(str(ensure_demo_model()), "demo", fleet.block_size, replica, spec)
    command += ["--max-num-seqs", str(max_num_seqs)]  # the last one counts
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, env=engine_env(replica, spec), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        while not answers_health(replica.base_url, 1.0):
            if proc.poll() is not None:
                raise SystemExit(f"engine exited {proc.returncode}: {log_path.read_text()[-2000:]}")
            time.sleep(0.5)
        yield replica.base_url
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def gateway(engine_url: str, postgres_url: str, workdir: Path, redis_url: str, **lanes: Any) -> GatewayProcess:
    config = Config(server=ServerConfig(host=HOST, admin_token=ADMIN, redis_url=redis_url, postgres_url=postgres_url,
                                       data_dir=str(workdir / secrets.token_hex(4))),
                    fleet=FleetConfig(model="demo", health_interval_s=0.5,
                                      replicas=[ReplicaConfig(name="std", tier="standard", url=engine_url)]))
    config.pricing.ledger.store = "postgres"
    config.pricing.limits.redis_url = redis_url
    for name, value in ({"batch_poll_s": 0.2} | lanes).items():
        setattr(config.lanes, name, value)
    return GatewayProcess(config, workdir)


def one_request(url: str, i: int, max_tokens: int) -> float | None:
    """TTFT of one streamed chat request (None if it failed)."""
    body = {"model": "demo", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Ticket {i}: paper jam."}]}
    started = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as resp:
        if resp.status_code != 200:
            return None
        ttft = None
        for line in resp.iter_lines():
            if ttft is None and line.startswith("data: {") and '"content"' in line:
                ttft = time.perf_counter() - started
        return ttft


def interactive(url: str, n: int, concurrency: int, max_tokens: int) -> list[float | None]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda i: one_request(url, i, max_tokens), range(n)))


def submit(url: str, lines: int, max_tokens: int) -> str:
    admin = {"authorization": f"Bearer {ADMIN}"}
    data = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "demo", "max_tokens": max_tokens, "ignore_eos": True,
                                        "messages": [{"role": "system", "content": SYSTEM},
                                                     {"role": "user", "content": f"Summarise ticket {i}."}]}}) + "\n"
                   for i in range(lines))
    f = httpx.post(url + "/v1/files", headers=admin, files={"file": ("job.jsonl", data.encode())},
                   data={"purpose": "batch"}, timeout=60).json()
    batch = httpx.post(url + "/v1/batches", headers=admin, timeout=60, json={
        "input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()
    return batch["id"]


def batch_state(url: str, batch_id: str) -> dict:
    return httpx.get(f"{url}/v1/batches/{batch_id}", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30).json()


def with_batch(url: str, args: argparse.Namespace) -> dict:
    batch_id = submit(url, args.batch_lines, args.batch_tokens)
    deadline = time.monotonic() + 60
    while batch_state(url, batch_id)["request_counts"]["completed"] < 1 and time.monotonic() < deadline:
        time.sleep(0.2)  # the job is running before the interactive clients start
    before = batch_state(url, batch_id)["request_counts"]["completed"]
    started = time.monotonic()
    ttfts = interactive(url, args.interactive, args.concurrency, args.interactive_tokens)
    window = time.monotonic() - started
    state = batch_state(url, batch_id)
    done = state["request_counts"]["completed"] - before
    # Cancelled for the next target; a job that outlived the window is what the comparison needs.
    httpx.post(f"{url}/v1/batches/{batch_id}/cancel", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)
    deadline = time.monotonic() + 120
    while batch_state(url, batch_id)["status"] not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.2)
    return figures(ttfts) | {"batch_outlived_window": state["status"] == "in_progress",
                             "batch_counts_at_window_end": state["request_counts"], "batch_lines_in_window": done, "batch_lines_per_s": round(done / window, 3),
                             "window_s": round(window, 3)}


def figures(ttfts: list[float | None]) -> dict:
    ok = [t for t in ttfts if t is not None]
    return {"requests": len(ttfts), "failed": len(ttfts) - len(ok),
            "ttft_p50_ms": round(percentile(ok, 50) * 1000, 1) if ok else None,
            "ttft_p99_ms": round(percentile(ok, 99) * 1000, 1) if ok else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=harness.DEFAULT_RUNS)
    ap.add_argument("--interactive", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--interactive-tokens", type=int, default=16)
    ap.add_argument("--batch-lines", type=int, default=400)
    ap.add_argument("--batch-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--lines-per-replica", type=int, default=2)
    ap.add_argument("--port", type=int, default=22400, help="the engine's port")
    ap.add_argument("--redis-db", type=int, default=13)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rec = harness.Recording("batch_lane", measures=["gateway/", "serving/config.py", "benchmarks/batch_lane.py"],
                            command="python benchmarks/batch_lane.py " + " ".join(
                                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                if k not in ("out",) and v is not None), out=args.out)
    redis_url = f"redis://127.0.0.1:6379/{args.redis_db}"
    work = Path(tempfile.mkdtemp(prefix="yg-batch-lane-"))
    tag = secrets.token_hex(4)
    with engine(args.port, args.max_num_seqs, work / "engine.log") as engine_url, \
            database(f"yg_bench_lanes_{tag}") as lanes_pg, database(f"yg_bench_lanes1_{tag}") as lanes1_pg, \
            database(f"yg_bench_naive_{tag}") as naive_pg:
        lanes_gw = gateway(engine_url, lanes_pg, work, redis_url, batch_lines_per_replica=args.lines_per_replica)
        lanes1_gw = gateway(engine_url, lanes1_pg, work, redis_url, batch_lines_per_replica=1)
        naive_gw = gateway(engine_url, naive_pg, work, redis_url, priority=False, batch_max_waiting=1_000_000,
                           batch_lines_per_replica=16)
        try:
            interactive(lanes_gw.url, 4, 2, 4)  # warm-up: connections, the engine's first steps
            runs = harness.repeat({
                "alone": lambda: figures(interactive(lanes_gw.url, args.interactive, args.concurrency,
                                                     args.interactive_tokens)),
                "lanes": lambda: with_batch(lanes_gw.url, args),
                "lanes_1": lambda: with_batch(lanes1_gw.url, args),
                "naive": lambda: with_batch(naive_gw.url, args),
            }, n=args.runs)
        finally:
            for gw in (lanes_gw, lanes1_gw, naive_gw):
                gw.stop()
    p99 = harness.by_target(runs, "ttft_p99_ms")
    ratios = {}
    for target in ("lanes", "lanes_1", "naive"):
        per_round = [r["ttft_p99_ms"] / a["ttft_p99_ms"] for r in runs for a in runs
                     if r["target"] == target and a["target"] == "alone" and r["round"] == a["round"]
                     and r["ttft_p99_ms"] and a["ttft_p99_ms"]]
        ratios[f"{target}_over_alone_ttft_p99"] = harness.summarize(per_round)
    summary = {"ttft_p99_ms": p99, "ttft_p50_ms": harness.by_target(runs, "ttft_p50_ms"),
               "batch_lines_per_s": harness.by_target(runs, "batch_lines_per_s"), **ratios,
               "failed": sum(r["failed"] for r in runs)}
    setup = (f"one demo engine (standard-0 as yieldgate up launches it, --max-num-seqs {args.max_num_seqs}); "
             f"{args.interactive} streamed interactive chat requests at concurrency {args.concurrency}, "
             f"{args.interactive_tokens} tokens each; a batch job of {args.batch_lines} lines x {args.batch_tokens} "
             f"tokens running meanwhile (lanes: priority 2, admitted at 0 waiting, {args.lines_per_replica} lines; lanes_1: 1 line; "
             "naive: no priority, 16 lines regardless of the queue)")
    rec.write(runs=runs, summary=summary, setup=setup)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
