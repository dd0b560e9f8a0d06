"""How long one round trip into a vLLM engine takes while the other engine of the demo fleet
serves, on this machine: the cost every step of a weight swap pays.

    python benchmarks/engine_hops.py            # starts its own demo stack (ports 218xx)

Engine A (standard-0) is idle, as a replica being swapped is (drained, out of routing); B
(fast-0) serves a closed loop of short completions sent to it directly, at 0, 4 and 6
concurrent; then A serves and B idles. Measured on A, `--samples` times per phase, 50 ms apart:
- worker hop: `/start_weight_update` + `/finish_weight_update` (no-ops for the yieldgate backend;
  API server -> engine core -> worker and back, what an apply or a finish pays), per call;
- core hop: `/weight_info` (API server -> engine core and back, what a version read pays).
A rolling swap of a fleet with one replica per tier takes two waves one after the other, each a
few such hops; a direct push pays them in parallel on every engine. Writes
benchmarks/results/engine_hops.json (`--out PATH` for elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import httpx

import harness  # benchmarks/harness.py, beside this script
from stacks import model_dir, own_stack

RESULTS = Path(__file__).parent / "results"


def closed_loop(url: str, stop: threading.Event, done: list[int]) -> None:
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            http.post(url + "/v1/completions", json={
                "model": "demo", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
            done[0] += 1


def spread(xs: list[float]) -> dict[str, float]:
    ordered = sorted(xs)
    return {"p50_ms": statistics.median(ordered) * 1e3, "p90_ms": ordered[int(len(ordered) * 0.9)] * 1e3,
            "max_ms": ordered[-1] * 1e3, "n": len(ordered)}


def measure(url: str, samples: int) -> tuple[list[float], list[float]]:
    worker, core = [], []
    with httpx.Client(timeout=60) as http:
        for _ in range(samples):
            t = time.perf_counter()
            http.post(url + "/start_weight_update").raise_for_status()
            http.post(url + "/finish_weight_update", json={"weight_version": None}).raise_for_status()
            worker.append((time.perf_counter() - t) / 2)
            t = time.perf_counter()
            http.get(url + "/weight_info").raise_for_status()
            core.append(time.perf_counter() - t)
            time.sleep(0.05)
    return worker, core


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=21800, help="gateway port; engines port+101, +102")
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    phases = [(0, 0), (4, 0), (6, 0), (0, 4)]  # (B's concurrency, A's concurrency)
    results = []
    with own_stack(args.port, model_dir(False)) as _:
        a, b = f"http://127.0.0.1:{args.port + 101}", f"http://127.0.0.1:{args.port + 102}"
        for conc_b, conc_a in phases:
            stop, done = threading.Event(), [0]
            threads = [threading.Thread(target=closed_loop, args=(b, stop, done)) for _ in range(conc_b)]
            threads += [threading.Thread(target=closed_loop, args=(a, stop, done)) for _ in range(conc_a)]
            for t in threads:
                t.start()
            time.sleep(2.0)
            t0, n0 = time.perf_counter(), done[0]
            worker, core = measure(a, args.samples)
            rate = (done[0] - n0) / (time.perf_counter() - t0)
            stop.set()
            for t in threads:
                t.join()
            row = {"other_engine_concurrency": conc_b, "this_engine_concurrency": conc_a,
                   "completions_per_s": rate, "load_avg_1m": os.getloadavg()[0],
                   "worker_hop": spread(worker), "core_hop": spread(core)}
            results.append(row)
            print(f"[hops] B conc {conc_b}, A conc {conc_a} ({rate:.1f} completions/s): worker hop "
                  f"p50 {row['worker_hop']['p50_ms']:.1f} p90 {row['worker_hop']['p90_ms']:.1f} "
                  f"max {row['worker_hop']['max_ms']:.0f} ms | core hop p50 {row['core_hop']['p50_ms']:.1f} "
                  f"p90 {row['core_hop']['p90_ms']:.1f} max {row['core_hop']['max_ms']:.0f} ms", flush=True)
    out = Path(args.out) if args.out else RESULTS / "engine_hops"
    out.with_suffix(".json").write_text(json.dumps(
        {"meta": harness.meta(["serving/", "benchmarks/engine_hops.py", "benchmarks/stacks.py"]),
         "phases": results, "cpus": os.cpu_count(), "samples": args.samples,
         "engines": {"A": "standard-0 (the one measured)", "B": "fast-0 (ngram speculative decoding)"}},
        indent=2))
    print(f"[hops] wrote {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
