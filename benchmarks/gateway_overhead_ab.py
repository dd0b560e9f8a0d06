"""Interleaved A/B of gateway variants at one fixed rate, with the gateway's own stalls logged.

    python benchmarks/gateway_overhead_ab.py [--rate 500 --seconds 40 --rounds 3 --variants full,no_tokenize,no_metrics]
    python benchmarks/gateway_overhead_ab.py --variants full,full@base --code base=/work/base
    python benchmarks/gateway_overhead_ab.py --stream --rate 200 --variants full,vllm-router   # streamed requests

A variant may also be a Rust router (`vllm-router`, `smg`, run as gateway_overhead.py runs them), or
`floor`: uvicorn and yieldgate's upstream client with nothing else (benchmarks/python_floor.py).
A variant `NAME@LABEL` runs the gateway of another checkout (`--code LABEL=PATH`, e.g. a git worktree of
the commit before a change), so two code versions are compared side by side in one run.

The same fake upstream, load worker and core pinning as `gateway_overhead.py` (proxy_rig.py, whose functions it
uses), but rounds of every variant and a direct run interleaved, so slow drift of this VM hits
all of them alike. Inside the gateway and the load worker a small `sitecustomize` (written to a
temp dir, put on PYTHONPATH for this run only) logs every collector pass over 2 ms and every gap
over 8 ms in a watchdog thread that sleeps 5 ms at a time: a gap means that process's threads did
not run (the loop held the GIL in C code, or the core was busy elsewhere). The watchdog costs a
little CPU itself; compare variants with each other, not with `gateway_overhead.py` figures.

Writes /tmp/yieldgate-bench/gateway_overhead_ab.json (an A/B is scratch, not a canonical result): per variant and round the end-to-end
percentiles, gateway CPU per request, and the gaps and collector passes seen during the measured
phase (not during start-up or warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_rig as go  # noqa: E402  benchmarks/proxy_rig.py

WARMUP_S = 8.0  # the warm-up phase (300 requests at concurrency 8) ends within this

SITECUSTOMIZE = '''
import os, sys
_argv = " ".join(getattr(sys, "orig_argv", []))
_role = "gw" if "yieldgate.gateway.cli" in _argv else "lg" if "--load-worker" in _argv else None
if _role and os.environ.get("YG_AB_DIAG"):
    import gc, threading, time
    _log = open(os.path.join(os.environ["YG_AB_DIAG"], f"{_role}-{os.getpid()}.log"), "w", buffering=1)
    _started = {}

    def _on_gc(phase, info):
        if phase == "start":
            _started["t"] = time.perf_counter()
            return
        ms = (time.perf_counter() - _started.get("t", time.perf_counter())) * 1000
        if ms > 2:
            _log.write(f"{time.time():.3f} gc {info['generation']} {ms:.1f}\\n")

    def _watch():
        last = time.perf_counter()
        while True:
            time.sleep(0.005)
            now = time.perf_counter()
            if now - last > 0.008:
                _log.write(f"{time.time():.3f} gap - {(now - last) * 1000:.1f}\\n")
            last = now

    gc.callbacks.append(_on_gc)
    threading.Thread(target=_watch, daemon=True).start()
'''


def events(diag: Path, role: str, t0: float, t1: float) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"gap_ms": [], "gc_ms": []}
    for f in diag.glob(f"{role}-*.log"):
        for line in f.read_text().splitlines():
            ts, kind, _gen, ms = line.split()
            if t0 <= float(ts) <= t1:
                out["gap_ms" if kind == "gap" else "gc_ms"].append(float(ms))
    return out


def one_run(variant: str, rate: float, seconds: float, work: Path, diag: Path, code: dict[str, Path],
            stream: bool = False) -> dict:
    for f in diag.glob("*.log"):
        f.unlink()
    port = go.free_port()
    upstream = go.start_upstream(port)
    gateway = None
    try:
        go.cleanup_redis()
        if variant == "direct":
            url, key, pids = f"http://127.0.0.1:{port}", None, [upstream.pid]
        elif variant == "floor":  # the stack alone (benchmarks/python_floor.py)
            gateway = go.PythonFloor(f"http://127.0.0.1:{port}")
            url, key, pids = gateway.url, None, gateway.pids
        elif variant in go.ROUTERS:  # a Rust router, as gateway_overhead.py runs it
            gateway = go.RustRouter(variant, [f"http://127.0.0.1:{port}"] * 2, work)
            url, key, pids = gateway.url, None, gateway.pids
        else:
            name, _, label = variant.partition("@")
            gateway = go.Yieldgate(f"http://127.0.0.1:{port}", work, name, code[label] if label else go.ROOT)
            url, key, pids = gateway.url, gateway.api_key, [gateway.proc.pid]
        phases = go.plan({"fixed_s": seconds}, [], streams=False, rates=(rate,))  # warm-up + one fixed rate
        if stream:
            for phase in phases:
                phase["workload"] = go.STREAM_WORKLOAD
        t0 = time.time()
        rows = go.run_phases(go.target(url, key, stream=stream), phases, pids, work)
        t1 = time.time()
    finally:
        if gateway is not None:
            gateway.close()
        go.stop(upstream)
    row = rows[1]
    e2e = row["summary"]["e2e_ms"]["percentiles"]
    return {"variant": variant, "p50_ms": e2e["p50"], "p90_ms": e2e["p90"], "p99_ms": e2e["p99"],
            "failed": row["summary"]["failed"],
            "gateway_cpu_us_per_request": row["gateway_cpu_us_per_request"] if variant != "direct" else None,
            "gateway": events(diag, "gw", t0 + WARMUP_S, t1), "load_worker": events(diag, "lg", t0 + WARMUP_S, t1)}


def _commit(path: Path) -> str:
    out = subprocess.run(["git", "-C", str(path), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=500)
    p.add_argument("--seconds", type=float, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="full,no_tokenize,no_metrics",
                   help="comma-separated yieldgate variants or Rust routers (vllm-router, smg); "
                        "NAME@LABEL runs the checkout given by --code LABEL=PATH")
    p.add_argument("--code", action="append", default=[], metavar="LABEL=PATH",
                   help="another checkout of this repository (e.g. a git worktree of the baseline commit)")
    p.add_argument("--stream", action="store_true",
                   help=f"streamed requests ({go.STREAM_WORKLOAD['output_tokens']} events, "
                        f"{go.UPSTREAM_ITL_MS:g} ms apart) instead of unary ones")
    p.add_argument("--out", default="/tmp/yieldgate-bench/gateway_overhead_ab.json")
    a = p.parse_args()
    from yieldgate.serving.demo_model import ensure_demo_model

    go.MODEL_PATH = str(ensure_demo_model())
    variants = a.variants.split(",") + ["direct"]
    code = {label: Path(path).resolve() for label, _, path in (c.partition("=") for c in a.code)}
    for v in variants:
        name, _, label = v.partition("@")
        if v not in ("direct", "floor") and name not in go.VARIANTS and name not in go.ROUTERS:
            p.error(f"unknown variant {name!r}; have {', '.join(go.VARIANTS)}")
        if label and not (code.get(label, Path("/nonexistent")) / "gateway" / "cli.py").exists():
            p.error(f"variant {v!r}: give the checkout with --code {label}=PATH")
    tmp = Path(tempfile.mkdtemp(prefix="yg-ab-"))
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    diag = tmp / "diag"
    diag.mkdir()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp / "site"), os.environ.get("PYTHONPATH")]))
    os.environ["YG_AB_DIAG"] = str(diag)
    runs = []
    for r in range(a.rounds):
        for v in variants:
            run = one_run(v, a.rate, a.seconds, tmp, diag, code, a.stream)
            run["round"] = r + 1
            runs.append(run)
            gw = run["gateway"]
            print(f"round {r + 1} {v:<12} p50 {run['p50_ms']:.2f} p90 {run['p90_ms']:.2f} p99 {run['p99_ms']:.2f} ms "
                  f"cpu/req {run['gateway_cpu_us_per_request'] or 0:.0f} us; gateway gaps > 8 ms: "
                  f"{len(gw['gap_ms'])} ({sum(gw['gap_ms']):.0f} ms), collector passes > 2 ms: {len(gw['gc_ms'])}",
                  flush=True)
    direct_p50 = statistics.median(x["p50_ms"] for x in runs if x["variant"] == "direct")
    direct_p99 = statistics.median(x["p99_ms"] for x in runs if x["variant"] == "direct")
    summary = {}
    for v in variants:
        mine = [x for x in runs if x["variant"] == v]
        summary[v] = {"added_p50_ms_median": statistics.median(x["p50_ms"] for x in mine) - direct_p50,
                      "added_p99_ms_median": statistics.median(x["p99_ms"] for x in mine) - direct_p99,
                      "gateway_gaps_over_8ms_median": statistics.median(len(x["gateway"]["gap_ms"]) for x in mine)}
        print(f"{v:<12} added p50 {summary[v]['added_p50_ms_median']:+.2f} ms, p99 {summary[v]['added_p99_ms_median']:+.2f} ms "
              f"(medians over rounds); gateway gaps > 8 ms per run: {summary[v]['gateway_gaps_over_8ms_median']:g}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"rate": a.rate, "stream": a.stream, "seconds": a.seconds, "rounds": a.rounds,
                                       "code": {label or "(this checkout)": {"path": str(path), "commit": _commit(path)}
                                                for label, path in {"": go.ROOT, **code}.items()},
                                       "loadavg_1min_end": os.getloadavg()[0], "summary": summary, "runs": runs},
                                      indent=1))
    print(f"results in {a.out}")


if __name__ == "__main__":
    main()
