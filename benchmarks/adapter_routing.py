"""Adapter-aware routing vs adapter-blind policies with more LoRA adapters than slots.

    python benchmarks/adapter_routing.py --sim            # both regimes; results/adapter_routing_sim.json, .png
    python benchmarks/adapter_routing.py --sim --quick    # fewer requests and seeds (smoke run)

The simulated half (cache/simulator.py: the gateway's own Router, scorers and prefix index on
modelled engines), in two regimes, each over `--seeds` seeds:

(a) fleet: 64 replicas x 300 adapters x 4 slots (max_loras), 100 tenants with 3 fine-tunes each,
    adapter popularity Zipf(1), one-turn requests at Poisson rates (`--rates`), the simulator's
    GPU engine model with 1,024 KV blocks per replica.
(b) demo: 2 replicas x 8 adapters x 2 slots, the CPU demo engines' model (benchmarks/routing.py
    DEMO_ENGINE) and the demo fleet's `fleet.lora.max_loras`, closed-loop concurrency 4.

Policies: round_robin, least_loaded, cache_aware (adapter-blind: a replica loads whatever
adapter it is sent) and adapter_aware (cache_aware + adapter_affinity), plus adapter_aware with
each adapter_affinity weight of `--weights` (the tuning of the preset's weight). Per policy:
cached-token ratio, ratio to the oracle, TTFT p50/p90, adapter loads and unloads per 1,000
requests, max/mean requests per replica; means over seeds.

Load times: the demo regime's are the demo engine's measured medians (benchmarks/lora_load.py,
results/lora_load.json: a load and an unload of a rank-8 adapter, HTTP call included). The fleet
regime's load takes `--lora-load-s` (0.1 s, unloads free): an assumption for a GPU engine, which
this machine cannot measure; the relative figures hold from 0.05 to 0.2 s (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from routing import DEMO_ENGINE, WORDS_PER_TOKEN, result_meta  # noqa: E402

from yieldgate.cache import PipelineSpec, WeightedScorer, register_preset  # noqa: E402
from yieldgate.cache.policies import ADAPTER_AFFINITY_WEIGHT  # noqa: E402
from yieldgate.cache.simulator import EngineModel, PromptBuilder, SimConfig, run_simulation  # noqa: E402
from yieldgate.gateway.simulate import demo_tokenizer  # noqa: E402
from yieldgate.loadtest import AdapterWorkload  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
POLICIES = ["round_robin", "least_loaded", "cache_aware", "adapter_aware"]
METRICS = ["cached_ratio", "ratio_to_oracle", "ttft_p50_s", "ttft_p90_s", "loads_per_1k", "unloads_per_1k",
           "load_max_over_mean", "throughput_rps"]


class Regime(msgspec.Struct, kw_only=True):
    name: str
    replicas: int
    adapters: int
    tenants: int
    max_loras: int
    engine: EngineModel
    prefix_tokens: int
    requests: int
    loads: list[float]  # Poisson sessions/s, or closed-loop concurrency
    arrival: str = "poisson"

    def workload(self, seed: int) -> AdapterWorkload:
        return AdapterWorkload(seed=seed, adapters=self.adapters, tenants=self.tenants, adapter_zipf=1.0,
                               prefix_tokens=self.prefix_tokens, users_per_tenant=16, user_context_tokens=64,
                               suffix_tokens=64, output_tokens=64, words_per_token=WORDS_PER_TOKEN)

    def config(self, policy: str, load: float, seed: int) -> SimConfig:
        closed = self.arrival == "concurrency"
        return SimConfig(policy=policy, replicas=self.replicas, requests=self.requests, seed=seed,
                         session_ids=True, engine=self.engine, arrival=self.arrival,
                         rate=0.0 if closed else load, concurrency=int(load) if closed else 8)


def demo_lora_times() -> tuple[float, float]:
    """(load, unload) seconds on a demo engine: the medians benchmarks/lora_load.py measured."""
    summary = json.loads((RESULTS / "lora_load.json").read_text())["summary"]
    return summary["load_s"]["p50"], summary["unload_s"]["p50"]


def regimes(quick: bool, rates: list[float], lora_load_s: float) -> list[Regime]:
    fleet_engine = EngineModel(kv_capacity_blocks=1024, max_loras=4, lora_load_s=lora_load_s)
    load_s, unload_s = demo_lora_times()
    demo_engine = msgspec.structs.replace(DEMO_ENGINE, max_loras=2, lora_load_s=load_s, lora_unload_s=unload_s)
    return [
        Regime(name="fleet", replicas=64, adapters=300, tenants=100, max_loras=4, engine=fleet_engine,
               prefix_tokens=1000, requests=1500 if quick else 4000, loads=rates),
        Regime(name="demo", replicas=2, adapters=8, tenants=4, max_loras=2, engine=demo_engine, prefix_tokens=600,
               requests=150 if quick else 400, loads=[4], arrival="concurrency"),
    ]


def weighted_preset(weight: float) -> str:
    """adapter_aware with another adapter_affinity weight, registered under its own name."""
    name = f"adapter_aware@{weight:g}"
    register_preset(name, PipelineSpec(filters=["hotspot", "share"], scorers=[
        WeightedScorer("kv_cost"), WeightedScorer("adapter_affinity", weight)]))
    return name


def run(regs: list[Regime], policies: list[str], seeds: list[int], tokenizer: Any) -> list[dict]:
    prompts = PromptBuilder(tokenizer)
    rows = []
    for reg in regs:
        for load in reg.loads:
            for policy in policies:
                t = time.perf_counter()
                for seed in seeds:
                    r = run_simulation(reg.workload(seed), reg.config(policy, load, seed), prompts=prompts)
                    row = {k: v for k, v in msgspec.to_builtins(r).items() if k != "requests_per_replica"}
                    rows.append({"regime": reg.name, "load": load, "seed": seed, **row})
                print(f"  {reg.name} load={load:g} {policy} ({time.perf_counter() - t:.0f}s)", file=sys.stderr,
                      flush=True)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Mean over seeds per regime, load and policy."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["regime"], r["load"], r["policy"]), []).append(r)
    return [{"regime": reg, "load": load, "policy": policy, "seeds": len(rs),
             **{m: statistics.mean(r[m] for r in rs) for m in METRICS}}
            for (reg, load, policy), rs in groups.items()]


def table(summary: list[dict]) -> str:
    head = (f"{'regime':<7}{'load':>6} {'policy':<20}{'cached':>8}{'/oracle':>9}{'ttft p50':>10}{'ttft p90':>10}"
            f"{'loads/1k':>10}{'unloads/1k':>11}{'max/mean':>9}")
    lines = [head]
    for s in summary:
        lines.append(f"{s['regime']:<7}{s['load']:>6g} {s['policy']:<20}{s['cached_ratio']:>8.1%}"
                     f"{s['ratio_to_oracle']:>9.1%}{s['ttft_p50_s'] * 1000:>8.0f}ms{s['ttft_p90_s'] * 1000:>8.0f}ms"
                     f"{s['loads_per_1k']:>10.0f}{s['unloads_per_1k']:>11.0f}{s['load_max_over_mean']:>9.2f}")
    return "\n".join(lines)


def plot(summary: list[dict], regs: list[Regime], policies: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ratio_to_oracle", "cached / oracle (%)", 100), ("ttft_p90_s", "TTFT p90 (ms)", 1000),
              ("loads_per_1k", "adapter loads per 1,000 requests", 1)]
    fig, axes = plt.subplots(len(regs), len(panels), figsize=(17, 4.2 * len(regs)), squeeze=False)
    for i, reg in enumerate(regs):
        for ax, (key, label, scale) in zip(axes[i], panels):
            width = 0.8 / len(reg.loads)
            for j, load in enumerate(reg.loads):
                values = [next(s[key] for s in summary if s["regime"] == reg.name and s["load"] == load
                               and s["policy"] == p) * scale for p in policies]
                xs = [k + j * width for k in range(len(policies))]
                ax.bar(xs, values, width, label=f"{'conc' if reg.arrival == 'concurrency' else 'rate'} {load:g}")
            ax.set_xticks([k + 0.4 - width / 2 for k in range(len(policies))], policies, fontsize=7, rotation=15)
            ax.set_title(f"{reg.name}: {reg.replicas} replicas x {reg.adapters} adapters x {reg.max_loras} slots: "
                         f"{label}", fontsize=8)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim", action="store_true", help="the simulated regimes (the only half so far)")
    ap.add_argument("--quick", action="store_true", help="fewer requests and one seed")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rates", default="100,200", help="fleet regime: Poisson sessions/s")
    ap.add_argument("--lora-load-s", type=float, default=0.1, help="fleet regime: seconds one adapter load takes")
    ap.add_argument("--weights", default="8,16,32,128",
                    help=f"adapter_affinity weights tried besides the preset's ({ADAPTER_AFFINITY_WEIGHT:g})")
    ap.add_argument("--out", default=str(RESULTS / "adapter_routing_sim"))
    args = ap.parse_args(argv)
    if not args.sim:
        ap.error("only --sim is implemented: the simulated regimes")
    from yieldgate.serving.demo_model import ensure_demo_model

    seeds = list(range(1 if args.quick else args.seeds))
    regs = regimes(args.quick, [float(x) for x in args.rates.split(",")], args.lora_load_s)
    sweep = [weighted_preset(float(w)) for w in args.weights.split(",") if w]
    rows = run(regs, POLICIES + sweep, seeds, demo_tokenizer(str(ensure_demo_model())))
    summary = summarize(rows)
    print(table(summary))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    load = "; ".join(f"{r.name}: {r.replicas} replicas x {r.adapters} adapters ({r.tenants} tenants) x "
                     f"{r.max_loras} slots, {r.requests} requests per run, "
                     f"{'closed-loop concurrency' if r.arrival == 'concurrency' else 'Poisson sessions/s'} "
                     f"{','.join(f'{x:g}' for x in r.loads)}" for r in regs) + f"; seeds {seeds}"
    doc = {"meta": result_meta("python benchmarks/adapter_routing.py " + " ".join(argv), load),
           "preset_weight": ADAPTER_AFFINITY_WEIGHT,
           "regimes": [msgspec.to_builtins(r) for r in regs], "summary": summary, "runs": rows}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(summary, regs, POLICIES, out.with_suffix(".png"))
    print(f"wrote {out}.json/.png")


if __name__ == "__main__":
    main()
