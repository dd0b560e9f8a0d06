"""Every benchmark in the configuration its README row names, and the README's results table.

    python benchmarks/run_all.py --table            # print the table from benchmarks/results/
    python benchmarks/run_all.py --check [--strict] # fail unless README's table is that table; list stale rows
    python benchmarks/run_all.py --readme           # write the table into README.md
    python benchmarks/run_all.py --list             # each benchmark, its command and whether it runs here
    python benchmarks/run_all.py [--only a,b]       # run them (canonical results), then print the table
    python benchmarks/run_all.py --quick [--only …] # smaller runs written under /tmp/yieldgate-bench

Each row's figure and goal are computed from the canonical result file(s) its benchmark writes
(benchmarks/harness.py's format), so the README's figures are what this printed last. Rows whose
figure a test asserts (parity, chaos drills, fuzzing) read the counts that test recorded. Each row
names the commit its result measured and whether that code changed since (stale). Benchmarks that
need a running stack start it themselves (`yieldgate up --config …` on loopback, stopped afterwards).
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  benchmarks/harness.py
from stack_up import stack  # noqa: E402  benchmarks/stack_up.py

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SCRATCH = Path(tempfile.gettempdir()) / "yieldgate-bench"
PY = sys.executable
DEMO = ""  # `stack=DEMO`: the demo stack, `yieldgate up` with its default configuration


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%"


def span(values: list[float], fmt: Callable[[float], str]) -> str:
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}–{fmt(hi)}"


def bold(text: str, met: bool) -> str:
    return text if met else f"**{text}**"


def median_range(values: list[float], fmt: Callable[[float], str]) -> str:
    """The table's figure of repeated runs: their median, and their range where it is wider than
    the figure's precision."""
    mid, lo, hi = statistics.median(values), min(values), max(values)
    return fmt(mid) if fmt(lo) == fmt(hi) else f"{fmt(mid)} [{fmt(lo)}–{fmt(hi)}]"


@dataclass
class Benchmark:
    name: str
    row: str                                  # the README row's first column
    goal: str
    reproduce: str                            # the README's "reproduce" column
    figure: Callable[[], str]                 # today's figure, read from the result file(s)
    run: list[str] | None = None              # full run writing the canonical result (argv after python)
    quick: list[str] | None = None            # smaller run, output under SCRATCH
    stack: str | None = None                  # config file of the stack the run needs (DEMO: none)
    files: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def suite(test: str) -> dict:
    """A result the test suite measures: its test file run with results recorded."""
    return {"run": ["-m", "pytest", "-p", "no:cacheprovider", "-q", f"tests/{test}"],
            "env": {"YIELDGATE_RECORD_RESULTS": "1"}}


# -- figures ------------------------------------------------------------------------------------

def tokenizer_speed() -> str:
    d = load("tokenizer_speed")
    if "runs" not in d:  # the best of 5 passes, each path; the passes were not kept
        return (f"{d['speedup']:.2f}× ({d['tiktoken_tokens_per_s'] / 1e6:.2f} M vs "
                f"{d['hf_tokenizers_tokens_per_s'] / 1e6:.2f} M tokens/s; best of 5 passes, which were not kept)")
    sm = d["summary"]
    ratio, speed = sm["speedup"], sm["tokens_per_s"]
    m = lambda v: f"{v / 1e6:.2f} M"  # noqa: E731
    return (f"{bold(median_range([ratio['min'], ratio['median'], ratio['max']], lambda v: f'{v:.2f}×'), ratio['median'] >= 3)} "
            f"({m(speed['tiktoken']['median'])} vs {m(speed['hf_tokenizers']['median'])} tokens/s, medians of "
            f"{ratio['n']} interleaved passes)")


def routing_real() -> str:
    rows = load("routing")["real"]
    ca = [r for r in rows if r["policy"] == "cache_aware"]
    rr = [r for r in rows if r["policy"] == "round_robin"]
    diff = [r["ttft_p90_vs_round_robin"]["diff_ms"] for r in ca]
    load_ = [r["load_max_over_mean"] for r in ca]
    # The Rust routers' policies ("vllm-router:cache_aware"): cache_aware must match the best of
    # them at every load (within half a point of the oracle ratio).
    peers = list(dict.fromkeys(r["policy"] for r in rows if ":" in r["policy"]))
    best = {c: max(r["ratio_to_oracle"] for r in rows if r["policy"] in peers and r["concurrency"] == c)
            for c in {r["concurrency"] for r in ca}} if peers else {}
    met = min(r["ratio_to_oracle"] for r in ca) >= 0.95 and \
        all(r["ratio_to_oracle"] >= best[r["concurrency"]] - 0.005 for r in ca if r["concurrency"] in best)
    # TTFT "never worse": at every load the 90% interval of (TTFT p90 − round robin's) reaches 0 or below.
    ttft_met = all(r["ttft_p90_vs_round_robin"]["ci90_ms"][0] <= 0 for r in ca)
    theirs = "".join(f", {p.replace(':', ' ')} {span([r['ratio_to_oracle'] for r in rows if r['policy'] == p], pct)}"
                     for p in peers)
    ttft = f"{min(diff):+.0f} to {max(diff):+.0f}".replace("-", "−")
    # Its settings measured beside the defaults ("cache_aware+overlap_weight=1").
    tuned = "".join(f" ({p.split('+', 1)[1].replace('+', ', ').replace('=', ' ')}: "
                    f"{span([r['ratio_to_oracle'] for r in rows if r['policy'] == p], pct)})"
                    for p in dict.fromkeys(r["policy"] for r in rows if r["policy"].startswith("cache_aware+")))
    return (f"cache_aware {bold(span([r['ratio_to_oracle'] for r in ca], pct), met)}{tuned} vs round robin "
            f"{span([r['ratio_to_oracle'] for r in rr], pct)}{theirs}; TTFT p90 − round robin "
            f"{bold(ttft + ' ms', ttft_met)}; max/mean load {bold(span(load_, lambda v: f'{v:.2f}'), max(load_) <= 1.25)}")


def routing_sim() -> str:
    sim = load("routing-kv1gib")["sim"]
    ca = [r["ratio_to_oracle"] for r in sim if r["policy"] == "cache_aware"]
    rr = [r["ratio_to_oracle"] for r in sim if r["policy"] == "round_robin"]
    return (f"cache_aware {bold(span(ca, pct), min(ca) >= 0.95)} of oracle vs round robin "
            f"≈ {100 * sum(rr) / len(rr):.0f}%")


def routing_zipf() -> str:
    sim = load("routing-zipf64")["sim"]
    ca = [r for r in sim if r["policy"] == "cache_aware"]
    ch = [r for r in sim if r["policy"] == "consistent_hash"]
    ratios = [r["ratio_to_oracle"] for r in ca]
    # Every seed's figure, where the file has them, is what the goal is checked against.
    worst = min(x for r in ca for x in r.get("ratio_to_oracle_by_seed", [r["ratio_to_oracle"]]))
    loads = [x for r in ca for x in r.get("load_max_over_mean_by_seed", [r["load_max_over_mean"]])]
    seeds = len(ca[0].get("ratio_to_oracle_by_seed", [0]))
    ca_load = span(loads, lambda v: f"{v:.2f}")
    ch_load = span([r["load_max_over_mean"] for r in ch], lambda v: f"{v:.1f}")
    ch_ttft = span([r["ttft_p90_s"] for r in ch], lambda v: f"{v:.0f}")
    of_seeds = f" (mean of {seeds} seeds; worst seed {pct(worst)})" if seeds > 1 else ""
    return (f"cache_aware {bold(span(ratios, pct), worst >= 0.95)} of oracle{of_seeds}, max/mean load "
            f"{bold(ca_load, max(loads) <= 1.25)}; consistent hashing: max/mean load {ch_load}, TTFT p90 {ch_ttft} s")


