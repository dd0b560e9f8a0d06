"""Gateway overhead, side by side: direct to a fake upstream vs yieldgate vs the Rust routers
(vllm-router, smg) vs LiteLLM proxy.

Same machine, same fake upstream (benchmarks/fake_upstream.py), same seeded load from the project's
own load tester (in its own process), one run. The gateway under test is pinned to core 1 with
`taskset -c 1`; the upstream and the load generator share core 0.

    python benchmarks/gateway_overhead.py --quick          # ~6 min
    python benchmarks/gateway_overhead.py                  # full: ~15-20 min (100k-request RSS run)
    python benchmarks/gateway_overhead.py --skip-litellm --skip-routers   # yieldgate only

Reports (JSON, markdown table, PNG in benchmarks/results/gateway_overhead*):
- added latency (gateway - direct) p50/p99 at fixed open-loop Poisson rates (100, 500, 1000 RPS)
- max sustainable RPS per gateway core (rate sweep; a step fails on >1% errors, achieved < 90% of
  offered, or p99 > max(5x the first step's, 50 ms)) and gateway CPU-µs per request (1/that is the
  CPU-bound request rate per core, independent of the load generator's own limit)
- per-chunk added latency for streams (ITL difference), 1,000 concurrent streams (errors)
- yieldgate RSS after 20k and 100k requests (quick mode: 4k and 20k)
- yieldgate with each switchable feature turned off, and the floor: uvicorn and yieldgate's upstream
  client with nothing else (benchmarks/python_floor.py), what the stack costs before yieldgate's work.

The peers are pinned versions, each installed with pip into a venv of its own under
~/.cache/yieldgate/bench-venvs (YIELDGATE_BENCH_VENVS; created on first use, then reused): LiteLLM,
and vLLM's router and Shepherd Model Gateway (Rust, round robin over the same two upstream replicas
as yieldgate's, no tokenizer, on 127.0.0.1). Every target gets the same phases from the same load
generator in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_rig as rig  # noqa: E402  benchmarks/proxy_rig.py
from proxy_rig import (CLIENT_CORE, GATEWAY_CORE, LOADAVG, RESULTS, ROUTERS, UPSTREAM_ITL_MS,  # noqa: E402
                       VARIANT_ORDER, VARIANTS, LiteLLM, PythonFloor, RustRouter, Yieldgate, _dist, cleanup_redis,
                       free_port, load_worker, max_rps, plan, rss_run, run_phases, run_target, start_upstream, stop,
                       target)


def analyse(results: dict[str, Any]) -> dict[str, Any]:
    direct = results["targets"]["direct"]
    table: dict[str, Any] = {}
    for name, rows in results["targets"].items():
        t: dict[str, Any] = {}
        for rate in (100, 500, 1000):
            row = rows.get(f"fixed_{rate}")
            base = direct.get(f"fixed_{rate}")
            entry = {"p50_ms": _dist(row, "e2e_ms", "p50"), "p99_ms": _dist(row, "e2e_ms", "p99"),
                     "errors": row["summary"]["failed"] if row else None,
                     "achieved_rps": row["summary"]["request_throughput"] if row else None,
                     "gateway_cpu_us_per_request": row.get("gateway_cpu_us_per_request") if row else None}
            if name != "direct" and row and base:
                entry["added_p50_ms"] = entry["p50_ms"] - _dist(base, "e2e_ms", "p50")
                entry["added_p99_ms"] = entry["p99_ms"] - _dist(base, "e2e_ms", "p99")
            t[f"{rate}rps"] = entry
        t["max_rps"] = max_rps(rows) if any(k.startswith("sweep_") for k in rows) else None
        cpu = (t.get("500rps") or {}).get("gateway_cpu_us_per_request")
        t["cpu_bound_rps_per_core"] = 1e6 / cpu if cpu else None
        itl, base_itl = rows.get("streams_itl"), direct.get("streams_itl")
        if itl:
            t["streams"] = {"itl_p50_ms": _dist(itl, "itl_ms", "p50"), "itl_p99_ms": _dist(itl, "itl_ms", "p99"),
                            "itl_mean_ms": itl["summary"]["itl_ms"]["mean"] if itl["summary"]["itl_ms"]["count"] else None,
                            "ttft_p50_ms": _dist(itl, "ttft_ms", "p50"), "errors": itl["summary"]["failed"]}
            if name != "direct" and base_itl:
                t["streams"]["added_itl_p50_ms"] = t["streams"]["itl_p50_ms"] - _dist(base_itl, "itl_ms", "p50")
                t["streams"]["added_itl_p99_ms"] = t["streams"]["itl_p99_ms"] - _dist(base_itl, "itl_ms", "p99")
                t["streams"]["added_itl_mean_ms"] = t["streams"]["itl_mean_ms"] - base_itl["summary"]["itl_ms"]["mean"]
                t["streams"]["added_ttft_p50_ms"] = t["streams"]["ttft_p50_ms"] - _dist(base_itl, "ttft_ms", "p50")
        s1k = rows.get("streams_1000")
        if s1k:
            t["streams_1000"] = {"requests": s1k["summary"]["requests"], "errors": s1k["summary"]["failed"],
                                 "error_kinds": s1k["summary"]["errors"], "e2e_p99_ms": _dist(s1k, "e2e_ms", "p99")}
        table[name] = t
    yg, ll = table.get("yieldgate"), table.get("litellm")
    goals: dict[str, Any] = {}
    if yg:
        a = yg["500rps"]
        goals["p50_added_le_1ms_at_500"] = a.get("added_p50_ms") is not None and a["added_p50_ms"] <= 1.0
        goals["p99_added_le_5ms_at_500"] = a.get("added_p99_ms") is not None and a["added_p99_ms"] <= 5.0
    if yg and ll:
        ya, la = yg["500rps"].get("added_p50_ms"), ll["500rps"].get("added_p50_ms")
        goals["p50_overhead_ratio_litellm_over_yieldgate_at_500"] = la / ya if ya and la and ya > 0 else None
        yr, lr = (yg["max_rps"] or {}).get("max_sustained_rps"), (ll["max_rps"] or {}).get("max_sustained_rps")
        goals["max_rps_ratio_yieldgate_over_litellm"] = yr / lr if yr and lr else None
        yc, lc = yg.get("cpu_bound_rps_per_core"), ll.get("cpu_bound_rps_per_core")
        goals["cpu_bound_rps_ratio_yieldgate_over_litellm"] = yc / lc if yc and lc else None
    routers = [n for n in ROUTERS if n in table]
    if yg and routers:
        # The goal: every feature on, no more CPU per request and no more added latency than the
        # fastest Rust router, at 500 and 1,000 RPS.
        for rate in (500, 1000):
            at = f"{rate}rps"
            cpu = {n: table[n][at]["gateway_cpu_us_per_request"] for n in routers}
            fastest = min(routers, key=lambda n: cpu[n] or float("inf"))
            mine = yg[at]["gateway_cpu_us_per_request"]
            goals[f"fastest_router_at_{rate}"] = fastest
            goals[f"cpu_ratio_yieldgate_over_fastest_router_at_{rate}"] = mine / cpu[fastest] if mine and cpu[fastest] else None
            for q in ("p50", "p99"):
                best = min((table[n][at].get(f"added_{q}_ms") for n in routers), key=lambda v: float("inf") if v is None else v)
                ours = yg[at].get(f"added_{q}_ms")
                goals[f"added_{q}_ms_yieldgate_minus_best_router_at_{rate}"] = ours - best if ours is not None and best is not None else None
    return {"table": table, "goals": goals}


def result_meta(results: dict[str, Any]) -> dict[str, Any]:
    import harness  # benchmarks/harness.py, beside this script

    pairs = list(results.get("loadavg_1min", {}).values())  # (before, after) per target, in run order
    meta = harness.meta(["gateway/", "cache/", "serving/", "pricing/", "loadtest/", "benchmarks/gateway_overhead.py", "benchmarks/proxy_rig.py",
                         "benchmarks/fake_upstream.py"],
                        load_before=pairs[0][0] if pairs else None,
                        versions={"litellm": results.get("litellm_version"), **results.get("versions", {})})
    meta["load_avg_1m"]["samples"] = pairs
    return meta


def _f(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def markdown(results: dict[str, Any]) -> str:
    a = results["analysis"]
    t = a["table"]
    lines = [f"# Gateway overhead ({results['mode']} mode, {time.strftime('%Y-%m-%d %H:%M', time.localtime(results['started_at']))})",
             "", f"Machine: {os.cpu_count()} cores; gateway pinned to core {GATEWAY_CORE}, fake upstream + "
             f"load generator on core {CLIENT_CORE}. Chat requests, ~1.5 KB prompt, 16 output tokens (unary). "
             f"yieldgate with every feature on (cache-aware routing with tokenization, API key, cost, ledger, metrics); "
             + "".join(f"{n} {v} (round robin); " for n, v in results.get("versions", {}).items())
             + f"LiteLLM {results.get('litellm_version') or '-'}. 1-minute load average before/after each "
             f"target: " + ", ".join(f"{k} {v[0]:.2f}/{v[-1]:.2f}" for k, v in results.get("loadavg_1min", {}).items())
             + " (2 cores; the machine is shared with other engineers, whose runs take the same lock)."
             + (" LiteLLM was measured in a second run against the same upstream settings, "
                f"{(results['litellm_separate_run_at'] - results['started_at']) / 60:.0f} min after the first."
                if results.get("litellm_separate_run_at") else "")
             + (" yieldgate's rate sweep was run again then too, with the same procedure as LiteLLM's."
                if results.get("yieldgate_sweep_rerun") else ""), "",
             "## Added latency over direct (ms), open-loop Poisson", "",
             "| target | rate | p50 | p99 | added p50 | added p99 | errors | gateway CPU µs/req |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in t.items():
        for rate in (100, 500, 1000):
            e = row[f"{rate}rps"]
            lines.append(f"| {name} | {rate} | {_f(e['p50_ms'])} | {_f(e['p99_ms'])} | {_f(e.get('added_p50_ms'))} | "
                         f"{_f(e.get('added_p99_ms'))} | {_f(e['errors'])} | {_f(e['gateway_cpu_us_per_request'], 0)} |")
    lines += ["", "## Capacity per gateway core", "",
              "| target | max sustained RPS (sweep) | stopped at | why | CPU-bound RPS/core (1e6 / CPU-µs per req at 500 RPS) |",
              "|---|---|---|---|---|"]
    for name, row in t.items():
        m = row.get("max_rps") or {}
        lines.append(f"| {name} | {_f(m.get('max_sustained_rps'), 0)} | {_f(m.get('stopped_at'))} | "
                     f"{_f(m.get('stop_reason'))} | {_f(row.get('cpu_bound_rps_per_core'), 0)} |")
    lines += ["", f"## Streams (upstream ITL {UPSTREAM_ITL_MS:g} ms, 32 tokens, 32 concurrent; then 1,000 concurrent)", "",
              "| target | ITL p50 | ITL p99 | added ITL p50 | added ITL p99 | added ITL mean | added TTFT p50 | 1,000 concurrent: requests / errors |",
              "|---|---|---|---|---|---|---|---|"]
    for name, row in t.items():
        s = row.get("streams") or {}
        k = row.get("streams_1000") or {}
        lines.append(f"| {name} | {_f(s.get('itl_p50_ms'))} | {_f(s.get('itl_p99_ms'))} | {_f(s.get('added_itl_p50_ms'), 3)} | "
                     f"{_f(s.get('added_itl_p99_ms'), 3)} | {_f(s.get('added_itl_mean_ms'), 3)} | {_f(s.get('added_ttft_p50_ms'))} | "
                     f"{_f(k.get('requests'))} / {_f(k.get('errors'))} {k.get('error_kinds') or ''} |")
    rss = results.get("rss")
    if rss:
        lines += ["", "## yieldgate memory", "",
                  f"RSS after {rss['requests'][0]:,} requests: {rss['rss_mib'][0]:.1f} MiB; after "
                  f"{rss['requests'][1]:,}: {rss['rss_mib'][1]:.1f} MiB; growth {_f(rss['growth_pct'])}% "
                  f"(goal < 5%); errors {rss['errors']}."]
    var = results.get("variants") or {}
    if var:
        lines += ["", "## yieldgate features switched off, and the floor (500 RPS)", "",
                  "| variant | added p50 | added p99 | CPU µs/req | CPU-bound RPS/core |", "|---|---|---|---|---|"]
        base = results["targets"]["direct"]["fixed_500"]
        for name, r in var.items():
            row = r["fixed_500"]
            cpu = row.get("gateway_cpu_us_per_request")
            what = VARIANTS.get(name) or "benchmarks/python_floor.py: uvicorn + the upstream client, nothing else"
            lines.append(f"| {name} ({what}) | {_f(_dist(row, 'e2e_ms', 'p50') - _dist(base, 'e2e_ms', 'p50'))} | "
                         f"{_f(_dist(row, 'e2e_ms', 'p99') - _dist(base, 'e2e_ms', 'p99'))} | {_f(cpu, 0)} | "
                         f"{_f(1e6 / cpu if cpu else None, 0)} |")
        lines += ["", "Cost pricing has no switch (the response carries the cost): it is on in every variant."]
    lines += ["", "## Goals", ""] + [f"- {k}: {_f(v)}" for k, v in a["goals"].items()]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = results["analysis"]["table"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = [n for n in t if n != "direct"]
    rates = [100, 500, 1000]
    width = 0.8 / max(len(names), 1)
    for ax, q in zip(axes[:2], ("p50", "p99")):
        for i, n in enumerate(names):
            vals = [t[n][f"{r}rps"].get(f"added_{q}_ms") or 0 for r in rates]
            ax.bar([x + i * width for x in range(3)], vals, width, label=n)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(3)], [f"{r} RPS" for r in rates])
        ax.set_ylabel("ms added over direct")
        ax.set_yscale("symlog", linthresh=1)
        ax.set_title(f"added {q} latency")
        ax.legend()
    ax = axes[2]
    for n, rows in results["targets"].items():
        steps = [r for k, r in rows.items() if k.startswith("sweep_")]
        xs = [r["summary"]["offered_rate"] for r in steps]
        ys = [r["summary"]["e2e_ms"]["percentiles"].get("p99") if r["summary"]["e2e_ms"]["count"] else None for r in steps]
        ax.plot(xs, ys, marker="o", label=n)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered RPS")
    ax.set_ylabel("p99 e2e ms")
    ax.set_title("rate sweep (gateway on 1 core)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- main ----------------------------------------------------------------------------------------------------

MODES = {
    "quick": {"fixed_s": 5.0, "sweep_s": 4.0, "itl_requests": 200, "streams_requests": 1000,
              "rss_requests": (4000, 20000)},
    "full": {"fixed_s": 20.0, "sweep_s": 8.0, "itl_requests": 1000, "streams_requests": 3000,
             "rss_requests": (20000, 100000)},
    "smoke": {"fixed_s": 1.0, "sweep_s": 1.0, "itl_requests": 50, "streams_requests": 300,
              "rss_requests": (500, 1000)},
}
SWEEP = [250, 500, 750, 1000, 1500, 2000, 2500, 3000, 4000]
SWEEP_SLOW = [50, 100, 150, 200, 300, 400, 500, 750, 1000]


def main() -> None:
    from yieldgate.serving.demo_model import ensure_demo_model
    rig.MODEL_PATH = str(ensure_demo_model())
    p = argparse.ArgumentParser(description="gateway overhead: direct vs yieldgate vs the Rust routers vs LiteLLM")
    p.add_argument("--quick", action="store_true", help="fewer requests (~6 min instead of ~20)")
    p.add_argument("--skip-litellm", action="store_true")
    p.add_argument("--skip-routers", action="store_true", help="don't measure vllm-router and smg")
    p.add_argument("--skip-variants", action="store_true", help="don't measure feature-off variants")
    p.add_argument("--skip-rss", action="store_true")
    p.add_argument("--litellm-only", metavar="RESULTS_JSON",
                   help="measure only LiteLLM and add it to an earlier run's results (so that the "
                        "full mode fits in two shorter holds of a shared machine)")
    p.add_argument("--out", default=str(RESULTS / "gateway_overhead"), help="output path prefix")
    p.add_argument("--load-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.load_worker:
        load_worker(*a.load_worker)
        return
    mode_name = os.environ.get("GATEWAY_OVERHEAD_MODE") or ("quick" if a.quick else "full")
    mode = MODES[mode_name]
    workdir = Path(tempfile.mkdtemp(prefix="yg-overhead-"))
    results: dict[str, Any] = {"mode": mode_name, "started_at": time.time(), "targets": {}, "variants": {}}
    if a.litellm_only:
        results = json.loads(Path(a.litellm_only).read_text())
        results["targets"].pop("litellm", None)
        results["litellm_separate_run_at"] = time.time()
        mode_name = results["mode"]
        mode = MODES[mode_name]
        LOADAVG.update({k: v for k, v in results.get("loadavg_1min", {}).items() if k != "litellm"})
    up_port = free_port()
    upstream = start_upstream(up_port)
    up_url = f"http://127.0.0.1:{up_port}"
    t0 = time.monotonic()
    try:
        if not a.litellm_only:
            results["targets"]["direct"] = run_target("direct", up_url, None, [], mode, workdir, SWEEP)
            cleanup_redis()
            yg = Yieldgate(up_url, workdir, "full")
            try:
                results["targets"]["yieldgate"] = run_target("yieldgate", yg.url, yg.api_key, yg.pids, mode,
                                                             workdir, SWEEP)
                if not a.skip_rss:
                    results["rss"] = rss_run(yg.url, yg.api_key, yg.pids, mode, workdir)
            finally:
                yg.close()
        if not a.skip_variants and not a.litellm_only:  # before LiteLLM: nothing of it may be left running on core 1
            for variant in VARIANT_ORDER:
                cleanup_redis()
                g = Yieldgate(up_url, workdir, variant)
                try:
                    print(f"== yieldgate[{variant}]", flush=True)
                    phases = [ph for ph in plan(mode, [], streams=False) if ph["name"] in ("warmup", "fixed_500")]
                    rows = run_phases(target(g.url, g.api_key), phases, g.pids, workdir)
                    results["variants"][variant] = {r["name"]: r for r in rows}
                finally:
                    g.close()
            floor = PythonFloor(up_url)  # what the stack costs before any of yieldgate's work
            try:
                print("== python floor", flush=True)
                phases = [ph for ph in plan(mode, [], streams=False) if ph["name"] in ("warmup", "fixed_500")]
                rows = run_phases(target(floor.url, None), phases, floor.pids, workdir)
                results["variants"]["floor"] = {r["name"]: r for r in rows}
            finally:
                floor.close()
        if not a.skip_routers and not a.litellm_only:
            for name in ROUTERS:
                router = RustRouter(name, [up_url, up_url], workdir)
                results.setdefault("versions", {})[name] = router.version
                try:
                    results["targets"][name] = run_target(name, router.url, None, router.pids, mode, workdir, SWEEP)
                finally:
                    router.close()
        if a.litellm_only:
            # The sweep again with this harness (fresh client pool after a pause), so both
            # gateways' max RPS come from the same procedure.
            cleanup_redis()
            yg = Yieldgate(up_url, workdir, "full")
            try:
                print("== yieldgate sweep (again)", flush=True)
                phases = [ph for ph in plan(mode, SWEEP, streams=False) if ph["name"] == "warmup" or ph.get("sweep")]
                rows = run_phases(target(yg.url, yg.api_key), phases, yg.pids, workdir)
                kept = {k: v for k, v in results["targets"]["yieldgate"].items() if not k.startswith("sweep_")}
                results["targets"]["yieldgate"] = kept | {r["name"]: r for r in rows if r["name"] != "warmup"}
                results["yieldgate_sweep_rerun"] = True
            finally:
                yg.close()
        if not a.skip_litellm:
            ll = LiteLLM(up_url, workdir)
            results["litellm_version"] = ll.version
            try:
                results["targets"]["litellm"] = run_target("litellm", ll.url, ll.api_key, ll.pids, mode, workdir,
                                                           SWEEP_SLOW)
            finally:
                ll.close()
    finally:
        stop(upstream)
        cleanup_redis()
    results["runtime_s"] = results.get("runtime_s", 0) + time.monotonic() - t0
    results["loadavg_1min"] = LOADAVG
    results["analysis"] = analyse(results)
    results["meta"] = result_meta(results)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    out.with_suffix(".md").write_text(md)
    plot(results, out.with_suffix(".png"))
    print(md)
    print(f"runtime {results['runtime_s']:.0f}s; results in {out}.{{json,md,png}}")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
