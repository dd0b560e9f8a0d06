"""Adapter-aware routing vs adapter-blind policies with more LoRA adapters than slots.

    python benchmarks/adapter_routing.py --sim            # both regimes; results/adapter_routing_sim.json, .png
    python benchmarks/adapter_routing.py --sim --quick    # fewer requests and seeds (smoke run)
    python benchmarks/adapter_routing.py --real --up examples/adapter-routing-fleet.toml
                                                          # 2 real engines; results/adapter_routing_real.json, .png

Simulated (cache/simulator.py: the gateway's own Router, scorers and prefix index on modelled
engines), in two regimes, each over `--seeds` seeds:

(a) fleet: 64 replicas x 300 adapters x 4 slots (max_loras), 100 tenants with 3 fine-tunes each,
    adapter popularity Zipf(1), one-turn requests at Poisson rates (`--rates`), the simulator's
    GPU engine model with 1,024 KV blocks per replica.
(b) demo: 2 replicas x 8 adapters x 2 slots, the CPU demo engines' model (benchmarks/routing.py
    DEMO_ENGINE) and the demo fleet's `fleet.lora.max_loras`, closed-loop concurrency 4.

Policies: round_robin, least_loaded, cache_aware (adapter-blind: as in the gateway, a request
goes to the replicas that hold its adapter; held nowhere, it is loaded where a slot is free, else
where the least loaded replica unloads its least recently used one; and once every holder is
busy, it is loaded in the background into a free slot elsewhere) and adapter_aware (cache_aware
+ adapter_affinity, weighing every replica while the adapter is on fewer than all), plus adapter_aware with
each adapter_affinity weight of `--weights` (the tuning of the preset's weight). Per policy:
cached-token ratio, ratio to the oracle, TTFT p50/p90, adapter loads and unloads per 1,000
requests, max/mean requests per replica; means over seeds.

Load times: the demo regime's are the demo engine's measured medians (benchmarks/lora_load.py,
results/lora_load.json: a load and an unload of a rank-8 adapter, HTTP call included). The fleet
regime's load takes `--lora-load-s` (0.1 s, unloads free): an assumption for a GPU engine, which
this machine cannot measure; the relative figures hold from 0.05 to 0.2 s (docs/benchmarks.md).

Real (`--real`): the demo regime on two demo engines with LoRA on (2 slots of rank 8 each;
examples/adapter-routing-fleet.toml, started by `--up` or already up under $YIELDGATE_HOME). Per
policy (round_robin, cache_aware, adapter_aware) and round, a gateway process of its own whose
`standard` tier has both engines as replicas, on engines with no adapter loaded and empty prefix
caches; eight seeded random rank-8 adapters (serving/peft.py `random_adapter`) registered through
its admin API with placement `{"replicas": 2}`; then the `adapters` workload (the demo regime's,
seeded per round) through it at closed-loop concurrency 4: `--warmup` requests, then `--requests`
measured. Loads and unloads are counted from the engines' own logs (vLLM logs each one) during
the measured requests; cached tokens from each response's usage. Every adapter is removed before
the gateway stops. Policies take turns, in reverse order every other round. The same requests go
through the simulator's demo regime (the twin; its warm-up a phase of its own, left out of its
figures as of the real ones), next to the committed simulated figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from fleet_rig import (DEMO_ENGINE, WORDS_PER_TOKEN, clear_bench_index, result_meta,  # noqa: E402
                     two_replica_config)

MEASURES = ["gateway/", "cache/", "serving/", "pricing/", "loadtest/", "benchmarks/adapter_routing.py",
            "benchmarks/fleet_rig.py"]

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


def demo_regime(requests: int) -> Regime:
    """2 replicas x 8 adapters x 2 slots, closed-loop concurrency 4: the demo stack's shape."""
    load_s, unload_s = demo_lora_times()
    demo_engine = msgspec.structs.replace(DEMO_ENGINE, max_loras=2, lora_load_s=load_s, lora_unload_s=unload_s)
    return Regime(name="demo", replicas=2, adapters=8, tenants=4, max_loras=2, engine=demo_engine, prefix_tokens=600,
                  requests=requests, loads=[4], arrival="concurrency")