def emulated_fleet() -> str:
    d = load("emulated_fleet")
    summary, goals, mine = d["summary"], d["goals"], d["goals_of"]
    others = [p for p in summary if p.startswith("yieldgate:") and p != mine]
    peers = [p for p in summary if not p.startswith("yieldgate:")]
    med = lambda router, key: [e[key]["median"] for e in summary[router].values()]  # noqa: E731
    met = {k: all(g[k] for g in goals.values()) for k in next(iter(goals.values()))}
    ratio = bold(span(med(mine, "ratio_to_oracle"), pct), met["ratio_ge_95"] and met["ratio_ge_best_peer"])
    theirs = "".join(f", {p.split(':')[0]} {span(med(p, 'ratio_to_oracle'), pct)}" for p in peers)
    ttft = lambda router: span(med(router, "ttft_p90_ms"), lambda v: f"{v:.0f}")  # noqa: E731
    load_ = lambda router: span(med(router, "load_max_over_mean"), lambda v: f"{v:.2f}")  # noqa: E731
    ours = "".join(f" ({p.split(':')[1]}: {span(med(p, 'ratio_to_oracle'), pct)})" for p in others)
    return (f"yieldgate {mine.split(':')[1]} {ratio} of oracle{ours}{theirs}; TTFT p90 "
            f"{bold(ttft(mine) + ' ms', met['ttft_p90_not_worse'])} vs "
            + ", ".join(f"{ttft(p)} ms" for p in peers)
            + f"; max/mean load {bold(load_(mine), met['load_not_worse'])} vs " + ", ".join(load_(p) for p in peers)
            + f" ({d['engines']} emulated engines, loads {', '.join(summary[mine])}, medians of "
            f"{next(iter(summary[mine].values()))['ratio_to_oracle']['n']} interleaved runs)")


def loadtest_vs_vllm() -> str:
    m = load("loadtest_vs_vllm_bench")["median_of_repeats"]
    return (f"req/s {m['request_throughput']['ratio']:.2f}×, mean TTFT {m['mean_ttft_ms']['ratio']:.2f}×, "
            f"mean TPOT {m['mean_tpot_ms']['ratio']:.2f}×")


def loadtest_overhead() -> str:
    d = load("loadtest_overhead")
    return (f"{d['client_cpu_us_per_request']:.0f} µs CPU per request "
            f"(≈ {round(d['client_capacity_rps_per_core'], -2):,.0f} req/s per core)")


def fast_vs_standard() -> str:
    d = load("fast_vs_standard")
    x = lambda v: f"{v:.2f}×"  # noqa: E731
    if "runs" not in d:  # one run, without a same-engine control or the serving replicas
        rows = d["workloads"]
        w = {k: v["speedup_e2e_output_tps_p50"] for k, v in rows.items()}
        greedy = [w[k] for k in ("code_edit_greedy", "code_edit_greedy@c4") if k in w]
        others = [k for k in w if not k.startswith("code_edit_greedy")]
        # A class counts as not slower when its ratio's 90% bootstrap interval reaches 1×.
        not_slower = all(rows[k]["speedup_e2e_output_tps_ci90"][1] >= 1 for k in others)
        return (f"greedy code edits {bold(x(greedy[0]), greedy[0] >= 2)} (conc. 1), "
                f"{bold(x(greedy[-1]), greedy[-1] >= 2)} (conc. 4); every other class "
                f"{bold(span([w[k] for k in others], x), not_slower)} (1 run; same-engine control and "
                "serving engine per class not recorded)")
    sm = d["summary"]

    def mr(name: str, key: str) -> str:
        v = sm[name][key]
        return median_range([v["min"], v["median"], v["max"]], x)

    greedy = [k for k in ("code_edit_greedy", "code_edit_greedy@c4") if k in sm]
    others = [k for k in sm if not k.startswith("code_edit_greedy")]
    corrected = "speedup_e2e_output_tps_p50_corrected"
    # Which replicas served the fast target's requests of each class (the speculation filter may send
    # sampled ones to a standard replica, where "≥ 1×" holds by construction).
    served = {k: "+".join(sorted(sm[k]["served_by"].get("fast", {}))) or "?" for k in sm}
    by_engine = "; ".join(f"{eng}: {', '.join(k for k in sm if served[k] == eng)}" for eng in dict.fromkeys(served.values()))
    bias = [sm[k]["control_e2e_output_tps_p50"]["median"] for k in sm]
    return (f"greedy code edits {', '.join(bold(mr(k, corrected), sm[k][corrected]['median'] >= 2) + (' (conc. 4)' if '@c4' in k else ' (conc. 1)') for k in greedy)}; "
            f"every other class {bold(span([sm[k][corrected]['median'] for k in others], x), all(sm[k][corrected]['median'] >= 1 for k in others))} "
            f"(medians of {len(d['runs'])} runs, each divided by its same-engine control, which came out "
            f"{span(bias, x)}); fast target served by {by_engine}")


def weight_push() -> str:
    d = load("weight_push")
    return (f"wire {pct(d['stage_vs_loopback'], 0)} of loopback TCP; whole push with load "
            f"{bold(pct(d['push_vs_loopback'], 0), d['push_vs_loopback'] >= 0.8)}; "
            f"{d['push_speedup_vs_disk']:.2f}× faster than a disk reload")


def rollout() -> str:
    def ratios(name: str) -> dict[str, list[float]]:
        runs = load(name)["runs"]
        return {mode: [r["modes"][mode]["time_to_100pct_new_s"] / r["raw_transfer_seconds"] for r in runs]
                for mode in ("rolling", "all_at_once")}

    def figure(values: list[float]) -> str:
        return bold(median_range(values, lambda v: f"{v:.2f}×"), statistics.median(values) < 2)

    runs = {name: load(name)["runs"] for name in ("rollout", "rollout-big")}
    tiny, big = ratios("rollout"), ratios("rollout-big")
    failed = sum(r["failed_load"] + r["failed_probe"] for rs in runs.values() for r in rs)
    requests = sum(r["requests_load"] for rs in runs.values() for r in rs)
    n = "/".join(str(len(rs)) for rs in runs.values())
    return (f"rolling {figure(tiny['rolling'])}, all_at_once {figure(tiny['all_at_once'])} "
            f"(28 MB model: {figure(big['rolling'])} / {figure(big['all_at_once'])}); "
            f"{bold(f'{failed} failed', failed == 0)} requests of {requests:,} ({n} runs of one commit)")


