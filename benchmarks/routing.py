"""Routing policies side by side: real 2-engine demo fleet through the gateway, and the simulator.

    yieldgate up -c examples/routing-fleet.toml  # two identical standard engines on 8101/8102
    python benchmarks/routing.py                 # real (engines 8101/8102) + simulated 64 replicas
    python benchmarks/routing.py --no-real       # simulator only
    python benchmarks/routing.py --quick         # fewer requests (smoke run)

(a) real: for each load and policy, a fresh gateway process whose `standard` tier has BOTH demo
engines as replicas (8101 with the KV events `yieldgate up` publishes on its IPC socket; 8102 without,
so the index learns it approximately), driven by the project's load tester (`loadtest.run_load`) with a fresh cache salt
per run. The same workload, salt and closed-loop concurrency go through the simulator with two
replicas (second one without KV events): that is the calibration (predicted vs measured cached
tokens). The oracle for a real run is the simulator's oracle on the same salted workload (the real
assistant answers of agent turns differ in words, not in length).
A policy `ROUTER:POLICY` (vllm-router:cache_aware, smg:cache_aware) puts that Rust router, the pinned
version proxy_rig.py installs in a venv of its own, in front of the same two engines in place
of a gateway, in the same interleaved rounds; it has no simulated twin (round robin's gives its oracle).
(b) simulated: 64 replicas, hundreds of tenants + agent sessions, Poisson rate sweep.

KV pressure (routing-kv192-t16.*): with vLLM's 1 GiB default each engine holds ~65k blocks of the tiny
demo model, every prefix fits everywhere and round robin finds ~93% of the oracle's cached tokens too.
The kv192-t16 run caps both engines at 192 blocks (examples/routing-fleet-kv192-tiny.toml, started by
--up), with 16 tenants, KV events from both engines, and both engines' prefix caches reset before
every phase (otherwise each policy's phase evicts the others' blocks, and each phase would start on
another policy's leftovers):
    python benchmarks/routing.py --up examples/routing-fleet-kv192-tiny.toml --no-sim --tenants 16 \
        --shared-requests 360 --agent-requests 180 --rounds 18 --cold-phases --loads 1,2,3,4,5,6 \
        --policies round_robin,cache_aware,cache_aware+overlap_weight=1,vllm-router:cache_aware,smg:cache_aware \
        --out benchmarks/results/routing-kv192-t16
    python benchmarks/routing.py ... --loads 1 --merge     # the same, another load, into the same file
routing-kv192-t16-big: the same with a 28 MB generated model (prefill ~0.1 ms per token, 3x the tiny
model's; same tokenizer): --up examples/routing-fleet-kv192.toml (192 blocks per engine,
`[fleet.demo_model]` with hidden 384, 4 layers) --prefill-scale 3; the command is in the file's meta.
routing (the headline real run, the default --out): that fleet with 6 tenants and 480 requests per policy and
load, so that fewer requests are cold under any policy (with 16 tenants, 41-59% are, and a p90 is then
a cold request's TTFT whatever the policy):
    python benchmarks/routing.py --up examples/routing-fleet-kv192.toml --no-sim --tenants 6 \
        --shared-requests 360 --agent-requests 120 --rounds 6 --cold-phases --loads 1,2,4,6 \
        --policies round_robin,cache_aware,cache_aware+overlap_weight=1,vllm-router:cache_aware,smg:cache_aware \
        --out benchmarks/results/routing
routing-kv1gib: `yieldgate up -c examples/routing-fleet.toml`, the default policies and
cache_aware with overlap_weight 1 and 2 (`--policies`), `--out benchmarks/results/routing-kv1gib`.
routing-kv192-t16-twin / -big-twin: the kv192-t16 regime in the simulator alone (`--twin`, no engines;
`--prefill-scale 3` for the 28 MB model), 8 seeds per policy and load; the command is in each file's meta.
routing-zipf64: 64 simulated replicas x 512 KV blocks, 1,000 tenants with Zipf(1) popularity + agent
sessions, vs round robin, least loaded and consistent hashing:
    python benchmarks/routing.py --zipf 1.0 --sim-tenants 1000 --sim-kv-blocks 512 --sim-requests 6000 \
        --sim-seeds 3 --rates 100,200,400 --out benchmarks/results/routing-zipf64 \
        --policies round_robin,least_loaded,consistent_hash,cache_aware,cache_aware_evict,cache_aware+overlap_weight=2,cache_aware+share_keep_tail_blocks=16
The simulated twin reads the engines' KV capacity from their /metrics.

TTFT p90s are compared as a difference to round robin with a 90% bootstrap interval and the share of
resamples where the policy is not worse: on 2 cores, one engine step stalled by another process moves
a p90 of a few hundred requests by 100+ ms. Each closed-loop phase opens with `conc` requests sent at
once; "steady" percentiles leave those out (both are reported).

Results: benchmarks/results/routing.json, routing.png, routing.html.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # fleet_rig.py, harness.py (also when loaded by a test)

from yieldgate.cache.routing import RouterConfig  # noqa: E402
from yieldgate.serving.config import kv_events_ipc  # noqa: E402
from yieldgate.cache.simulator import (EngineModel, PolicyResult, PromptBuilder, SimConfig, WorkloadMix,  # noqa: E402
                             run_simulation)
from yieldgate.gateway.simulate import demo_tokenizer  # noqa: E402
from yieldgate.loadtest import (AgentSessionWorkload, Bounds, CacheSalt, ConcurrencyLoad,  # noqa: E402
                      SharedPrefixWorkload)
from yieldgate.loadtest.stats import percentile  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
POLICIES = ["round_robin", "least_loaded", "session", "cache_aware"]
from fleet_rig import (DEMO_ENGINE, MEASURES, REDIS_URL, REPLICA_PREFIX, WORDS_PER_TOKEN,  # noqa: E402,F401
                       _reset_prefix_cache, own_redis, bootstrap_p90_diff, clear_bench_index, parse_policy, result_meta,
                       two_replica_config)

# -- real fleet -----------------------------------------------------------------------------------

from yieldgate.gateway.embedded import GatewayProcess  # noqa: E402

# The Rust routers' own prefix-aware policies, on the same engines and workloads as yieldgate's:
# "ROUTER:POLICY" in --policies, e.g. vllm-router:cache_aware and smg:cache_aware (each matches the
# request text against a radix tree of what it sent each engine, and balances load past a threshold).
# vllm-router's kv_aware is not among them: it tokenizes through vLLM's render endpoint
# (--enable-scale-out) and did not match the events of engines hashing blocks with sha256 (pickle),
# which yieldgate's index matches; docs/benchmarks.md#routing.


def is_peer(policy: str) -> bool:
    return ":" in policy


def peer_router(policy: str, engines: list[tuple[str, str]], workdir: Path):
    """A Rust router in front of the engines: the pinned version from proxy_rig.py, in its
    own venv, on loopback; it does not say which engine served a request, so the benchmark counts
    each engine's finished requests around every phase instead."""
    import proxy_rig  # benchmarks/proxy_rig.py: the Rust routers' pinned venvs

    router, _, name = policy.partition(":")
    try:
        return proxy_rig.RustRouter(router, [url for url, _ in engines], workdir, policy=name, pin=False)
    except RuntimeError as exc:
        raise SystemExit(f"{policy} did not start: {exc}") from None


