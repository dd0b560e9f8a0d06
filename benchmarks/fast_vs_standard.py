"""Fast tier (vLLM + ngram speculative decoding) vs standard tier, per-request decode speed.

Workload classes: input-grounded code editing, greedy and sampled (the answer copies the prompt,
where n-gram drafts can be accepted), plain chat (random text, little to copy) and multi-turn agent
sessions (sampled). Same seeded requests for both tiers, interleaved, fixed output length
(ignore_eos) so both generate the same tokens. Spec-decode acceptance comes from the fast engine's
/metrics.

    python benchmarks/fast_vs_standard.py [--standard URL] [--fast URL] [--gateway URL]

With --gateway, the tiers are reached through the gateway as models MODEL and "MODEL:fast": the
tier as sold, its routing included (run_all.py runs it so, on examples/fast-tier.toml). Without,
each engine is asked directly. A third target, the standard tier again under another name, runs
interleaved with both: its ratio to the standard tier is the harness's own bias (1× but for it),
reported beside every speedup and divided out of the corrected one. Every row says which replica
served each target's requests (x-yieldgate-replica). `--runs` (default 3) whole comparisons, every
one kept: benchmarks/results/fast_vs_standard.json (benchmarks/harness.py's format) and .png.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import harness  # benchmarks/harness.py, beside this script

from yieldgate.loadtest import (
    AgentSessionWorkload,
    Bounds,
    CodeEditWorkload,
    ConcurrencyLoad,
    RandomLengthWorkload,
    Target,
    run_compare,
)

SPEC_TOKENS = 8  # num_speculative_tokens of the demo fast tier (serving/config.py)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def ratio_ci90(fast: list[float], standard: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """90% bootstrap interval of p50(fast) / p50(standard), each sample resampled on its own. Where
    both tiers run on the same engine (the speculation filter's plain replica) the ratio is 1 but
    for noise; the interval says how far one run's noise reaches."""
    import random

    from yieldgate.loadtest.stats import percentile

    rng = random.Random(seed)
    ratios = sorted(percentile(rng.choices(fast, k=len(fast)), 50)
                    / percentile(rng.choices(standard, k=len(standard)), 50) for _ in range(resamples))
    return [percentile(ratios, 5), percentile(ratios, 95)]


def needed_for_2x(row: dict, k: int) -> dict:
    """What acceptance the fast tier would need for 2x, from this run's own step costs: a fast-tier
    step (verify k drafts) costs tpot_fast * tokens_per_step; a standard step emits one token."""
    tpot_std = row["standard"]["tpot_ms_p50"]
    tpot_fast = row["fast"]["tpot_ms_p50"]
    per_step = row["fast"].get("spec_mean_accepted_length") or 1.0
    if not tpot_std or not tpot_fast or tpot_std < 0.1 or tpot_fast < 0.1:  # burst-streamed: no step cost
        return {}
    step_fast = tpot_fast * per_step
    need = 2.0 * step_fast / tpot_std  # tokens per fast step for 2x the standard tier's decode speed
    lo, hi = 0.0, 1.0
    for _ in range(50):  # E[tokens/step] = (1 - a^(k+1)) / (1 - a), increasing in a
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(k + 1)) < need else (lo, mid)
    return {"fast_step_ms": step_fast, "tokens_per_step_needed_for_2x": need,
            "acceptance_needed_for_2x": lo if need <= k + 1 else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--standard", default="http://127.0.0.1:8101")
    ap.add_argument("--fast", default="http://127.0.0.1:8102")
    ap.add_argument("--gateway", default=None)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--concurrency", default="1,4", help="comma-separated closed-loop concurrencies")
    ap.add_argument("--model", default="smollm2", help="the served model's name (the tiny model's: demo)")
    ap.add_argument("--synthetic-code", action="store_true",
                    help="code edits on synthetic arithmetic (the random tiny model) instead of readable functions")
    ap.add_argument("--words-per-token", type=float, default=0.7)  # SmolLM2 on English; the tiny model 0.44
    ap.add_argument("--runs", type=int, default=harness.DEFAULT_RUNS, help="whole comparisons, every one kept")
    a = ap.parse_args()
    rec = harness.Recording("fast_vs_standard", MEASURES)
    runs = [{"round": i, **compare(a)} for i in range(a.runs)]
    names = list(runs[0]["workloads"])
    summary = {name: {key: harness.summarize(r["workloads"][name].get(key) for r in runs)
                      for key in ("speedup_e2e_output_tps_p50", "control_e2e_output_tps_p50",
                                  "speedup_e2e_output_tps_p50_corrected")}
               | {"served_by": {t: dict(sum((Counter(r["workloads"][name]["served_by"][t]) for r in runs), Counter()))
                                for t in runs[0]["workloads"][name]["served_by"]}}
               for name in names}
    rec.write(runs=runs, summary=summary, setup=runs[0]["setup"]["note"])
    plot(runs[-1], harness.RESULTS / "fast_vs_standard.png")


# What decides the ratio: the engines' launch (speculation settings, dtype), the fast tier's routing
# (the speculation filter and its plain tier) and the client that measures. The rest of the gateway's
# request path is the same code on both sides of the ratio (and on the control's).
MEASURES = ["serving/config.py", "serving/launcher.py", "serving/smollm2.py", "cache/policies.py", "cache/scorers.py",
            "gateway/routing.py", "loadtest/", "benchmarks/fast_vs_standard.py"]


def compare(a: argparse.Namespace) -> dict:
    """One comparison: every workload class at every concurrency, standard / fast / standard again."""
    def targets(extra: dict) -> tuple[Target, Target, Target]:
        std_url, fast_url = (a.gateway, a.gateway) if a.gateway else (a.standard, a.fast)
        fast_model = f"{a.model}:fast" if a.gateway else a.model
        return (Target(base_url=std_url, model=a.model, name="standard", ignore_eos=True, extra_body=extra),
                Target(base_url=fast_url, model=fast_model, name="fast", ignore_eos=True, extra_body=extra),
                Target(base_url=std_url, model=a.model, name="control", ignore_eos=True, extra_body=extra))

    code = CodeEditWorkload(functions=4, lines_per_function=5, words_per_token=a.words_per_token,
                            natural=not a.synthetic_code)
    # (workload, sampling): default sampling (temperature 1) and greedy, as code edits are usually run.
    workloads = {
        "code_edit": (code, {}),
        "code_edit_greedy": (code, {"temperature": 0.0}),
        "chat": (RandomLengthWorkload(input_tokens=256, output_tokens=128, words_per_token=a.words_per_token), {}),
        "agent": (AgentSessionWorkload(output_tokens=128, words_per_token=a.words_per_token), {}),
    }
    concurrencies = [int(c) for c in str(a.concurrency).split(",")]
    std, fast, _ = targets({})
    out: dict = {"setup": {"standard": std.base_url, "fast": fast.base_url, "requests": a.requests,
                           "concurrency": a.concurrency, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "model": a.model, "code": "synthetic" if a.synthetic_code else "natural",
                           "note": "ignore_eos: both tiers generate max_tokens, past the model's end of answer. "
                                   "TPOT of an engine that streams tokens in bursts (chunks merged while its "
                                   "API process is busy) is tiny; compare tokens per e2e second too."},
                 "workloads": {}}
    for conc, (name, (wl, extra)) in ((c, w) for c in concurrencies for w in workloads.items()):
        if conc != concurrencies[0]:
            name = f"{name}@c{conc}"
        std, fast, control = targets(extra)
        # Six short alternating phases per target: a busy neighbour on the shared cores then
        # weighs on every target alike, not on whichever phase it happened to overlap.
        results = run_compare([std, fast, control], wl, ConcurrencyLoad(concurrency=conc),
                              Bounds(requests=a.requests, warmup_requests=1), order="interleaved",
                              rounds=6, cache_salt="auto",
                              engine_metrics_urls=[a.fast])
        row = {}
        for r in results:
            s = r.summary
            row[r.target] = {
                "completed": s.completed, "failed": s.failed,
                "output_tps_per_request_p50": s.output_tps_per_request.p(50),
                "output_tps_per_request_mean": s.output_tps_per_request.mean,
                "e2e_output_tps_per_request_p50": s.e2e_output_tps_per_request.p(50),
                "tpot_ms_p50": s.tpot_ms.p(50), "tpot_ms_mean": s.tpot_ms.mean,
                "ttft_ms_p50": s.ttft_ms.p(50), "e2e_ms_p50": s.e2e_ms.p(50),
                "output_token_throughput": s.output_token_throughput,
                "mean_completion_tokens": s.completion_tokens / max(1, s.completed),
                "mean_prompt_tokens": s.prompt_tokens / max(1, s.completed),
            }
        # The fast engine's counters were scraped in the fast target's phases only; the standard
        # phases scrape it too but it sees no traffic then, so the sums are the fast tier's.
        fast_engine = results[1].summary.engine or {}
        row["fast"]["spec_acceptance_rate"] = fast_engine.get("spec_acceptance_rate")
        row["fast"]["spec_mean_accepted_length"] = fast_engine.get("spec_mean_accepted_length")
        counters = fast_engine.get("counters") or {}
        # Through the gateway, a fast request the speculation filter sends to a plain replica is
        # not served by the fast engine: its requests here are the ones that speculated.
        row["fast"]["fast_engine_requests"] = counters.get("vllm:request_success_total", 0.0)
        row["fast"]["spec_drafts"] = counters.get("vllm:spec_decode_num_drafts_total", 0.0)
        # An engine whose API process is busy streams a whole answer in one burst: TPOT (first to
        # last token) is then ~0 and its ratios say nothing; the e2e-based speedup stays sound.
        row["speedup_output_tps_p50"] = _ratio(row["fast"]["output_tps_per_request_p50"],
                                               row["standard"]["output_tps_per_request_p50"])
        row["speedup_e2e_output_tps_p50"] = _ratio(row["fast"]["e2e_output_tps_per_request_p50"],
                                                   row["standard"]["e2e_output_tps_per_request_p50"])
        per_request = {r.target: [x.e2e_output_tps for x in r.records
                                  if x.ok and not x.warmup and x.e2e_output_tps] for r in results}
        row["speedup_e2e_output_tps_ci90"] = ratio_ci90(per_request["fast"], per_request["standard"])
        # The same engine against itself: what the harness alone makes of "1×".
        row["control_e2e_output_tps_p50"] = _ratio(row["control"]["e2e_output_tps_per_request_p50"],
                                                   row["standard"]["e2e_output_tps_per_request_p50"])
        row["control_e2e_output_tps_ci90"] = ratio_ci90(per_request["control"], per_request["standard"])
        row["speedup_e2e_output_tps_p50_corrected"] = _ratio(row["speedup_e2e_output_tps_p50"],
                                                             row["control_e2e_output_tps_p50"])
        row["served_by"] = {r.target: dict(Counter(x.replica or "unknown" for x in r.records if x.ok and not x.warmup))
                            for r in results}
        row["tpot_ratio_p50"] = _ratio(row["fast"]["tpot_ms_p50"], row["standard"]["tpot_ms_p50"])
        row.update(needed_for_2x(row, SPEC_TOKENS))
        out["workloads"][name] = row
        print(name, json.dumps(row, indent=1), flush=True)
    return out


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["workloads"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(names)), 4.2))
    xs = range(len(names))
    for off, tier in ((-0.2, "standard"), (0.2, "fast")):
        a1.bar([x + off for x in xs], [out["workloads"][n][tier]["e2e_output_tps_per_request_p50"] for n in names],
               width=0.4, label=tier)
        a2.bar([x + off for x in xs], [out["workloads"][n][tier]["tpot_ms_p50"] for n in names], width=0.4,
               label=tier)
    for ax, title in ((a1, "output tokens / e2e s per request (p50)"), (a2, "TPOT p50 (ms)")):
        ax.set_xticks(list(xs), [n.replace("@", "\n") for n in names], rotation=20, fontsize=8)
        ax.set_title(title)
        ax.legend()
    for i, n in enumerate(names):
        acc = out["workloads"][n]["fast"].get("spec_acceptance_rate")
        if acc is not None:
            a1.annotate(f"accept {acc:.0%}", (i + 0.2, 0), ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