def adapter_push() -> str:
    d = load("adapter_push")
    k = d["kinds"]
    to_new = {kind: v["time_to_100pct_new"]["median"] for kind, v in k.items()}
    failed, wrong = d["failed"], d["responses_with_impossible_version"]
    return (f"adapter push → 100% on new version {to_new['adapter']:.2f} s vs full-weight push "
            f"{to_new['full_rolling']:.2f} s (rolling) / {to_new['full_all_at_once']:.2f} s (all at once); "
            f"{k['adapter']['bytes_sent'] / 1e3:.0f} kB vs {k['full_rolling']['bytes_sent'] / 1e6:.1f} MB sent; "
            f"{bold(f'{failed} failed', failed == 0)} of {d['requests']:,}, "
            f"{bold(f'{wrong} mislabelled', wrong == 0)}")


def engine_hops() -> str:
    busy = [p for p in load("engine_hops")["phases"] if p["other_engine_concurrency"] > 0]
    hop = [p["worker_hop"] for p in busy]
    return (f"p50 {span([h['p50_ms'] for h in hop], lambda v: f'{v:.1f}')} ms; "
            f"p90 {span([h['p90_ms'] for h in hop], lambda v: f'{v:.0f}')} ms, "
            f"max {span([h['max_ms'] / 1000 for h in hop], lambda v: f'{v:.1f}')} s")


def engine_polling() -> str:
    d = load("engine_polling")
    late = {n: [r["max_ms"] for r in d["rows"] if r["setting"] == n] for n in ("pause_50us", "vllm_yield_loop")}
    ms = lambda v: f"{v:,.0f}"  # noqa: E731
    return (f"decode per request {d['decode_ratio_c1']:.2f}× alone, {d['decode_ratio_c3']:.2f}× at conc. 3; "
            f"a gateway beside it, relaying 3 streams, answers /readyz within {span(late['pause_50us'], ms)} ms "
            f"vs {span(late['vllm_yield_loop'], ms)} ms (worst probe per round)")


def gateway_overhead() -> str:
    d = load("gateway_overhead")
    t = d["analysis"]["table"]
    yg = t["yieldgate"]
    rates = (500, 1000)
    cpu = {rate: yg[f"{rate}rps"]["gateway_cpu_us_per_request"] for rate in rates}
    routers = [n for n in ("vllm-router", "smg") if n in t]
    # The goal: no more CPU per request than the fastest Rust router at each rate (unchecked, and
    # said so, in a run without them).
    met = bool(routers) and all(cpu[r] <= min(t[n][f"{r}rps"]["gateway_cpu_us_per_request"] for n in routers)
                                for r in rates)
    peers = ", ".join(f"{n} {t[n]['500rps']['gateway_cpu_us_per_request']:.0f} / "
                      f"{t[n]['1000rps']['gateway_cpu_us_per_request']:.0f}" for n in routers)
    versus = f" vs {peers} µs" if routers else " (Rust routers not measured)"
    head = f"CPU per request at 500 / 1,000 RPS {bold(f'{cpu[500]:.0f} / {cpu[1000]:.0f} µs', met)}{versus}"
    # LiteLLM at each rate it was driven at, with how far behind it fell there (its added p50).
    lite = t.get("litellm", {})
    lite_rates = [r for r in (100, 500, 1000) if lite.get(f"{r}rps", {}).get("gateway_cpu_us_per_request")]
    if lite_rates:
        ratio = {r: lite[f"{r}rps"]["gateway_cpu_us_per_request"] / yg[f"{r}rps"]["gateway_cpu_us_per_request"]
                 for r in lite_rates}
        behind = " / ".join(f"{lite[f'{r}rps']['added_p50_ms'] / 1000:.1f}" for r in lite_rates)
        head += (f"; LiteLLM uses {bold(' / '.join(f'{ratio[r]:.1f}×' for r in lite_rates), min(ratio.values()) >= 5)} "
                 f"the CPU at {' / '.join(f'{r:,}' for r in lite_rates)} RPS (its added p50 {behind} s there)")
    added = []
    for r in rates:
        at = yg[f"{r}rps"]
        p50, p99 = at["added_p50_ms"], at["added_p99_ms"]
        best = {q: min((t[n][f"{r}rps"][f"added_{q}_ms"] for n in routers), default=None) for q in ("p50", "p99")}
        peer = f" (best Rust router +{best['p50']:.2f} / +{best['p99']:.2f})" if routers else ""
        added.append(f"{bold(f'+{p50:.2f}', p50 <= 1)} / {bold(f'+{p99:.2f}', p99 <= 5)} ms at {r:,} RPS{peer}")
    streams = yg.get("streams_1000", {})
    return (f"{head}; added p50 / p99 {', '.join(added)}; "
            f"{streams.get('requests', 0) // 3:,} concurrent streams, {failed(streams.get('errors', 0), 'errors')}; "
            f"RSS {d['rss']['growth_pct']:+.1f}% from {d['rss']['requests'][0] // 1000}k to "
            f"{d['rss']['requests'][-1] // 1000}k requests")


def picker_overhead() -> str:
    a = load("picker_overhead")["added"]
    g, p = a["gateway"], a["picker"]
    failed = sum(m[f"{k}_failed"] for m in (g, p) for k in ("unary", "streams"))
    return (f"CPU per request {p['unary_cpu_us_per_request'] / 1000:.1f} vs {g['unary_cpu_us_per_request'] / 1000:.1f} ms "
            f"({p['unary_cpu_us_per_request'] / g['unary_cpu_us_per_request']:.1f}×); added p50 "
            f"+{p['unary_added_ms_p50']:.1f} vs +{g['unary_added_ms_p50']:.1f} ms, p99 +{p['unary_added_ms_p99']:.0f} vs "
            f"+{g['unary_added_ms_p99']:.0f} ms; streams +{p['streams_added_ms_p50']:.1f} vs "
            f"+{g['streams_added_ms_p50']:.1f} ms; {failed} failed ([picker.md](docs/picker.md))")


def tracing_overhead() -> str:
    d = load("tracing_overhead")
    sm = d["summary"]
    p99, cpu = sm["p99_ms"], sm["cpu_us_per_request"]
    rounds = p99["tracing_on"]["n"]
    added = f"{sm['added_p99_ms']:+.2f} ms"
    return (f"added p99 {bold(added, sm['added_p99_ms'] <= sm['goal_added_p99_ms'])} "
            f"(p99 {p99['tracing_on']['median']:.2f} vs {p99['tracing_off']['median']:.2f} ms, medians of {rounds} "
            f"interleaved rounds); gateway CPU per request {cpu['tracing_on']['median']:,.0f} vs "
            f"{cpu['tracing_off']['median']:,.0f} µs; a span {sm['micro']['span_us_per_request']:.0f} µs in-process, "
            "none made when off")


def gateway_workers() -> str:
    d = load("gateway_workers")
    sm = d["summary"]
    rps, p99 = sm["max_sustained_rps"], sm["p99_ms_at_max"]
    ratio = f"{sm['ratio']:.2f}×"
    return (f"{bold(ratio, sm['met'])} ({rps['2_workers']['median']:,.0f} vs "
            f"{rps['1_worker']['median']:,.0f} RPS, medians of {rps['1_worker']['n']} interleaved rounds; p99 at that "
            f"rate {p99['2_workers']['median']:,.0f} vs {p99['1_worker']['median']:,.0f} ms)")