def regimes(quick: bool, rates: list[float], lora_load_s: float) -> list[Regime]:
    fleet_engine = EngineModel(kv_capacity_blocks=1024, max_loras=4, lora_load_s=lora_load_s)
    return [
        Regime(name="fleet", replicas=64, adapters=300, tenants=100, max_loras=4, engine=fleet_engine,
               prefix_tokens=1000, requests=1500 if quick else 4000, loads=rates),
        demo_regime(150 if quick else 400),
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


# -- real engines ----------------------------------------------------------------------------------

REAL_POLICIES = ["round_robin", "cache_aware", "adapter_aware"]
REAL_METRICS = ["cached_ratio", "ttft_p50_ms", "ttft_p90_ms", "loads_per_1k", "unloads_per_1k", "load_max_over_mean",
                "throughput_rps"]
ADMIN_TOKEN = "adapter-routing-bench"
# What a demo engine logs for each load and unload (vLLM's serving_models, INFO level).
LOADED = re.compile(r"Loaded new LoRA adapter: name '(adapter-\d+@[^']+)'")
REMOVED = re.compile(r"Removed LoRA adapter: name '(adapter-\d+@[^']+)'")


class RealSetup(msgspec.Struct, kw_only=True):
    """One real run: every policy in every round, on the same two engines."""

    engines: list[str]
    kv_events: list[str]
    engine_logs: list[str]
    redis_url: str
    policies: list[str]
    rounds: int
    requests: int                 # measured per policy and round
    warmup: int                   # sent first under the same policy, not measured
    concurrency: int
    placement_replicas: int       # each adapter's `placement: {"replicas": N}`
    seed: int


def _http(method: str, url: str, body: dict | None = None, token: str = "", timeout: float = 120) -> Any:
    import urllib.request

    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode())
    req.add_header("content-type", "application/json")
    if token:
        req.add_header("authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode()
    try:
        return json.loads(text)
    except ValueError:
        return text


def engine_adapters(url: str) -> list[str]:
    """The LoRA adapters an engine holds (its /v1/models cards with a parent)."""
    return [m["id"] for m in _http("GET", url + "/v1/models")["data"] if m.get("parent")]


def fresh_engines(urls: list[str]) -> None:
    """Every phase starts alike: no adapter loaded, empty prefix caches."""
    for url in urls:
        for name in engine_adapters(url):
            _http("POST", url + "/v1/unload_lora_adapter", {"lora_name": name})
        _http("POST", url + "/reset_prefix_cache")


def clear_bench_state(redis_url: str) -> None:
    """The benchmark gateways' adapter registry and prefix index in their Redis DB."""
    import redis

    clear_bench_index(redis_url)
    r = redis.Redis.from_url(redis_url)
    try:
        keys = list(r.scan_iter(match="yg:adapters:demo:*"))
        if keys:
            r.delete(*keys)
    finally:
        r.close()


def write_adapters(model_dir: Path, root: Path, count: int) -> dict[str, Path]:
    """adapter-0 ... adapter-{count-1}: seeded random rank-8 PEFT adapters of the demo model, named
    as AdapterWorkload names them."""
    from yieldgate.serving.peft import random_adapter

    return {f"adapter-{k}": random_adapter(model_dir, root / f"adapter-{k}", seed=100 + k) for k in range(count)}


def log_marks(paths: list[Path]) -> list[int]:
    return [p.stat().st_size if p.exists() else 0 for p in paths]


def logged_since(paths: list[Path], marks: list[int]) -> str:
    """What the log files got since `marks`."""
    text = []
    for path, mark in zip(paths, marks):
        with open(path, "rb") as f:
            f.seek(mark)
            text.append(f.read().decode(errors="replace"))
    return "\n".join(text)


async def _drive(url: str, policy: str, workload: AdapterWorkload, setup: RealSetup, seed: int,
                 logs: list[Path]) -> tuple[list[Any], float, str]:
    """Warm-up, then the measured requests; what `logs` got during the latter."""
    from yieldgate.loadtest import Bounds, ConcurrencyLoad, Runner, Target

    load = ConcurrencyLoad(concurrency=setup.concurrency)
    async with Runner(Target(base_url=url, model="demo", name=policy), workload, seed=seed) as runner:
        if setup.warmup:
            await runner.run_phase(load, Bounds(requests=setup.warmup, timeout_s=120))
        marks = log_marks(logs)
        _, records, duration = await runner.run_phase(load, Bounds(requests=setup.requests, timeout_s=120))
        await asyncio.sleep(0.5)  # a load or unload begun by the last requests reaches the log
        return records, duration, logged_since(logs, marks)


def real_phase(policy: str, round_: int, setup: RealSetup, files: dict[str, Path], model_path: str,
               workdir: Path) -> dict:
    """One policy's phase: a gateway of its own on fresh engines, the adapters registered through
    its admin API, then the `adapters` workload; every adapter removed before the gateway stops."""
    from yieldgate.gateway.embedded import GatewayProcess
    from yieldgate.loadtest.stats import percentile

    seed = setup.seed + round_
    fresh_engines(setup.engines)
    clear_bench_state(setup.redis_url)
    tag = f"a{round_}{setup.policies.index(policy)}-"
    config = two_replica_config(policy, list(zip(setup.engines, setup.kv_events)), model_path,
                                redis_url=setup.redis_url, tag=tag, data_dir=str(workdir / f"{tag}data"))
    config.server.admin_token = ADMIN_TOKEN
    gw = GatewayProcess(config, workdir)
    try:
        time.sleep(1.5)  # first health check and scrape; KV-event subscribers connect
        for name, path in files.items():
            _http("POST", gw.url + "/admin/adapters", {"name": name, "version": "v1", "path": str(path),
                                                      "placement": {"replicas": setup.placement_replicas}},
                  token=ADMIN_TOKEN)
        workload = demo_regime(setup.requests).workload(seed)
        logs = [Path(p) for p in setup.engine_logs] + [gw.log_path]
        records, duration, logged = asyncio.run(_drive(gw.url, policy, workload, setup, seed, logs))
        loads, unloads = len(LOADED.findall(logged)), len(REMOVED.findall(logged))
        residency = {a["name"]: a["replicas"] for a in _http("GET", gw.url + "/admin/adapters",
                                                            token=ADMIN_TOKEN)["data"]}
        for name in files:
            _http("DELETE", gw.url + f"/admin/adapters/{name}", token=ADMIN_TOKEN)
        deadline = time.monotonic() + 20
        while any(engine_adapters(u) for u in setup.engines) and time.monotonic() < deadline:
            time.sleep(0.5)  # removed adapters are unloaded once idle
    finally:
        gw.stop()
        clear_bench_state(setup.redis_url)
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    ttft = sorted(r.ttft_ms for r in ok if r.ttft_ms is not None)
    counts: dict[str, int] = {}
    for r in ok:
        counts[r.replica or "?"] = counts.get(r.replica or "?", 0) + 1
    mean = len(ok) / len(setup.engines)
    n = max(1, len(records))
    row = {"policy": policy, "round": round_, "seed": seed, "requests": len(records), "failed": len(failed),
           "errors": sorted({f"{r.status} {r.error}: {(r.error_detail or '')[:160]}" for r in failed}),
           "prompt_tokens": prompt, "cached_tokens": cached, "cached_ratio": cached / prompt if prompt else 0.0,
           "ttft_p50_ms": percentile(ttft, 50), "ttft_p90_ms": percentile(ttft, 90),
           "loads": loads, "unloads": unloads, "loads_per_1k": 1000 * loads / n, "unloads_per_1k": 1000 * unloads / n,
           # The gateway's own account of the same window: unloads to empty a slot, and loads
           # that found every slot of every replica held by an adapter in use (a 503).
           "gateway_lru_unloads": logged.count("(least recently used; its slot is needed)"),
           "gateway_no_free_slot": sum("hold adapters that are in use" in line for line in logged.splitlines()),
           "requests_per_replica": counts,
           "load_max_over_mean": max(counts.values()) / mean if counts and mean else 1.0,
           "throughput_rps": len(records) / duration if duration else 0.0, "residency_at_end": residency,
           "ttft_ms": [round(t, 1) for t in ttft]}
    print(f"  round {round_} {policy:<14} {len(records)} requests, {len(failed)} failed, cached "
          f"{row['cached_ratio']:.1%}, ttft p50/p90 {row['ttft_p50_ms']:.0f}/{row['ttft_p90_ms']:.0f} ms, loads/unloads "
          f"{loads}/{unloads} ({row['loads_per_1k']:.0f}/{row['unloads_per_1k']:.0f} per 1k), replicas {counts}",
          file=sys.stderr, flush=True)
    return row


def pool_rounds(rows: list[dict], policies: list[str]) -> list[dict]:
    """Per policy over its rounds: token and event sums, TTFT percentiles of every request."""
    from yieldgate.loadtest.stats import percentile

    out = []
    for policy in policies:
        rs = [r for r in rows if r["policy"] == policy]
        n = sum(r["requests"] for r in rs)
        prompt, cached = sum(r["prompt_tokens"] for r in rs), sum(r["cached_tokens"] for r in rs)
        ttft = sorted(t for r in rs for t in r["ttft_ms"])
        counts: dict[str, int] = {}
        for r in rs:
            for k, v in r["requests_per_replica"].items():
                counts[k[-1]] = counts.get(k[-1], 0) + v  # per engine: the names end in its index
        mean = sum(counts.values()) / max(1, len(counts))
        out.append({"policy": policy, "rounds": len(rs), "requests": n, "failed": sum(r["failed"] for r in rs),
                    "cached_ratio": cached / prompt if prompt else 0.0,
                    "ttft_p50_ms": percentile(ttft, 50), "ttft_p90_ms": percentile(ttft, 90),
                    "loads_per_1k": 1000 * sum(r["loads"] for r in rs) / max(1, n),
                    "unloads_per_1k": 1000 * sum(r["unloads"] for r in rs) / max(1, n),
                    "load_max_over_mean": max(counts.values()) / mean if counts and mean else 1.0,
                    "throughput_rps": statistics.mean(r["throughput_rps"] for r in rs)})
    return out


def sim_twin(policies: list[str], setup: RealSetup, tokenizer: Any) -> list[dict]:
    """The same requests (seed per round) in the simulator's demo regime: the warm-up as a phase
    of its own, left out of the figures as the real run leaves it out."""
    regime = demo_regime(setup.warmup + setup.requests)
    prompts = PromptBuilder(tokenizer)

    def config(policy: str, seed: int) -> SimConfig:
        cfg = regime.config(policy, setup.concurrency, seed)
        if setup.warmup:
            cfg.phases, cfg.warmup_phases = [setup.warmup, setup.requests], 1
        return cfg

    out = []
    for policy in policies:
        rs = [run_simulation(regime.workload(setup.seed + k), config(policy, setup.seed + k), prompts=prompts)
              for k in range(setup.rounds)]
        out.append({"policy": policy, "seeds": len(rs),
                    **{m: statistics.mean(getattr(r, m) for r in rs) for m in METRICS}})
    return out


def sim_reference(policies: list[str]) -> list[dict]:
    """The committed simulated result's demo rows (2 x 8 x 2, 400 requests, 3 seeds)."""
    try:
        rows = json.loads((RESULTS / "adapter_routing_sim.json").read_text())["summary"]
    except (OSError, KeyError, ValueError):
        return []
    return [r for r in rows if r["regime"] == "demo" and r["policy"] in policies]


def real_table(summary: list[dict], twin: list[dict], reference: list[dict]) -> str:
    twin_by = {t["policy"]: t for t in twin}
    ref_by = {t["policy"]: t for t in reference}
    lines = [f"{'policy':<15}{'requests':>9}{'failed':>7}{'cached':>8}{'ttft p50':>10}{'ttft p90':>10}"
             f"{'loads/1k':>10}{'unloads/1k':>11}{'max/mean':>9}   sim twin: cached, p90, loads/1k"
             f"   sim 400x3: loads/1k"]
    for s in summary:
        t, ref = twin_by.get(s["policy"]), ref_by.get(s["policy"])
        twin_cell = (f"{t['cached_ratio']:>7.1%} {t['ttft_p90_s'] * 1000:>6.0f}ms {t['loads_per_1k']:>5.0f}"
                     if t else "")
        lines.append(f"{s['policy']:<15}{s['requests']:>9}{s['failed']:>7}{s['cached_ratio']:>8.1%}"
                     f"{s['ttft_p50_ms']:>8.0f}ms{s['ttft_p90_ms']:>8.0f}ms{s['loads_per_1k']:>10.0f}"
                     f"{s['unloads_per_1k']:>11.0f}{s['load_max_over_mean']:>9.2f}   {twin_cell:<26}"
                     f"   {ref['loads_per_1k'] if ref else float('nan'):>5.0f}")
    return "\n".join(lines)


def plot_real(summary: list[dict], twin: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("cached_ratio", "cached tokens / prompt tokens (%)", 100, 100),
              ("ttft_p90_ms", "TTFT p90 (ms)", 1, None), ("loads_per_1k", "adapter loads per 1,000 requests", 1, 1)]
    policies = [s["policy"] for s in summary]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.2))
    for ax, (key, label, scale, twin_scale) in zip(axes, panels):
        xs = range(len(policies))
        ax.bar([x - 0.2 for x in xs], [s[key] * scale for s in summary], 0.4, label="2 real engines")
        sim_key, sim_scale = ("ttft_p90_s", 1000) if key == "ttft_p90_ms" else (key, twin_scale)
        ax.bar([x + 0.2 for x in xs], [next(t[sim_key] for t in twin if t["policy"] == p) * sim_scale
                                       for p in policies], 0.4, label="simulator, same requests")
        ax.set_xticks(list(xs), policies, fontsize=8)
        ax.set_title(f"2 engines x 8 adapters x 2 slots: {label}", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@contextmanager
def stack_home(config: str) -> Iterator[Path]:
    """`yieldgate up -c config` for the run (benchmarks/stack_up.py's `stack`), or the stack already
    up under $YIELDGATE_HOME when config is ""; yields its home (engine logs, KV-event sockets)."""
    if not config:
        from yieldgate.serving.paths import home_dir

        yield home_dir()
        return
    from stack_up import stack  # benchmarks/stack_up.py

    with stack(config) as home:
        yield home


def main_real(args: argparse.Namespace, argv: list[str]) -> None:
    import tempfile

    from yieldgate.serving.demo_model import ensure_demo_model

    policies = [p for p in args.policies.split(",") if p]
    model_path = ensure_demo_model()
    workdir = Path(tempfile.mkdtemp(prefix="yg-adapter-routing-"))
    files = write_adapters(model_path, workdir / "adapters", 8)
    rows: list[dict] = []
    with stack_home(args.up) as home:
        setup = RealSetup(engines=args.engines.split(","),
                          kv_events=[f"ipc://{home}/run/kv-events-standard-{i}.sock" for i in range(2)],
                          engine_logs=[str(home / "logs" / f"standard-{i}.log") for i in range(2)],
                          redis_url=args.redis_url, policies=policies, rounds=args.rounds,
                          requests=args.requests, warmup=args.warmup, concurrency=args.concurrency,
                          placement_replicas=args.placement_replicas, seed=args.seed)
        started = time.monotonic()
        for round_ in range(setup.rounds):
            spent = time.monotonic() - started
            if round_ and args.budget_min and spent * (round_ + 1) / round_ > 60 * args.budget_min:
                print(f"  stopping after {round_} rounds: another would pass --budget-min {args.budget_min:g}",
                      file=sys.stderr, flush=True)
                break
            # Policies take turns, in reverse order every other round: drift of the shared
            # machine falls on each alike.
            for policy in (policies if round_ % 2 == 0 else policies[::-1]):
                rows.append(real_phase(policy, round_, setup, files, str(model_path), workdir))
        setup.rounds = len(rows) // len(policies)
    summary = pool_rounds(rows, policies)
    twin = sim_twin(policies, setup, demo_tokenizer(str(model_path)))
    reference = sim_reference(policies)
    print(real_table(summary, twin, reference))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    load = (f"2 real demo engines ({args.up or 'already up'}) x 8 adapters (4 tenants) x 2 slots, placement "
            f"replicas {setup.placement_replicas}, closed-loop concurrency {setup.concurrency}, "
            f"{setup.warmup} warm-up + {setup.requests} measured requests per policy and round, {setup.rounds} rounds")
    doc = {"meta": result_meta("python benchmarks/adapter_routing.py " + " ".join(argv), load, MEASURES),
           "setup": msgspec.to_builtins(setup), "regime": msgspec.to_builtins(demo_regime(setup.requests)),
           "counted_from": "engine logs: vLLM's 'Loaded new LoRA adapter' / 'Removed LoRA adapter' lines "
                           "during the measured requests",
           "summary": summary, "sim_twin": twin, "sim_reference": reference, "runs": rows}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    plot_real(summary, twin, out.with_suffix(".png"))
    print(f"wrote {out}.json/.png")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim", action="store_true", help="the simulated regimes")
    ap.add_argument("--real", action="store_true", help="2 real demo engines through the gateway")
    ap.add_argument("--quick", action="store_true", help="fewer requests and one seed")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rates", default="100,200", help="fleet regime: Poisson sessions/s")
    ap.add_argument("--lora-load-s", type=float, default=0.1, help="fleet regime: seconds one adapter load takes")
    ap.add_argument("--weights", default="8,16,32,128",
                    help=f"adapter_affinity weights tried besides the preset's ({ADAPTER_AFFINITY_WEIGHT:g})")
    ap.add_argument("--up", default="", metavar="CONFIG",
                    help="real: start `yieldgate up -c CONFIG` for the run and stop it afterwards")
    ap.add_argument("--engines", default="http://127.0.0.1:8101,http://127.0.0.1:8102", help="real: the two engines")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/11",
                    help="real: the benchmark gateways' Redis DB (its yg:adapters:demo:* keys are deleted)")
    ap.add_argument("--policies", default=",".join(REAL_POLICIES), help="real: tier policies compared")
    ap.add_argument("--rounds", type=int, default=2, help="real: every policy runs once per round")
    ap.add_argument("--requests", type=int, default=100, help="real: measured requests per policy and round")
    ap.add_argument("--warmup", type=int, default=16, help="real: requests before each measured phase")
    ap.add_argument("--concurrency", type=int, default=4, help="real: closed-loop concurrency")
    ap.add_argument("--placement-replicas", type=int, default=2, help='real: each adapter\'s placement {"replicas": N}')
    ap.add_argument("--seed", type=int, default=0, help="real: workload seed of the first round (+1 per round)")
    ap.add_argument("--budget-min", type=float, default=0.0,
                    help="real: start no round that would take the run's phases past this many minutes (0: no limit)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.sim == args.real:
        ap.error("choose --sim (the simulated regimes) or --real (2 real engines)")
    if args.real:
        args.out = args.out or str(RESULTS / "adapter_routing_real")
        return main_real(args, argv)
    args.out = args.out or str(RESULTS / "adapter_routing_sim")
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
    doc = {"meta": result_meta("python benchmarks/adapter_routing.py " + " ".join(argv), load, MEASURES),
           "preset_weight": ADAPTER_AFFINITY_WEIGHT,
           "regimes": [msgspec.to_builtins(r) for r in regs], "summary": summary, "runs": rows}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(summary, regs, POLICIES, out.with_suffix(".png"))
    print(f"wrote {out}.json/.png")


if __name__ == "__main__":
    main()
