"""Max sustained RPS of one gateway with 2 workers (`server.workers = 2`) vs 1, interleaved.

    python benchmarks/gateway_workers.py [--rounds 3 --step-s 10]

Each target is the `full` variant of benchmarks/proxy_rig.py (cache-aware routing, API keys, ledger,
metrics) in front of its fake upstream, which answers at once: the figure is the gateway's own
capacity, not an engine's. Both run on the same CPUs (all of the machine's); the load generator
and the fake upstream share them. A rate sweep per run: the max sustained RPS is the highest
throughput of a step with under 1% errors, at least 90% of the offered rate achieved, and a p99
within 5x the first step's (and at most 50 ms) — the same p99 bound for both. Goal: 2 workers
>= 1.7x one worker's (ratio of the medians over rounds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  benchmarks/harness.py
import proxy_rig as go  # noqa: E402  benchmarks/proxy_rig.py

GOAL_RATIO = 1.7
MEASURES = ["gateway/", "serving/upstream.py", "benchmarks/gateway_workers.py", "benchmarks/proxy_rig.py"]
SWEEP = [50, 100, 200, 300, 450, 600, 800, 1000, 1300, 1600, 2000, 2400]
ALL_CORES = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def one_run(workers: int, sweep: list[float], step_s: float, work: Path) -> dict:
    port = go.free_port()
    upstream = go.start_upstream(port)
    gateway = None
    try:
        go.cleanup_redis()
        gateway = go.Yieldgate(f"http://127.0.0.1:{port}", work, "full", cores=ALL_CORES,
                               overrides={"YIELDGATE_SERVER__WORKERS": str(workers)}, label=f"w{workers}")
        phases = go.plan({"fixed_s": 0, "sweep_s": step_s}, sweep, streams=False, rates=())
        rows = go.run_phases(go.target(gateway.url, gateway.api_key), phases, gateway.pids, work)
    finally:
        if gateway is not None:
            gateway.close()
        go.stop(upstream)
    by_name = {r["name"]: r for r in rows}
    best = go.max_rps(by_name)
    at = next((r for r in rows if r["name"].startswith("sweep_")
               and r["summary"]["request_throughput"] == best["max_sustained_rps"]), None)
    return {"workers": workers, **best,
            "p99_ms_at_max": at["summary"]["e2e_ms"]["percentiles"]["p99"] if at else None,
            "steps": [{"name": r["name"], "throughput": r["summary"]["request_throughput"],
                       "p99_ms": r["summary"]["e2e_ms"]["percentiles"].get("p99"), "failed": r["summary"]["failed"],
                       "fail_reason": r.get("fail_reason")} for r in rows if r["name"].startswith("sweep_")]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=harness.DEFAULT_RUNS)
    p.add_argument("--step-s", type=float, default=10)
    p.add_argument("--quick", action="store_true", help="1 round, 5 s steps")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.quick:
        a.rounds, a.step_s = 1, 5
    from yieldgate.serving.demo_model import ensure_demo_model

    go.MODEL_PATH = str(ensure_demo_model())
    rec = harness.Recording("gateway_workers", MEASURES, out=Path(a.out) if a.out else None)
    work = Path(tempfile.mkdtemp(prefix="yg-workers-"))
    targets = {f"{n}_worker{'s' if n > 1 else ''}": (lambda n=n: one_run(n, SWEEP, a.step_s, work)) for n in (1, 2)}
    runs = harness.repeat(targets, n=a.rounds)
    for r in runs:
        print(f"round {r['round']} {r['target']:<10} max sustained {r['max_sustained_rps']:.0f} RPS "
              f"(p99 {r['p99_ms_at_max'] or 0:.1f} ms; stopped: {r['stop_reason']})", flush=True)
    med = {t: statistics.median(r["max_sustained_rps"] for r in runs if r["target"] == t) for t in targets}
    one, two = med["1_worker"], med["2_workers"]
    ratio = two / one if one else None
    print(f"2 workers / 1 worker: {ratio or 0:.2f}x ({two:.0f} vs {one:.0f} RPS, medians; goal >= {GOAL_RATIO}x)")
    rec.write(runs=runs, summary={
        "ratio": ratio, "goal_ratio": GOAL_RATIO, "met": ratio is not None and ratio >= GOAL_RATIO,
        "max_sustained_rps": harness.by_target(runs, "max_sustained_rps"),
        "p99_ms_at_max": harness.by_target(runs, "p99_ms_at_max")},
        setup=f"gateway `full` variant (benchmarks/proxy_rig.py) with server.workers 1 or 2 on all "
              f"{len(ALL_CORES.split(','))} cores, fake upstream; Poisson rate sweep {SWEEP} RPS, {a.step_s:g} s a "
              f"step; {a.rounds} interleaved rounds")


if __name__ == "__main__":
    main()