def many_models_overhead() -> str:
    sm = load("many_models_overhead")["summary"]
    x = lambda v: f"{v:.2f}×"  # noqa: E731

    def mr(key: str) -> str:
        r = sm[key]
        return median_range([r["min"], r["median"], r["max"]], x)

    cpu, idle = sm["cpu_us_per_request"], sm["idle_cpu_ms_per_s"]
    us = lambda key: f"{cpu[key]['median']:,.0f}"  # noqa: E731
    return (f"{bold(mr('ten_over_one_first'), sm['met']['first'])} with every request to the first model, "
            f"{bold(mr('ten_over_one_spread'), sm['met']['spread'])} spread over the ten ({us('ten_first')} / "
            f"{us('ten_spread')} vs {us('one')} µs at {sm['rate_rps']:,.0f} RPS; idle {idle['ten']['median']:.0f} vs "
            f"{idle['one']['median']:.0f} ms CPU/s); same-config control {mr('control_over_one')}; "
            f"{failed(sm['failed'])} (medians of {sm['ten_over_one_first']['n']} interleaved rounds)")


def auto_decision() -> str:
    sm = load("auto_decision")["summary"]
    us = lambda key: median_range([sm[key]["min"], sm[key]["median"], sm[key]["max"]], lambda v: f"{v:.2f} µs")  # noqa: E731
    return (f"choose {bold(us('choose_cpu_us'), sm['goal_met'])} CPU; a graded outcome (re-decides its class) "
            f"{us('observe_cpu_us')} ({sm['choose_cpu_us']['n']} runs, 10 targets × 20 task classes)")


def multihost() -> str:
    d = load("multihost")
    if "runs" not in d:  # one run, without its re-sent connections
        dr, t = d["drills"], d["totals"]
        kill = dr["sigkill"]
        others = t["failed"] - kill["failed"]
        return (f"{t['requests']:,} requests over 4 drills (1 run): {kill['failed']} failed, in flight on the "
                f"SIGKILLed gateway; {failed(others)} elsewhere; connections refused and re-sent: not recorded; "
                f"new engine in traffic {dr['dns']['admit_s']:.1f} s after its DNS record, removed one gone after "
                f"{dr['dns']['leave_s']:.1f} s; SIGTERM drain {dr['sigterm']['drain_s']:.1f} s; ledger reconciled")
    sm, runs = d["summary"], d["runs"]
    others = max(sum(x["failed"] for n, x in r["drills"].items() if n != "sigkill") for r in runs)
    s = lambda v: f"{v:.1f}"  # noqa: E731
    whole = lambda v: f"{v:,.0f}"  # noqa: E731

    def mr(key: str, fmt: Callable[[float], str]) -> str:
        return median_range([sm[key]["min"], sm[key]["median"], sm[key]["max"]], fmt)

    return (f"{mr('requests', whole)} requests over 4 drills per run ({len(runs)} runs): {mr('sigkill_failed', whole)} "
            f"failed, in flight on the SIGKILLed gateway; {failed(others)} elsewhere; {mr('refused_and_resent', whole)} "
            f"refused connections re-sent to the other gateway (failures avoided, counted apart); new engine in "
            f"traffic {mr('dns_admit_s', s)} s after its DNS record, removed one gone after {mr('dns_leave_s', s)} s; "
            f"SIGTERM drain {mr('sigterm_drain_s', s)} s; ledger reconciled")


def adapter_routing_sim() -> str:
    rows = load("adapter_routing_sim")["summary"]

    def loads(regime: str, policy: str) -> str:
        return span([r["loads_per_1k"] for r in rows if r["regime"] == regime and r["policy"] == policy],
                    lambda v: f"{v:.0f}")

    oracle = [r["ratio_to_oracle"] for r in rows if r["regime"] == "fleet" and r["policy"] == "adapter_aware"]
    return (f"adapter loads per 1,000 requests: adapter_aware {loads('fleet', 'adapter_aware')} vs cache_aware "
            f"{loads('fleet', 'cache_aware')} vs round robin {loads('fleet', 'round_robin')}; cached tokens "
            f"{span(oracle, pct)} of oracle; 2 × 8 × 2 (demo engines): {loads('demo', 'adapter_aware')} vs "
            f"{loads('demo', 'cache_aware')} vs {loads('demo', 'round_robin')}")


def adapter_routing_real() -> str:
    d = load("adapter_routing_real")
    names = ["adapter_aware", "cache_aware", "round_robin"]
    by = {r["policy"]: r for r in d["summary"]}
    twin = {r["policy"]: r for r in d["sim_twin"]}

    def each(rows: dict, key: str, fmt: Callable[[float], str]) -> str:
        return " / ".join(fmt(rows[p][key]) for p in names)

    loads = [by[p]["loads_per_1k"] for p in names]
    failed = sum(r["failed"] for r in d["summary"])
    requests = sum(r["requests"] for r in d["summary"])
    whole = lambda v: f"{v:.0f}"  # noqa: E731
    return (f"adapter loads per 1,000 requests (adapter_aware / cache_aware / round robin) "
            f"{bold(each(by, 'loads_per_1k', whole), loads[0] <= min(loads))} (simulator, same requests: "
            f"{each(twin, 'loads_per_1k', whole)}); TTFT p90 {each(by, 'ttft_p90_ms', whole)} ms; cached tokens "
            f"{each(by, 'cached_ratio', pct)}; {bold(f'{failed} failed', failed == 0)} of {requests:,}")


def agent_routing() -> str:
    rows = load("agent_routing")["summary"]
    ca = [r for r in rows if r["policy"] == "cache_aware"]
    rr = [r["ratio_to_oracle"] for r in rows if r["policy"] == "round_robin"]
    names = {"chat": "chat", "responses": "Responses", "messages": "Messages"}
    apis = [a for a in names if any(r["api"] == a for r in ca)]
    each = ", ".join(f"{span([r['ratio_to_oracle'] for r in ca if r['api'] == a], pct)} ({names[a]})" for a in apis)
    # TTFT p90 minus round robin's, pooled over the rounds: "not worse" while its 90% interval
    # reaches zero or below.
    diffs = [r["ttft_p90_vs_round_robin"] for r in ca if "ttft_p90_vs_round_robin" in r]
    ttft = (f"{min(d['diff_ms'] for d in diffs):+.0f} to {max(d['diff_ms'] for d in diffs):+.0f}".replace("-", "−")
            if diffs else "not measured")
    loads = "/".join(str(c) for c in sorted({r["concurrency"] for r in ca}))
    balance = [r["load_max_over_mean"] for r in ca]
    return (f"cache_aware {bold(each, min(r['ratio_to_oracle'] for r in ca) >= 0.95)} vs round robin {span(rr, pct)}; "
            f"TTFT p90 − round robin {bold(ttft + ' ms', all(d['ci90_ms'][0] <= 0 for d in diffs))}; max/mean load "
            f"{bold(span(balance, lambda v: f'{v:.2f}'), max(balance) <= 1.25)} ({loads} sessions, "
            f"{ca[0]['rounds']} rounds, 90% intervals)")


def agent_compat() -> str:
    cells = load("agent_compat")["cells"]
    same = sum(1 for c in cells if c["gateway"]["ok"] == c["engine"]["ok"] and c["gateway"]["status"] == c["engine"]["status"])
    return (f"{bold(f'{same}/{len(cells)}', same == len(cells))} cells answer through the gateway as straight "
            "to the engine ([table](docs/agents.md#compatibility-matrix))")