def router_cpu_s(gw: Any) -> float:
    """CPU seconds the router's processes have used so far (a gateway's or a Rust router's): on two
    cores it is taken from the engines, so it shows up in their TTFTs."""
    import proxy_rig

    pids = gw.pids if isinstance(gw, proxy_rig.RustRouter) else proxy_rig.descendants(gw.process.pid)
    return proxy_rig.cpu_seconds(pids)


def engine_requests(url: str) -> float:
    """Requests the engine has finished (vLLM's request_success_total, every finish reason)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) if family.name == "vllm:request_success"
               for s in family.samples if s.name == "vllm:request_success_total")


def engine_kv_blocks(url: str) -> int | None:
    """The engine's KV capacity in blocks, from vLLM's `cache_config_info` metric."""
    import urllib.request

    from yieldgate.serving.fleet import parse_engine_metrics

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return parse_engine_metrics(resp.read().decode())[1]


def real_workloads(seed: int, tenants: int = 4) -> list[Any]:
    return [
        SharedPrefixWorkload(seed=seed, tenants=tenants, prefix_tokens=600, users_per_tenant=8, user_context_tokens=32,
                             suffix_tokens=40, output_tokens=4, words_per_token=WORDS_PER_TOKEN),
        AgentSessionWorkload(seed=seed, system_tokens=300, first_user_tokens=100, turns_min=3, turns_max=5,
                             tool_output_tokens=100, followup_tokens=30, output_tokens=4,
                             words_per_token=WORDS_PER_TOKEN),
    ]


async def _interleaved(gateways: dict[str, Any], conc: int, sizes: list[int], rounds: int,
                       seed: int, tenants: int, reset_urls: list[str], engine_urls: list[str]) -> dict[str, dict]:
    """Every policy gets its own gateway, salt and load-tester Runner per workload; the policies
    take turns round by round, so the shared machine's drift hits them alike, in reverse order every
    other round (loadtest.turn_order), so that none always goes first."""
    from yieldgate.loadtest import Runner, Target, turn_order

    state: dict[str, dict] = {}
    runners: list[Any] = []
    for policy, gw in gateways.items():
        parts = []
        for workload, n in zip(real_workloads(seed, tenants), sizes):
            salt = CacheSalt.random()
            runner = Runner(Target(base_url=gw.url, model="demo", name=f"{policy}@c{conc}"), workload,
                            cache_salt=salt, seed=seed)
            await runner.__aenter__()
            runners.append(runner)
            parts.append({"workload": workload, "n": n, "salt": salt.value, "runner": runner})
        state[policy] = {"parts": parts, "records": [], "steady": [], "duration": 0.0, "cpu_s": 0.0,
                         "per_engine": dict.fromkeys(engine_urls, 0.0)}
    try:
        for k in range(rounds):
            for policy in turn_order(list(state), k):
                st = state[policy]
                for part in st["parts"]:
                    n = part["n"] // rounds + (1 if k < part["n"] % rounds else 0)
                    if n <= 0:
                        continue
                    if reset_urls:  # --cold-phases: every phase starts on empty engine caches
                        await asyncio.gather(*(asyncio.to_thread(_reset_prefix_cache, u) for u in reset_urls))
                        await asyncio.sleep(0.3)  # the AllBlocksCleared events reach the gateways
                    peer = is_peer(policy)
                    if peer:
                        before = await asyncio.gather(*(asyncio.to_thread(engine_requests, u) for u in engine_urls))
                    cpu0 = router_cpu_s(gateways[policy])
                    _, records, duration = await part["runner"].run_phase(
                        ConcurrencyLoad(concurrency=conc), Bounds(requests=n, timeout_s=120))
                    st["cpu_s"] += router_cpu_s(gateways[policy]) - cpu0
                    if peer:  # a Rust router names no replica: each engine's finished requests
                        after = await asyncio.gather(*(asyncio.to_thread(engine_requests, u) for u in engine_urls))
                        for u, b, a in zip(engine_urls, before, after):
                            st["per_engine"][u] += a - b
                    ok = sorted((r for r in records if r.ok and not r.warmup), key=lambda r: r.start_s)
                    st["records"] += ok
                    # A closed-loop phase opens with `conc` requests sent at once onto idle engines;
                    # the rest arrive one as another ends (steady state). Both are reported.
                    st["steady"] += [r.ttft_ms for r in ok[conc:] if r.ttft_ms is not None]
                    st["duration"] += duration
    finally:
        for runner in runners:
            await runner.__aexit__(None, None, None)
    return state


def run_real(policies: list[str], loads: list[int], shared_requests: int, agent_requests: int,
             engines: list[tuple[str, str]], model_path: str, tokenizer: Any, seed: int,
             rounds: int = 4, records_path: str = "", tenants: int = 4, cold_phases: bool = False,
             engine: EngineModel = DEMO_ENGINE) -> list[dict]:

    import tempfile

    rows: list[dict] = []
    workdir = Path(tempfile.mkdtemp(prefix="yg-routing-bench-"))
    # The simulated twin gets the engines' real KV capacity (routing-fleet.toml caps it).
    engine = msgspec.structs.replace(engine, kv_capacity_blocks=min(
        engine_kv_blocks(url) or DEMO_ENGINE.kv_capacity_blocks for url, _ in engines))
    print(f"real: engines hold {engine.kv_capacity_blocks} KV blocks each", flush=True)
    for conc in loads:
        gateways: dict[str, Any] = {}  # GatewayProcess or a Rust router
        redises = ExitStack()
        try:
            for i, policy in enumerate(policies):
                if is_peer(policy):
                    gateways[policy] = peer_router(policy, engines, workdir)
                    continue
                # Each gateway in its own process (the load tester must not share a GIL with the
                # gateways' tokenization) with a Redis of its own, empty: every run starts cold.
                config = two_replica_config(policy, engines, model_path, tag=str(i),
                                            redis_url=redises.enter_context(own_redis(workdir)),
                                            data_dir=str(workdir / f"c{conc}-{policy}"))
                gateways[policy] = GatewayProcess(config, workdir)
            time.sleep(1.5)  # first health check + scrape; KV-event subscribers connect
            urls = [url for url, _ in engines]
            state = asyncio.run(_interleaved(gateways, conc, [shared_requests, agent_requests], rounds, seed,
                                             tenants, urls if cold_phases else [], urls))
        finally:
            for gw in gateways.values():
                gw.stop()
            redises.close()
        for policy in policies:
            st = state[policy]
            records = st["records"]
            counts: dict[str, int] = {}
            for r in records:
                counts[r.replica or "?"] = counts.get(r.replica or "?", 0) + 1
            if is_peer(policy):
                counts = {f"engine-{i}": round(n) for i, n in enumerate(st["per_engine"].values())}
            predicted = [r.predicted_cached_tokens or 0 for r in records]
            if records_path:
                with open(records_path, "ab") as f:
                    for r in records:
                        f.write(msgspec.json.encode({"policy": policy, "concurrency": conc, **msgspec.to_builtins(r)})
                                + b"\n")
            sim_parts: list[PolicyResult] = []
            for part in st["parts"]:
                phases = [part["n"] // rounds + (1 if k < part["n"] % rounds else 0) for k in range(rounds)]
                # A Rust router's policy has no twin: round robin's run gives the oracle (which depends
                # on the requests, not on the policy); its prediction is left out.
                name, overrides = ("round_robin", {}) if is_peer(policy) else parse_policy(policy)
                router = msgspec.convert({"policy": name, **overrides}, RouterConfig, strict=False)
                sim_cfg = SimConfig(policy=name, router=router, replicas=2, arrival="concurrency", concurrency=conc,
                                    requests=part["n"], phases=[n for n in phases if n > 0], seed=seed,
                                    cache_salt=part["salt"], scrape_interval_s=1.0, cold_phases=cold_phases,
                                    engines=[msgspec.structs.replace(engine, kv_events=bool(kv)) for _, kv in engines])
                sim_parts.append(run_simulation(part["workload"], sim_cfg,
                                                prompts=PromptBuilder(tokenizer, part["salt"])))
            prompt = sum(r.prompt_tokens for r in records)
            cached = sum(r.cached_tokens or 0 for r in records)
            sim_prompt = sum(p.prompt_tokens for p in sim_parts)
            sim_cached = sum(p.cached_tokens for p in sim_parts)
            sim_oracle = sum(p.oracle_cached_tokens for p in sim_parts)
            oracle_ratio = sim_oracle / sim_prompt if sim_prompt else 0.0
            ttft = sorted(r.ttft_ms for r in records if r.ttft_ms is not None)
            mean = sum(counts.values()) / max(1, len(engines))
            row = {
                "policy": policy, "concurrency": conc, "requests": len(records),
                "prompt_tokens": prompt, "cached_tokens": cached,
                "cached_ratio": cached / prompt if prompt else 0.0,
                "oracle_ratio": oracle_ratio,
                "ratio_to_oracle": (cached / prompt) / oracle_ratio if oracle_ratio and prompt else 1.0,
                "ttft_p50_ms": percentile(ttft, 50), "ttft_p90_ms": percentile(ttft, 90),
                "ttft_p90_steady_ms": percentile(st["steady"], 90),
                "throughput_rps": len(records) / st["duration"] if st["duration"] else 0.0,
                "router_cpu_us_per_request": st["cpu_s"] / len(records) * 1e6 if records else None,
                "requests_per_replica": counts,
                "load_max_over_mean": max(counts.values()) / mean if counts and mean else 1.0,
                "predicted_cached_tokens": sum(predicted),
                "sim_prompt_tokens": sim_prompt,
                "sim_cached_ratio": sim_cached / sim_prompt if sim_prompt else 0.0,
                "sim_ratio_to_oracle": sim_cached / sim_oracle if sim_oracle else 1.0,
                "sim_ttft_p90_ms": max(p.ttft_p90_s for p in sim_parts) * 1000,
                "tenants": tenants, "kv_capacity_blocks": engine.kv_capacity_blocks, "cold_phases": cold_phases,
            }
            if is_peer(policy):
                row.update(predicted_cached_tokens=None, sim_cached_ratio=None, sim_ratio_to_oracle=None,
                           sim_ttft_p90_ms=None, version=gateways[policy].version)
            rows.append(row)
            sim = f"{row['sim_cached_ratio']:.1%}" if row["sim_cached_ratio"] is not None else "-"
            print(f"real c={conc} {policy:<13} cached {row['cached_ratio']:.1%} (sim {sim}, "
                  f"oracle {oracle_ratio:.1%}) prompt tokens real/sim {prompt}/{sim_prompt} "
                  f"ttft p50/p90 {row['ttft_p50_ms']:.0f}/{row['ttft_p90_ms']:.0f} ms "
                  f"{row['throughput_rps']:.2f} req/s load {counts} "
                  f"router CPU {row['router_cpu_us_per_request'] or 0:.0f} us/request", flush=True)
        base = state.get("round_robin")
        for row in rows[-len(policies):]:
            if base is None or row["policy"] == "round_robin":
                continue
            mine = [r.ttft_ms for r in state[row["policy"]]["records"] if r.ttft_ms is not None]
            theirs = [r.ttft_ms for r in base["records"] if r.ttft_ms is not None]
            row["ttft_p90_vs_round_robin"] = d = bootstrap_p90_diff(mine, theirs, seed=conc)
            row["ttft_p90_steady_vs_round_robin"] = bootstrap_p90_diff(state[row["policy"]]["steady"],
                                                                       base["steady"], seed=conc)
            print(f"real c={conc} {row['policy']:<13} TTFT p90 - round robin: {d['diff_ms']:+.0f} ms "
                  f"(90% CI {d['ci90_ms'][0]:+.0f}..{d['ci90_ms'][1]:+.0f}; not worse in {d['p_not_worse']:.0%} "
                  "of resamples)", flush=True)
    return rows


# -- the 2-engine regime in the simulator alone ------------------------------------------------------

def run_twin(policies: list[str], loads: list[int], shared_requests: int, agent_requests: int, tokenizer: Any,
             seeds: list[int], rounds: int, tenants: int, kv_blocks: int, cold_phases: bool,
             engine: EngineModel = DEMO_ENGINE) -> list[dict]:
    """The real run's simulated twin without engines: 2 replicas with `kv_blocks` each (both with KV
    events), the same workloads, rounds and closed-loop concurrencies, one fixed salt per seed, load
    and workload (the same for every policy). Averaged over `seeds`: one seed's 180 requests are noisy."""
    engine = msgspec.structs.replace(engine, kv_capacity_blocks=kv_blocks)
    rows: list[dict] = []
    for conc in loads:
        for policy in policies:
            name, overrides = parse_policy(policy)
            router = msgspec.convert({"policy": name, **overrides}, RouterConfig, strict=False)
            parts: list[PolicyResult] = []
            for seed in seeds:
                for k, (workload, n) in enumerate(zip(real_workloads(seed, tenants),
                                                      [shared_requests, agent_requests])):
                    salt = f"twin-{seed}-{conc}-{k}"
                    phases = [n // rounds + (1 if i < n % rounds else 0) for i in range(rounds)]
                    cfg = SimConfig(policy=name, router=router, replicas=2, arrival="concurrency", concurrency=conc,
                                    requests=n, phases=[x for x in phases if x > 0], seed=seed, cache_salt=salt,
                                    scrape_interval_s=1.0, cold_phases=cold_phases, engines=[engine, engine])
                    parts.append(run_simulation(workload, cfg, prompts=PromptBuilder(tokenizer, salt)))
            prompt = sum(p.prompt_tokens for p in parts)
            cached = sum(p.cached_tokens for p in parts)
            oracle = sum(p.oracle_cached_tokens for p in parts)
            per_replica: dict[str, int] = {}
            for p in parts:
                for r, c in p.requests_per_replica.items():
                    per_replica[r] = per_replica.get(r, 0) + c
            mean = sum(per_replica.values()) / max(1, len(per_replica))
            # Per-seed worst balance: summing seeds would hide one seed's lopsided split.
            row = {"policy": policy, "concurrency": conc, "requests": sum(p.requests for p in parts),
                   "seeds": len(seeds), "cached_ratio": cached / prompt if prompt else 0.0,
                   "oracle_ratio": oracle / prompt if prompt else 0.0,
                   "ratio_to_oracle": cached / oracle if oracle else 1.0,
                   "ratio_to_oracle_min_seed": min(
                       sum(p.cached_tokens for p in parts[i:i + 2]) / max(1, sum(p.oracle_cached_tokens
                                                                                  for p in parts[i:i + 2]))
                       for i in range(0, len(parts), 2)),
                   "ttft_p90_ms_mean": sum(p.ttft_p90_s for p in parts) / len(parts) * 1000,
                   "load_max_over_mean": max(per_replica.values()) / mean if mean else 1.0,
                   "tenants": tenants, "kv_capacity_blocks": kv_blocks, "cold_phases": cold_phases}
            rows.append(row)
            print(f"twin c={conc} {policy:<40} cached/oracle {row['ratio_to_oracle']:.1%} "
                  f"(worst seed {row['ratio_to_oracle_min_seed']:.1%}) cached {row['cached_ratio']:.1%} "
                  f"oracle {row['oracle_ratio']:.1%} ttft p90 {row['ttft_p90_ms_mean']:.0f} ms "
                  f"load {row['load_max_over_mean']:.2f}", flush=True)
    return rows


# -- simulated large fleet -------------------------------------------------------------------------

def large_mix(seed: int, tenants: int) -> WorkloadMix:
    return WorkloadMix([
        (SharedPrefixWorkload(seed=seed, tenants=tenants, prefix_tokens=1000, users_per_tenant=16,
                              user_context_tokens=64, suffix_tokens=64, output_tokens=64,
                              words_per_token=WORDS_PER_TOKEN), 0.75),
        (AgentSessionWorkload(seed=seed, system_tokens=400, first_user_tokens=200, tool_output_tokens=200,
                              followup_tokens=40, output_tokens=64, words_per_token=WORDS_PER_TOKEN), 0.25),
    ], seed=seed)


def zipf_mix(seed: int, tenants: int, zipf: float) -> WorkloadMix:
    """large_mix with tenant popularity Zipf(`zipf`): a few hot prefixes, a long tail."""
    return WorkloadMix([
        (SharedPrefixWorkload(seed=seed, tenants=tenants, prefix_tokens=1000, users_per_tenant=16,
                              user_context_tokens=64, suffix_tokens=64, output_tokens=64, tenant_zipf=zipf,
                              words_per_token=WORDS_PER_TOKEN), 0.75),
        (AgentSessionWorkload(seed=seed, system_tokens=400, first_user_tokens=200, tool_output_tokens=200,
                              followup_tokens=40, output_tokens=64, words_per_token=WORDS_PER_TOKEN), 0.25),
    ], seed=seed)


def run_sim(policies: list[str], rates: list[float], requests: int, replicas: int, tenants: int,
            kv_blocks: int, tokenizer: Any, seed: int, zipf: float = 0.0) -> list[dict]:
    prompts = PromptBuilder(tokenizer)
    rows = []
    for rate in rates:
        for policy in policies:
            name, overrides = parse_policy(policy)
            router = msgspec.convert({"policy": name, **overrides}, RouterConfig, strict=False)
            cfg = SimConfig(policy=name, router=router, replicas=replicas, requests=requests, rate=rate, seed=seed,
                            session_ids=True, engine=EngineModel(kv_capacity_blocks=kv_blocks))
            t = time.perf_counter()
            mix = zipf_mix(seed, tenants, zipf) if zipf else large_mix(seed, tenants)
            r = run_simulation(mix, cfg, prompts=prompts)
            row = msgspec.to_builtins(r)
            row.pop("requests_per_replica")
            row["rate"] = rate
            row["policy"] = policy  # with its settings: "cache_aware+overlap_weight=2"
            rows.append(row)
            print(f"sim rate={rate:<5g} {policy:<13} cached {r.cached_ratio:.1%} /oracle {r.ratio_to_oracle:.1%} "
                  f"ttft p50/p90 {r.ttft_p50_s * 1000:.0f}/{r.ttft_p90_s * 1000:.0f} ms {r.throughput_rps:.0f} req/s "
                  f"load {r.load_max_over_mean:.2f} busy {r.busy_max_over_mean:.2f} "
                  f"({time.perf_counter() - t:.0f}s)", flush=True)
    return rows


@contextmanager
def up_stack(config: str) -> Iterator[list[str]]:
    """`yieldgate up -c config` for the run (nothing if ""); yields both engines' KV-event endpoints."""
    if not config:
        yield []
        return
    from stack_up import stack  # benchmarks/stack_up.py, next to this script

    with stack(config) as home:
        yield [f"ipc://{home}/run/kv-events-standard-{i}.sock" for i in range(2)]


def merge_real(previous: dict, rows: list[dict], run: dict) -> tuple[list[dict], list[dict]]:
    """--merge: this run's rows replace `previous` result's rows of the same loads, the others stay;
    the runs' metas (previous ones, then `run`) so that each keeps its own command and machine load."""
    loads = {r["concurrency"] for r in rows}
    real = sorted([r for r in previous.get("real", []) if r["concurrency"] not in loads] + rows,
                  key=lambda r: r["concurrency"])
    before = previous.get("meta")
    runs = ((before.get("notes") or {}).get("merged_runs") or before.get("runs") or [before]) if before else []
    return real, [*runs, run]


def mean_over_seeds(runs: list[list[dict]]) -> list[dict]:
    """One row per rate and policy: the seeds' mean of every figure, with the cached ratio and the
    load ratio of each seed beside it (one seed of this workload moves the ratio by up to 1.5 points)."""
    out = []
    for rows in zip(*runs):
        row = {k: (sum(r[k] for r in rows) / len(rows) if isinstance(v, (int, float)) and not isinstance(v, bool)
                   else v) for k, v in rows[0].items()}
        row["ratio_to_oracle_by_seed"] = [r["ratio_to_oracle"] for r in rows]
        row["load_max_over_mean_by_seed"] = [r["load_max_over_mean"] for r in rows]
        out.append(row)
    return out


ZIPF_RATIO_AXIS = (88.0, 100.0)  # cached / oracle (%): the cache-aware policies differ by tenths here


def plot_zipf(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for ax, key, label, scale in ((axes[0], "ratio_to_oracle", "cached / oracle (%)", 100),
                                  (axes[1], "ttft_p90_s", "TTFT p90 (ms)", 1000),
                                  (axes[2], "load_max_over_mean", "max/mean requests per replica", 1)):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            mine = [r for r in rows if r["policy"] == policy]
            xs, ys = [r["rate"] for r in mine], [r[key] * scale for r in mine]
            seeds = [r.get(f"{key}_by_seed") for r in mine]
            name = policy
            if key == "ratio_to_oracle" and max(ys) < ZIPF_RATIO_AXIS[0]:  # far below: named, not drawn
                lo, hi = f"{min(ys):.0f}", f"{max(ys):.0f}"
                name = f"{policy} ({lo if lo == hi else f'{lo}–{hi}'}%, below the axis)"
            if all(seeds):  # the seeds' range around their mean
                err = [[y - min(v) * scale for y, v in zip(ys, seeds)], [max(v) * scale - y for y, v in zip(ys, seeds)]]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
            else:
                ax.plot(xs, ys, marker="o", label=name)
        if key == "ratio_to_oracle":
            ax.axhline(95, color="grey", linestyle="--", linewidth=1, label="goal 95%")
            ax.set_ylim(*ZIPF_RATIO_AXIS)
        if key == "load_max_over_mean":
            ax.axhline(1.25, color="grey", linestyle="--", linewidth=1, label="goal 1.25")
        if key != "ratio_to_oracle":
            ax.set_yscale("log")
        ax.set_xlabel("offered load (sessions/s)")
        ax.set_title(f"{title}: {label}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_twin(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label in ((axes[0], "ratio_to_oracle", "cached / oracle (%)"),
                           (axes[1], "ttft_p90_ms_mean", "TTFT p90 (ms)")):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            pts = [(r["concurrency"], r[key] * (100 if key == "ratio_to_oracle" else 1))
                   for r in rows if r["policy"] == policy]
            ax.plot(*zip(*pts), marker="o", label=policy)
        if key == "ratio_to_oracle":
            ax.axhline(95, color="grey", linestyle="--", linewidth=1, label="goal 95%")
        ax.set_xlabel("closed-loop concurrency")
        ax.set_title(f"{title}: {label}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- outputs -----------------------------------------------------------------------------------------

def plot(real: list[dict], sim: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not sim:  # a real run alone: cached / oracle and TTFT p90 per policy against load
        plot_real(real, path)
        return
    fig, axes = plt.subplots(1, 5, figsize=(26, 5))
    ax = axes[4]
    extra = sorted({r["policy"] for r in real} - set(POLICIES))
    for policy in [p for p in POLICIES + extra if any(r["policy"] == p for r in real)]:
        pts = sorted((r["concurrency"], r["ttft_p90_ms"]) for r in real if r["policy"] == policy)
        ax.plot(*zip(*pts), marker="o", label=policy)
    ax.set_xlabel("closed-loop concurrency")
    ax.set_title("2 demo engines (real): TTFT p90 (ms)")
    if real:
        ax.legend(fontsize=7)
    ax = axes[0]
    if real:
        loads = sorted({r["concurrency"] for r in real})
        labels, meas, pred, orac = [], [], [], []
        for c in loads:
            for r in (x for x in real if x["concurrency"] == c):
                labels.append(f"{r['policy']}\nc={c}")
                meas.append(r["cached_ratio"] * 100)
                pred.append((r["sim_cached_ratio"] or 0) * 100)  # a Rust router's policy has no twin
                orac.append(r["oracle_ratio"] * 100)
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], meas, 0.4, label="real (usage.cached_tokens)")
        ax.bar([x + 0.2 for x in xs], pred, 0.4, label="simulator prediction")
        ax.plot(list(xs), orac, "k_", markersize=18, label="oracle")
        ax.set_xticks(list(xs), labels, fontsize=7, rotation=45, ha="right")
        ax.set_ylabel("cached tokens / prompt tokens (%)")
        ax.set_title("2 demo engines: real vs simulated hit rate")
        ax.legend(fontsize=7, loc="lower center")
    for ax, key, title, scale in ((axes[1], "ratio_to_oracle", "64 replicas (sim): cached / oracle (%)", 100),
                                  (axes[2], "ttft_p90_s", "64 replicas (sim): TTFT p90 (ms)", 1000),
                                  (axes[3], "load_max_over_mean", "64 replicas (sim): max/mean requests/replica", 1)):
        for policy in POLICIES:
            pts = [(r["rate"], r[key] * scale) for r in sim if r["policy"] == policy]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=policy)
        if key == "load_max_over_mean":
            ax.axhline(1.25, color="grey", linestyle="--", linewidth=1, label="goal 1.25")
        ax.set_xlabel("offered load (sessions/s)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    axes[2].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_real(real: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    policies = list(dict.fromkeys(r["policy"] for r in real))
    for ax, key, label, scale in ((axes[0], "ratio_to_oracle", "cached tokens / oracle (%)", 100),
                                  (axes[1], "ttft_p90_ms", "TTFT p90 (ms)", 1),
                                  (axes[2], "load_max_over_mean", "max/mean requests per engine", 1)):
        for policy in policies:
            pts = sorted((r["concurrency"], r[key] * scale) for r in real if r["policy"] == policy)
            ax.plot(*zip(*pts), marker="o", label=policy)
        goal = {"ratio_to_oracle": 95, "load_max_over_mean": 1.25}.get(key)
        if goal:
            ax.axhline(goal, color="grey", linestyle="--", linewidth=1, label=f"goal {goal:g}")
        ax.set_xlabel("closed-loop concurrency")
        ax.set_title(f"2 real engines: {label}", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def html_table(real: list[dict], sim: list[dict], image: str = "routing.png") -> str:
    def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
        head = "".join(f"<th>{h}</th>" for h, _, _ in cols)
        body = "".join("<tr>" + "".join(f"<td>{'—' if r[k] is None else format(r[k], f) if f else r[k]}</td>"
                                        for _, k, f in cols) + "</tr>"
                       for r in rows)
        return f"<table><tr>{head}</tr>{body}</table>"

    def vs_rr(key: str) -> Any:
        def cell(r: dict) -> str:
            d = r.get(key)
            if not d:
                return "—"
            return (f"{d['diff_ms']:+.0f} ({d['ci90_ms'][0]:+.0f}..{d['ci90_ms'][1]:+.0f}), "
                    f"not worse in {d['p_not_worse']:.0%}")
        return cell

    real = [{**r, "vs_rr": vs_rr("ttft_p90_vs_round_robin")(r),
             "vs_rr_steady": vs_rr("ttft_p90_steady_vs_round_robin")(r),
             "ttft_p90_steady_ms": r.get("ttft_p90_steady_ms", float("nan"))} for r in real]
    real_cols = [("concurrency", "concurrency", ""), ("policy", "policy", ""), ("requests", "requests", ""),
                 ("cached", "cached_ratio", ".1%"), ("sim predicted", "sim_cached_ratio", ".1%"),
                 ("oracle", "oracle_ratio", ".1%"), ("cached/oracle", "ratio_to_oracle", ".1%"),
                 ("TTFT p50 ms", "ttft_p50_ms", ".0f"), ("TTFT p90 ms", "ttft_p90_ms", ".0f"),
                 ("p90 − round robin, ms (90% bootstrap CI)", "vs_rr", ""),
                 ("TTFT p90 steady ms", "ttft_p90_steady_ms", ".0f"),
                 ("steady p90 − round robin", "vs_rr_steady", ""),
                 ("req/s", "throughput_rps", ".2f"), ("max/mean load", "load_max_over_mean", ".2f")]
    sim_cols = [("sessions/s", "rate", "g"), ("policy", "policy", ""), ("requests", "requests", ""),
                ("cached", "cached_ratio", ".1%"), ("oracle", "oracle_ratio", ".1%"),
                ("cached/oracle", "ratio_to_oracle", ".1%"), ("TTFT p50 s", "ttft_p50_s", ".3f"),
                ("TTFT p90 s", "ttft_p90_s", ".3f"), ("req/s", "throughput_rps", ".0f"),
                ("max/mean requests", "load_max_over_mean", ".2f"), ("max/mean busy", "busy_max_over_mean", ".2f")]
    style = ("<style>table{border-collapse:collapse;font:13px sans-serif}"
             "td,th{border:1px solid #ccc;padding:3px 8px}</style>")
    return (f"<html><head><meta charset='utf-8'><title>yieldgate routing</title>{style}</head><body>"
            "<h2>Real: 2 demo engines behind one gateway tier</h2>"
            f"{table(real, real_cols) if real else '<p>not run</p>'}"
            f"<h2>Simulated: 64 replicas</h2>{table(sim, sim_cols) if sim else '<p>not run</p>'}"
            f"<p><img src='{image}' width='100%'></p></body></html>")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--sim", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--standard", default="http://127.0.0.1:8101")
    # `yieldgate up` launches the demo engines with KV events on an IPC socket under YIELDGATE_HOME.
    ap.add_argument("--standard-kv", default=kv_events_ipc("standard-0"))
    ap.add_argument("--fast", default="http://127.0.0.1:8102")
    ap.add_argument("--fast-kv", default="")
    ap.add_argument("--loads", default="1,2,4,6", help="real closed-loop concurrencies")
    ap.add_argument("--rates", default="50,100,200,300,400", help="simulated sessions/s")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma-separated; a policy may carry tier tuning: cache_aware+queued_request_blocks=8")
    ap.add_argument("--tenants", type=int, default=4, help="real: tenants of the shared-prefix workload")
    ap.add_argument("--cold-phases", action="store_true",
                    help="real: reset both engines' prefix caches before every phase (the simulator does the same)")
    ap.add_argument("--shared-requests", type=int, default=60, help="real: shared-prefix requests per policy and load")
    ap.add_argument("--agent-requests", type=int, default=30, help="real: agent-session turns per policy and load")
    ap.add_argument("--rounds", type=int, default=4, help="real: policies take turns this many times per load")
    ap.add_argument("--records", default="", help="also write every real request record to this JSONL file")
    ap.add_argument("--up", default="", metavar="CONFIG",
                    help="real: start `yieldgate up -c CONFIG` (engines 8101/8102, KV events from both) for this "
                         "run and stop it afterwards")
    ap.add_argument("--merge", action="store_true",
                    help="real: keep --out's rows of the concurrencies not run now, so a long run can go one "
                         "load per invocation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "routing"))
    ap.add_argument("--twin", action="store_true",
                    help="the 2-engine regime (--tenants, --loads, --rounds, --cold-phases, --kv-blocks) in the "
                         "simulator alone, averaged over --twin-seeds; writes only --out")
    ap.add_argument("--twin-seeds", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=192, help="--twin: KV blocks per engine")
    ap.add_argument("--prefill-scale", type=float, default=1.0,
                    help="the simulated twin's prefill cost times the demo engine's (3 for the 28 MB model)")
    ap.add_argument("--zipf", type=float, default=0.0,
                    help="simulator only: 64 replicas, --sim-tenants tenants with Zipf(--zipf) popularity; "
                         "writes only --out")
    ap.add_argument("--sim-tenants", type=int, default=1000)
    ap.add_argument("--sim-kv-blocks", type=int, default=512)
    ap.add_argument("--sim-requests", type=int, default=6000)
    ap.add_argument("--sim-seeds", type=int, default=1,
                    help="--zipf: run every policy and rate with this many seeds (from --seed) and report their mean")
    args = ap.parse_args(argv)
    if args.twin or args.zipf:
        return main_sim_only(args, argv if argv is not None else sys.argv[1:])

    from yieldgate.serving.demo_model import ensure_demo_model

    policies = [p for p in args.policies.split(",") if p]
    model_path = str(ensure_demo_model())
    tok = demo_tokenizer(model_path)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {}
    real = previous.get("real", [])
    sim = previous.get("sim", [])
    command = "python benchmarks/routing.py " + " ".join(argv if argv is not None else sys.argv[1:])
    runs: list[dict] = []
    engines = [(args.standard, args.standard_kv), (args.fast, args.fast_kv)]
    if args.real:
        loads = [int(x) for x in args.loads.split(",")]
        engine = msgspec.structs.replace(DEMO_ENGINE,
                                         prefill_s_per_token=DEMO_ENGINE.prefill_s_per_token * args.prefill_scale)
        with up_stack(args.up) as kv_events:
            engines = [(url, kv_events[i] if kv_events else kv) for i, (url, kv) in enumerate(engines)]
            rows = run_real(policies, loads, 12 if args.quick else args.shared_requests,
                            8 if args.quick else args.agent_requests, engines, model_path, tok, args.seed,
                            rounds=args.rounds, records_path=args.records, tenants=args.tenants,
                            cold_phases=args.cold_phases, engine=engine)
        real, runs = merge_real(previous if args.merge else {}, rows,
                                result_meta(command, f"closed-loop concurrency {args.loads}"))
    if args.sim:
        rates = [float(x) for x in args.rates.split(",")]
        sim = run_sim(policies, rates, 1500 if args.quick else 6000, 64, 256, 2048, tok, args.seed)
    loads_run = ",".join(str(c) for c in dict.fromkeys(r["concurrency"] for r in real))
    meta = result_meta(command, f"2 real engines ({args.up or 'already up'}), {args.tenants} tenants, "
                                f"{args.shared_requests} shared-prefix + {args.agent_requests} agent requests per "
                                f"policy and load in {args.rounds} rounds, closed-loop concurrency {loads_run}"
                                + (", caches reset before every phase" if args.cold_phases else ""))
    if len(runs) > 1:  # merged: each invocation's own command, date and machine load
        meta.setdefault("notes", {})["merged_runs"] = runs
    doc = {"meta": meta, "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "real": real, "sim": sim,
           "sim_setup": {"replicas": 64, "tenants": 256, "prefix_tokens": 1000, "kv_capacity_blocks": 2048,
                         "engine": msgspec.to_builtins(EngineModel()), "agent_share": 0.25},
           "real_setup": {"engines": [url for url, _ in engines], "kv_events": [kv for _, kv in engines],
                          "demo_engine_model": msgspec.to_builtins(DEMO_ENGINE)}}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    plot(real, sim, out.with_suffix(".png"))
    out.with_suffix(".html").write_text(html_table(real, sim, out.name + ".png"))
    print(f"wrote {out}.json/.png/.html")


def main_sim_only(args: argparse.Namespace, argv: list[str]) -> None:
    """--twin or --zipf: one simulated regime, one canonical result file with its meta."""
    from yieldgate.serving.demo_model import ensure_demo_model

    policies = [p for p in args.policies.split(",") if p]
    tok = demo_tokenizer(str(ensure_demo_model()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/routing.py " + " ".join(argv)
    if args.twin:
        loads = [int(x) for x in args.loads.split(",")]
        engine = msgspec.structs.replace(DEMO_ENGINE,
                                         prefill_s_per_token=DEMO_ENGINE.prefill_s_per_token * args.prefill_scale)
        rows = run_twin(policies, loads, args.shared_requests, args.agent_requests, tok,
                        list(range(args.seed, args.seed + args.twin_seeds)), args.rounds, args.tenants,
                        args.kv_blocks, args.cold_phases, engine)
        load = (f"2 simulated engines x {args.kv_blocks} KV blocks, closed-loop concurrency {args.loads}, "
                f"{args.tenants} tenants, {args.shared_requests} shared-prefix + {args.agent_requests} agent "
                f"requests per seed in {args.rounds} rounds, {args.twin_seeds} seeds")
        doc = {"meta": result_meta(command, load), "twin": rows,
               "engine": msgspec.to_builtins(msgspec.structs.replace(engine, kv_capacity_blocks=args.kv_blocks))}
        plot_twin(rows, out.with_suffix(".png"),
                  f"2 engines x {args.kv_blocks} blocks, {args.tenants} tenants (sim)")
    else:
        rates = [float(x) for x in args.rates.split(",")]
        rows = mean_over_seeds([run_sim(policies, rates, args.sim_requests, 64, args.sim_tenants, args.sim_kv_blocks,
                                        tok, seed, zipf=args.zipf)
                                for seed in range(args.seed, args.seed + args.sim_seeds)])
        load = (f"64 simulated replicas x {args.sim_kv_blocks} KV blocks, {args.sim_tenants} tenants with "
                f"Zipf({args.zipf:g}) popularity + 25% agent sessions, Poisson {args.rates} sessions/s, "
                f"{args.sim_requests} requests per policy, rate and seed, {args.sim_seeds} seeds")
        doc = {"meta": result_meta(command, load), "sim": rows,
               "engine": msgspec.to_builtins(EngineModel(kv_capacity_blocks=args.sim_kv_blocks))}
        plot_zipf(rows, out.with_suffix(".png"),
                  f"64 replicas, {args.sim_tenants} tenants, Zipf {args.zipf:g} (sim)")
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}.json/.png")


if __name__ == "__main__":
    main()