def fuzz() -> str:
    c = counts("fuzz")
    fivexx = sum(n for status, n in c["by_status"].items() if status.startswith("5"))
    field = c["field_by_field"]
    mutated = sum(field.values())
    deep = field.get("answered", 0) + field.get("semantic_4xx", 0)
    return (f"{c['cases']:,} cases over every route, {failed(fivexx, 'responses 5xx')}; of {mutated} valid keyed "
            f"bodies changed one field at a time, {bold(pct(deep / mutated, 0), deep >= mutated / 2)} answered "
            f"({field.get('answered', 0)} × 200) or refused past validation ({field.get('semantic_4xx', 0)} × 4xx)")


def engine_crash() -> str:
    d = load("engine_crash")
    if "runs" not in d:  # one run of unary requests, without the gateway's re-sends
        back = " / ".join(f"{c['admitted_s']:.0f} s ({c['tier']})" for c in d["crashes"])
        other = sum(c["served_by_other_tier"] for c in d["crashes"])
        return (f"{d['requests']:,} unary requests (1 run), {failed(d['failed'])}; the gateway's re-sends: not "
                f"recorded; the other tier served {other:,} meanwhile, labelled; restarted, weights restored, "
                f"back in {back}")
    runs, sm = d["runs"], d["summary"]
    whole = lambda v: f"{v:,.0f}"  # noqa: E731

    def mr(key: str, fmt: Callable[[float], str] = whole) -> str:
        return median_range([sm[key]["min"], sm[key]["median"], sm[key]["max"]], fmt)

    other = [sum(c["served_by_other_tier"] for c in r["crashes"]) for r in runs]
    return (f"{mr('requests')} requests per run ({len(runs)} runs, {runs[0]['streams']:,} streamed), "
            f"{bold(mr('failed') + ' failed', sm['failed']['max'] == 0)}, {mr('streams_cut')} streams cut; "
            f"{mr('gateway_resent')} re-sent by the gateway to another replica (failures avoided, counted apart); "
            f"the other tier served {median_range(other, whole)} meanwhile, labelled; restarted, weights restored, "
            f"back in {mr('admitted_s_standard')} s (standard) / {mr('admitted_s_fast')} s (fast)")


def counts(name: str) -> dict[str, int]:
    """What an asserting test measured (tests/conftest.py record_counts)."""
    return load(name)["counts"]


def of(done: int, total: int, thousands: bool = True) -> str:
    """"done/total", bold unless every one."""
    return bold(f"{done:,}/{total:,}" if thousands else f"{done}/{total}", done == total)


def failed(n: int, unit: str = "failed") -> str:
    return bold(f"{n} {unit}", n == 0)


def tokenizer_parity() -> str:
    c = counts("tokenizer_parity")
    return f"{of(c['identical'], c['prompts'])} prompts identical (asserted)"


def smollm2_parity() -> str:
    c = counts("tokenizer_parity_smollm2")
    return (f"{of(c['identical'], c['prompts'])} prompts, chats and agent requests identical "
            f"({c['agent_requests']} agent requests) (asserted)")


def smollm2_tool_calls() -> str:
    c = counts("tool_calls_smollm2")
    n = c["requests"]
    return (f"calls that parse: tool_choice auto {c['auto_parsed']}/{n}, required {c['required_parsed']}/{n} "
            f"(the right tool {c['required_right_tool']}/{n}); greedy")


def agent_parity() -> str:
    c = counts("agent_corpus")
    return f"{of(c['identical'], c['requests'])} requests identical to vLLM's `/tokenize` (asserted)"


def chaos_faults() -> str:
    c = counts("chaos_faults")
    return (f"{c['in_flight_at_kill']} in flight at the kill; unary {failed(c['unary_failed'])} of {c['unary']:,}; "
            f"{c['streams_cut_with_error_event']} of {c['streams']:,} streams cut with an error event, their "
            f"relayed tokens billed; re-sent by the gateway (failures avoided, counted apart): "
            f"{c.get('gateway_retries_on_another_replica', 'not recorded')} to another replica, "
            f"{c['gateway_resends_after_closed_keepalive']} after a closed kept-alive connection (asserted)")


def chaos_redis() -> str:
    c = counts("chaos_redis")
    return (f"{c['requests']:,} requests ({c['answered_during_outage']} during the outage, "
            f"{c['keyed_during_outage']} keyed), {failed(c['failed'] + c['errors'])}; "
            f"{c['ledger_matches_clients']:,} ledger rows match the clients' costs (asserted)")


def batch_lane() -> str:
    d = load("batch_lane")
    sm, x = d["summary"], (lambda v: f"{v:.2f}×")  # noqa: E731

    def ratio(target: str) -> str:
        r = sm[f"{target}_over_alone_ttft_p99"]
        return median_range([r["min"], r["median"], r["max"]], x)

    lanes = sm["lanes_over_alone_ttft_p99"]["median"]
    return (f"interactive TTFT p99 with a batch job running / alone: lanes {bold(ratio('lanes'), lanes <= 1.5)}, "
            f"no priority or admission {ratio('naive')}; batch lines/s meanwhile "
            f"{sm['batch_lines_per_s']['lanes']['median']:.1f} vs {sm['batch_lines_per_s']['naive']['median']:.1f}; "
            f"{failed(sm['failed'])} ({sm['lanes_over_alone_ttft_p99']['n']} interleaved runs, one engine)")


def ledger_postgres() -> str:
    d = load("ledger_postgres")
    runs = d["runs"]
    rates, sizes = [r["rows_per_s"] for r in runs], [r["bytes_per_row"] for r in runs]
    lost, doubled = sum(r["lost"] for r in runs), sum(r["doubled"] for r in runs)
    return (f"{bold(median_range(rates, lambda v: f'{v:,.0f}') + ' rows/s', statistics.median(rates) >= 10_000)} "
            f"from {runs[0]['writers']} gateway ledger writers; "
            f"{bold(median_range(sizes, lambda v: f'{v:.0f}') + ' bytes a row on disk', max(sizes) <= 400)}; "
            f"{failed(lost, 'lost')}, {failed(doubled, 'doubled')} ({len(runs)} runs)")


def posttrain_loop() -> str:
    d = load("posttrain_loop")
    runs, met = d["runs"], d["goals"]["per_run"]

    def per(v: float | None) -> str:
        return "–" if v is None else f"${v:.2g}"

    def rate(r: dict) -> str:
        low, high = r["eval_interval90"]
        return f"{pct(r['eval_success'], 0)} [{pct(low, 0)}–{pct(high, 0)}]"

    shown = []
    for run, goal in zip(runs, met):
        base, final = run["rounds"][0], run["rounds"][-1]
        minutes = span(run["round_minutes"], lambda v: f"{v:.0f}") if run["round_minutes"] else "–"
        shown.append(f"{bold(rate(base) + ' → ' + rate(final), goal['success_goal'])} held-out, "
                     f"{bold(per(base['usd_per_solved']) + ' → ' + per(final['usd_per_solved']) + ' per solved', goal['usd_goal'])}, "
                     f"{len(run['rounds']) - 1} rounds ({run['promotions']} promoted, {run['rollbacks']} rolled back), "
                     f"{bold('rounds ' + minutes + ' min', goal['round_goal'])}")
    tasks = runs[0]["rounds"][0]["eval_tasks"]
    return "; ".join(shown) + f" ({len(runs)} run{'s' if len(runs) != 1 else ''}, {tasks} held-out tasks)"


def chaos_gateway() -> str:
    c = counts("chaos_gateway")
    return f"{of(c['in_ledger_once'], c['answered'])} acknowledged requests in the ledger, once (asserted)"


# -- the benchmarks, in README order --------------------------------------------------------------

BENCHMARKS = [
    Benchmark("tokenizer_parity", "tokenizer parity with vLLM `/tokenize`", "100%",
              "`scripts/dev test -k tokenizer_parity`", tokenizer_parity, files=["tokenizer_parity"],
              **suite("test_cache_tokenizer_parity.py")),
    Benchmark("tokenizer_parity_smollm2", "tokenizer parity with vLLM `/tokenize`, SmolLM2 (digit split, 21 bytes missing from its vocabulary)",
              "100%", "`scripts/dev test -k real_model`", smollm2_parity, files=["tokenizer_parity_smollm2"],
              **suite("test_real_model.py")),
    Benchmark("tool_calls_smollm2", "tool calls of SmolLM2 through the gateway (8 requests that need a tool)",
              "— (reported)", "`scripts/dev test -k real_model`", smollm2_tool_calls, files=["tool_calls_smollm2"],
              **suite("test_real_model.py")),
    Benchmark("tokenizer_speed", "tokenizer speed vs HF tokenizers", "≥ 3×",
              "`python benchmarks/tokenizer_speed.py`", tokenizer_speed,
              run=["benchmarks/tokenizer_speed.py", "--repeat", "5"],
              quick=["benchmarks/tokenizer_speed.py", "--repeat", "1", "--out", str(SCRATCH / "tokenizer_speed.json")],
              files=["tokenizer_speed"]),
    Benchmark("routing", "routing, 2 real engines: cached tokens / oracle",
              "≥ 95% and ≥ the Rust routers'; TTFT never worse; ≤ 1.25",
              "`python benchmarks/routing.py` ([command](docs/benchmarks.md#routing))", routing_real,
              run=["benchmarks/routing.py", "--no-sim", "--tenants", "6", "--shared-requests", "360", "--loads", "1,2,4,6",
                   "--agent-requests", "120", "--rounds", "6", "--cold-phases", "--policies",
                   "round_robin,cache_aware,cache_aware+overlap_weight=1,vllm-router:cache_aware,smg:cache_aware",
                   "--fast-kv", "ipc://{home}/run/kv-events-standard-1.sock", "--out", "benchmarks/results/routing"],
              quick=["benchmarks/routing.py", "--no-sim", "--quick", "--tenants", "6", "--cold-phases",
                     "--policies", "round_robin,cache_aware", "--fast-kv",
                     "ipc://{home}/run/kv-events-standard-1.sock", "--out", str(SCRATCH / "routing")],
              stack="examples/routing-fleet-kv192.toml", files=["routing"]),
    Benchmark("routing_sim", "routing, simulated 64 replicas", "≥ 95%",
              "`python benchmarks/routing.py --no-real`", routing_sim,
              run=["benchmarks/routing.py", "--policies",
                   "round_robin,least_loaded,session,cache_aware,cache_aware+overlap_weight=1,cache_aware+overlap_weight=2",
                   "--out", "benchmarks/results/routing-kv1gib"],
              quick=["benchmarks/routing.py", "--no-real", "--quick", "--out", str(SCRATCH / "routing-sim")],
              stack="examples/routing-fleet.toml", files=["routing-kv1gib"]),
    Benchmark("routing_zipf", "routing, simulated 64 replicas, 1,000 Zipf tenants", "≥ 95%; ≤ 1.25",
              "`python benchmarks/routing.py --zipf 1.0` ([command](docs/benchmarks.md#routing))", routing_zipf,
              run=["benchmarks/routing.py", "--zipf", "1.0", "--sim-tenants", "1000", "--sim-kv-blocks", "512",
                   "--sim-requests", "6000", "--sim-seeds", "3", "--rates", "100,200,400", "--policies",
                   ("round_robin,least_loaded,consistent_hash,cache_aware,cache_aware_evict,cache_aware+overlap_weight=2,"
                    "cache_aware+share_keep_tail_blocks=16"),
                   "--out", "benchmarks/results/routing-zipf64"],
              quick=["benchmarks/routing.py", "--zipf", "1.0", "--sim-requests", "1500", "--rates", "200",
                     "--policies", "round_robin,consistent_hash,cache_aware",
                     "--out", str(SCRATCH / "routing-zipf64")],
              files=["routing-zipf64"]),
    Benchmark("emulated_fleet", "routing, 32 emulated engines: yieldgate vs smg vs vllm-router",
              "≥ 95% and ≥ the Rust routers' at every load; TTFT p90 and max/mean load no worse",
              "`python benchmarks/emulated_fleet.py` ([emulation](docs/emulated-fleet.md))", emulated_fleet,
              run=["benchmarks/emulated_fleet.py"],
              quick=["benchmarks/emulated_fleet.py", "--quick", "--out", str(SCRATCH / "emulated_fleet")],
              files=["emulated_fleet"]),
    Benchmark("adapter_routing_sim", "LoRA adapter routing, simulated 64 replicas × 300 adapters × 4 slots",
              "fewest loads", "`python benchmarks/adapter_routing.py --sim`", adapter_routing_sim,
              run=["benchmarks/adapter_routing.py", "--sim"],
              quick=["benchmarks/adapter_routing.py", "--sim", "--quick", "--out", str(SCRATCH / "adapter_routing_sim")],
              files=["adapter_routing_sim"]),
    Benchmark("adapter_routing_real", "LoRA adapter routing, 2 real engines × 8 adapters × 2 slots",
              "fewest loads; 0 failed",
              "`python benchmarks/adapter_routing.py --real --rounds 4` ([command](docs/benchmarks.md#adapter-routing-real-engines))",
              adapter_routing_real, run=["benchmarks/adapter_routing.py", "--real", "--rounds", "4"],
              quick=["benchmarks/adapter_routing.py", "--real", "--rounds", "1", "--requests", "40", "--warmup", "8",
                     "--out", str(SCRATCH / "adapter_routing_real")],
              stack="examples/adapter-routing-fleet.toml", files=["adapter_routing_real"]),
    Benchmark("loadtest_vs_vllm_bench", "load tester vs `vllm bench serve`", "within 10%",
              "`python benchmarks/loadtest_vs_vllm_bench.py`", loadtest_vs_vllm,
              files=["loadtest_vs_vllm_bench"]),
    Benchmark("loadtest_overhead", "load tester's own cost", "—",
              "`python benchmarks/loadtest_overhead.py`", loadtest_overhead,
              run=["benchmarks/loadtest_overhead.py", "--requests", "20000", "--concurrency", "64"],
              files=["loadtest_overhead"]),
    Benchmark("fast_vs_standard", "fast tier vs standard, output tok/s per request",
              "≥ 2× on greedy code edits, ≥ 1× on every class",
              "`python benchmarks/run_all.py --only fast_vs_standard` ([command](docs/benchmarks.md#fast-tier))",
              fast_vs_standard,
              run=["benchmarks/fast_vs_standard.py", "--requests", "5", "--concurrency", "1",
                   "--gateway", "http://127.0.0.1:8000"], stack="examples/fast-tier.toml",
              files=["fast_vs_standard"]),
    Benchmark("weight_push", "weight push, 386 MB model into one engine", "≥ 80%",
              "`python benchmarks/weight_push.py`", weight_push,
              run=["benchmarks/weight_push.py", "--hidden", "1024", "--layers", "8"], files=["weight_push"]),
    Benchmark("rollout", "weight rollout under load, time to 100% new / raw transfer", "< 2×; 0 failed",
              "`python benchmarks/rollout.py --up [--big]`", rollout,
              run=["benchmarks/rollout.py", "--up"], files=["rollout", "rollout-big"]),
    Benchmark("adapter_push",
              "LoRA adapter push under load vs full-weight push of the same base model",
              "0 failed; none mislabelled", "`python benchmarks/adapter_push.py`", adapter_push,
              run=["benchmarks/adapter_push.py"],
              quick=["benchmarks/adapter_push.py", "--rounds", "1", "--out", str(SCRATCH / "adapter_push")],
              files=["adapter_push"]),
    Benchmark("engine_hops", "engine round trip while the other engine serves", "—",
              "`python benchmarks/engine_hops.py`", engine_hops, run=["benchmarks/engine_hops.py"],
              files=["engine_hops"]),
    Benchmark("engine_polling", "launched engine's poll loop: 50 µs pause vs vLLM's yield loop, demo engine",
              "—", "`python benchmarks/engine_polling.py` ([why](docs/deployment.md#engines-beside-the-gateway))",
              engine_polling, run=["benchmarks/engine_polling.py"], files=["engine_polling"]),
    Benchmark("gateway_overhead", "gateway overhead, all features on, vs vllm-router, smg and LiteLLM, fake upstream",
              "CPU ≤ the fastest Rust router's; LiteLLM ≥ 5×; p50 ≤ 1 ms, p99 ≤ 5 ms at each rate; 0 errors; < 5%",
              "`python benchmarks/gateway_overhead.py`", gateway_overhead, run=["benchmarks/gateway_overhead.py"],
              quick=["benchmarks/gateway_overhead.py", "--quick", "--skip-litellm", "--skip-rss",
                     "--out", str(SCRATCH / "gateway_overhead")],
              files=["gateway_overhead"]),
    Benchmark("picker_overhead", "endpoint picker: Envoy + `yieldgate picker` vs the gateway proxying, fake upstream, 100 RPS",
              "—", "`python benchmarks/picker_overhead.py`", picker_overhead,
              run=["benchmarks/picker_overhead.py"],
              quick=["benchmarks/picker_overhead.py", "--quick", "--out", str(SCRATCH / "picker_overhead.json")],
              files=["picker_overhead"]),
    Benchmark("tracing_overhead", "OpenTelemetry traces on (every request sampled, OTLP to a receiver) vs off, "
              "fake upstream (rate in the result's setup)", "≤ +0.3 ms p99", "`python benchmarks/tracing_overhead.py`", tracing_overhead,
              run=["benchmarks/tracing_overhead.py"],
              quick=["benchmarks/tracing_overhead.py", "--quick", "--out", str(SCRATCH / "tracing_overhead.json")],
              files=["tracing_overhead"]),
    Benchmark("gateway_workers", "2 gateway workers (`server.workers`) vs 1: max sustained RPS, fake upstream",
              "≥ 1.7×", "`python benchmarks/gateway_workers.py`", gateway_workers,
              run=["benchmarks/gateway_workers.py"],
              quick=["benchmarks/gateway_workers.py", "--quick", "--out", str(SCRATCH / "gateway_workers.json")],
              files=["gateway_workers"]),
    Benchmark("many_models_overhead", "gateway CPU per request, 10 models configured vs 1, fake upstream",
              "≤ 1.05×", "`python benchmarks/many_models_overhead.py` ([method](docs/benchmarks.md#many-models))",
              many_models_overhead, run=["benchmarks/many_models_overhead.py"],
              quick=["benchmarks/many_models_overhead.py", "--quick", "--out", str(SCRATCH / "many_models_overhead.json")],
              files=["many_models_overhead"]),
    Benchmark("agent_corpus", "tokenizer parity with the engine, agent chats (tools, calls, results, developer, part arrays)",
              "100%", "`scripts/dev test -k agent_corpus`", agent_parity, files=["agent_corpus"],
              **suite("test_cache_tokenizer_parity.py")),
    Benchmark("agent_routing", "agent with tools (multi-turn, tool calls and results), 2 real engines: cached tokens / oracle",
              "≥ 95%; TTFT never worse; ≤ 1.25", "`python benchmarks/agent_routing.py` ([command](docs/benchmarks.md#agents))",
              agent_routing, run=["benchmarks/agent_routing.py", "--requests", "100", "--rounds", "3"],
              quick=["benchmarks/agent_routing.py", "--requests", "40", "--rounds", "1", "--concurrency", "4", "--out", str(SCRATCH / "agent_routing.json")],
              stack="examples/routing-fleet.toml", files=["agent_routing"]),
    Benchmark("agent_compat", "agent compatibility (route × stream × tools × tier)", "all",
              "`scripts/dev test -k agent_compat`", agent_compat, files=["agent_compat"],
              **suite("test_agent_compat.py")),
    Benchmark("fuzz", "fuzzing (schemathesis + hypothesis + valid bodies mutated field by field)", "0 5xx; ≥ 50%", "`scripts/dev test -k fuzz`", fuzz,
              files=["fuzz"], **suite("test_fuzz_gateway.py")),
    Benchmark("chaos_faults", "engine SIGKILL under load", "0 unary failed", "`scripts/dev test -k chaos_faults`",
              chaos_faults, files=["chaos_faults"], **suite("test_chaos_faults.py")),
    Benchmark("multihost", "separate hosts on loopback: 2 gateways, 2 engines, Redis, DNS; drills under load",
              "0 failed outside the killed gateway; 0 lost", "`python benchmarks/multihost.py`", multihost,
              run=["benchmarks/multihost.py", "--engines", "http://127.0.2.1:8101,http://127.0.2.2:8102"],
              stack="examples/multihost.toml", files=["multihost"]),
    Benchmark("engine_crash", "engine SIGKILL, one per tier, 4 clients per tier", "0 failed",
              "`python benchmarks/engine_crash.py`", engine_crash, run=["benchmarks/engine_crash.py"],
              files=["engine_crash"]),
    Benchmark("chaos_redis", "Redis stopped 30 s under load", "0 failed, exact", "`scripts/dev test -k chaos_gateway`",
              chaos_redis, files=["chaos_redis"], **suite("test_chaos_gateway.py")),
    Benchmark("chaos_gateway", "gateway SIGKILLed and restarted", "0 lost", "`scripts/dev test -k chaos_gateway`",
              chaos_gateway, files=["chaos_gateway"], **suite("test_chaos_gateway.py")),
    Benchmark("batch_lane", "batch lane behind interactive traffic (llm-d Batch Gateway: 14× TTFT p99)",
              "≤ 1.5×; 0 failed", "`python benchmarks/batch_lane.py` ([lanes](docs/batch.md))", batch_lane,
              run=["benchmarks/batch_lane.py"], files=["batch_lane"]),
    Benchmark("ledger_postgres", "ledger into one PostgreSQL (LiteLLM: 6.3 KB a spend row)",
              "≥ 10,000 rows/s; ≤ 400 B a row; 0 lost, 0 doubled", "`python benchmarks/ledger_postgres.py`",
              ledger_postgres, run=["benchmarks/ledger_postgres.py"], files=["ledger_postgres"]),
    Benchmark("auto_decision", "`model: \"auto\"`: CPU per routing decision, 10 targets × 20 task classes",
              "≤ 200 µs", "`python benchmarks/auto_decision.py`", auto_decision,
              run=["benchmarks/auto_decision.py"], files=["auto_decision"]),
    Benchmark("posttrain_loop", "post-training loop on graded traffic, SmolLM2 (held-out success, 90% interval; $ per solved task)",
              "≥ 2× the base's success (+30 points above 30%) and ≤ 0.5× its $ per solved, at the 90% bounds, in ≤ 3 rounds; a round ≤ 10 min",
              "`python benchmarks/posttrain_loop.py`", posttrain_loop, run=["benchmarks/posttrain_loop.py"],
              files=["posttrain_loop"]),
]


HEADER = "| benchmark | today | goal | code measured | reproduce |"


def measured(b: Benchmark) -> str:
    """The commit each of the row's results measured, and whether that code is still today's."""
    described = []
    for name in b.files:
        try:
            meta = load(name)["meta"]
        except OSError:
            continue
        described.append((name, harness.freshness(meta).describe()))
    if len({text for _, text in described}) == 1:
        return described[0][1]
    return "; ".join(f"{name}: {text}" for name, text in described) or "—"


def figure(b: Benchmark) -> str:
    missing = [name for name in b.files if not (RESULTS / f"{name}.json").is_file()]
    if missing:
        how = "`python benchmarks/run_all.py --only " + b.name + "`"
        return f"**no result recorded** ({how} records {', '.join(f'{m}.json' for m in missing)})"
    try:
        return b.figure()
    except (KeyError, ValueError, TypeError) as exc:  # a result file of another shape
        return f"(no result: {type(exc).__name__} {exc})"


def table() -> str:
    lines = [HEADER, "|---|---|---|---|---|"]
    for b in BENCHMARKS:
        lines.append(f"| {b.row} | {figure(b)} | {b.goal} | {measured(b)} | {b.reproduce} |")
    return "\n".join(lines)


def readme_table(readme: Path = ROOT / "README.md") -> str:
    lines = readme.read_text().splitlines()
    start = lines.index(HEADER)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


def check(readme: Path = ROOT / "README.md") -> list[str]:
    """Why the README's results may not be trusted as they stand; empty when they may. Stale results
    are allowed while the table says so (a re-run needs a quiet machine, see docs/benchmarks.md);
    a table that hides it, or a result whose meta is not the harness's, is not."""
    problems = []
    for b in BENCHMARKS:
        if not b.files:
            problems.append(f"{b.name}: no result file (every row is computed from one)")
        for name in b.files:
            path = RESULTS / f"{name}.json"
            if path.is_file():
                meta = load(name).get("meta", {})
                problems += [f"{name}.json: {p}" for p in harness.meta_problems(meta)]
                for key in ("commit", "recorded_in"):
                    if meta.get(key, harness.NOT_RECORDED) != harness.NOT_RECORDED and not harness.in_history(meta[key]):
                        problems.append(f"{name}.json: {key} {meta[key][:7]} is not in HEAD's history")
    try:
        shown = readme_table(readme)
    except ValueError:
        return [*problems, f"{readme.name} has no results table (header {HEADER!r})"]
    if shown != table():
        problems.append(f"{readme.name}'s results table differs from `python benchmarks/run_all.py --table` "
                        "(a result changed, or its code did since it was measured): paste that output")
    return problems


def stale() -> list[tuple[str, str]]:
    """(row, why) for each row without a result, or some of whose code changed since it was measured."""
    out = []
    for b in BENCHMARKS:
        there = [n for n in b.files if (RESULTS / f"{n}.json").is_file()]
        if len(there) < len(b.files):
            out.append((b.name, "no result recorded"))
        elif any(not harness.freshness(load(n)["meta"]).current for n in there):
            out.append((b.name, measured(b)))
    return out


# -- running --------------------------------------------------------------------------------------

def run(benchmarks: list[Benchmark], quick: bool) -> list[tuple[str, str, float]]:
    outcomes = []
    for i, b in enumerate(benchmarks, 1):
        argv = b.quick if quick else b.run
        print(f"[{i}/{len(benchmarks)}] {b.name}: {' '.join(argv) if argv else 'not run by this script'}", flush=True)
        if argv is None:
            outcomes.append((b.name, "skipped", 0.0))
            continue
        started = time.monotonic()
        env = {**os.environ, **b.env}
        if b.stack is not None:
            with stack(b.stack) as home:
                env["YIELDGATE_HOME"] = str(home)  # the stack's sockets (KV events) and model
                rc = subprocess.call([PY, *(a.format(home=home) for a in argv)], cwd=ROOT, env=env)
        else:
            rc = subprocess.call([PY, *argv], cwd=ROOT, env=env)
        outcomes.append((b.name, "ok" if rc == 0 else f"exit {rc}", time.monotonic() - started))
    return outcomes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", action="store_true", help="only print the results table")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and their commands")
    ap.add_argument("--quick", action="store_true", help="smaller runs, written under " + str(SCRATCH))
    ap.add_argument("--only", default="", help="comma-separated benchmark names")
    ap.add_argument("--check", action="store_true",
                    help="fail unless README's table is this one and every result's meta is complete; list stale rows")
    ap.add_argument("--strict", action="store_true", help="with --check: fail on a stale row too")
    ap.add_argument("--readme", action="store_true", help="write the table into README.md in place of its own")
    args = ap.parse_args()
    if args.readme:
        readme = ROOT / "README.md"
        readme.write_text(readme.read_text().replace(readme_table(readme), table()))
        return
    if args.check:
        problems = check()
        old = stale()
        for name, why in old:
            print(f"stale: {name}: {why}")
        for p in problems:
            print(f"problem: {p}")
        print(f"{len(BENCHMARKS)} rows, {len(old)} stale (marked so in the table), {len(problems)} problems")
        raise SystemExit(1 if problems or (args.strict and old) else 0)
    chosen = BENCHMARKS
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {b.name for b in BENCHMARKS}
        if unknown:
            raise SystemExit(f"unknown benchmarks {sorted(unknown)}; see --list")
        chosen = [b for b in BENCHMARKS if b.name in names]
    if args.list:
        for b in chosen:
            cmd = " ".join(b.run) if b.run else f"see {b.reproduce}"
            up = "" if b.stack is None else f"yieldgate up {'-c ' + b.stack if b.stack else ''}; "
            print(f"{b.name:24} {up}{cmd}")
        return
    if not args.table:
        SCRATCH.mkdir(parents=True, exist_ok=True)
        for name, outcome, seconds in run(chosen, args.quick):
            print(f"  {name:24} {outcome:10} {seconds:7.0f} s")
        if args.quick:
            print(f"quick results are in {SCRATCH}; the table below reads the canonical ones")
    print(table())


if __name__ == "__main__":
    main()
