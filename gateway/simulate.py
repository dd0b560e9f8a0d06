"""`yieldgate simulate`: the routing simulator (cache/simulator.py) driven by the load tester's
workload generators and the demo model's tokenizer, from the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import typer

from yieldgate.cache.routing import UnknownPolicy
from yieldgate.cache.simulator import EngineModel, PolicyResult, SimConfig, WorkloadMix, compare_policies
from yieldgate.cache.tokenizer import Tokenizer
from yieldgate.loadtest.workload import AdapterWorkload, AgentSessionWorkload, SharedPrefixWorkload

POLICIES = "round_robin,least_loaded,session,cache_aware"
ADAPTER_POLICIES = "round_robin,least_loaded,cache_aware,adapter_aware"


def demo_tokenizer(model_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer of `model_dir`, or of the generated tiny model (quick to make; the simulator only counts tokens)."""
    if model_dir is None:
        from yieldgate.serving import ensure_demo_model
        model_dir = ensure_demo_model()
    return Tokenizer.from_model_dir(model_dir)


def simulate_command(
    replicas: int = typer.Option(8, help="Replicas in the tier."),
    tenants: int = typer.Option(64, help="Shared-prefix tenants."),
    prefix_tokens: int = typer.Option(1000, help="Tenant system prefix, approximate demo-model tokens."),
    agent_share: float = typer.Option(0.25, help="Fraction of sessions that are multi-turn agent sessions."),
    requests: int = typer.Option(2000, help="Requests (turns) to send."),
    rate: float = typer.Option(20.0, help="Sessions per second (Poisson)."),
    kv_blocks: int = typer.Option(4096, help="KV cache capacity per replica, in blocks."),
    adapters: int = typer.Option(0, help="LoRA adapters (Zipf popularity, each a tenant's fine-tune); 0: base model only."),
    max_loras: int = typer.Option(2, help="Adapter slots per replica (vLLM --max-loras)."),
    lora_load_s: float = typer.Option(0.1, help="Seconds one adapter load takes on a replica."),
    lora_unload_s: float = typer.Option(0.0, help="Seconds the unload that empties a slot takes."),
    adapter_replicas: int = typer.Option(0, help="Each adapter's placement {replicas = N}: loaded on "
                                         "demand on up to N replicas; 0: up to every replica."),
    policies: str = typer.Option("", help=f"Comma-separated [default: {POLICIES}; with --adapters: {ADAPTER_POLICIES}]."),
    seed: int = typer.Option(0, help="Workload and arrival seed."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Simulate routing policies on a modelled fleet, with the gateway's own routing code."""
    shared: Any = SharedPrefixWorkload(seed=seed, tenants=tenants, prefix_tokens=prefix_tokens, users_per_tenant=16,
                                       output_tokens=64, words_per_token=0.42)
    if adapters > 0:
        shared = AdapterWorkload(seed=seed, adapters=adapters, tenants=min(tenants, adapters),
                                 prefix_tokens=prefix_tokens, users_per_tenant=16, output_tokens=64,
                                 words_per_token=0.42)
    mix = WorkloadMix([(shared, 1.0 - agent_share),
                       (AgentSessionWorkload(seed=seed, output_tokens=64, words_per_token=0.42), agent_share)],
                      seed=seed)
    cfg = SimConfig(replicas=replicas, requests=requests, rate=rate, seed=seed, session_ids=True,
                    adapter_replicas=adapter_replicas,
                    engine=EngineModel(kv_capacity_blocks=kv_blocks, max_loras=max_loras,
                                       lora_load_s=lora_load_s, lora_unload_s=lora_unload_s))
    names = [p.strip() for p in (policies or (ADAPTER_POLICIES if adapters else POLICIES)).split(",") if p.strip()]
    try:
        results = compare_policies(mix, cfg, names, demo_tokenizer())
    except UnknownPolicy as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if json_out:
        typer.echo(msgspec.json.encode(results).decode())
        return
    typer.echo(table(results, adapters > 0))


def table(results: list[PolicyResult], adapters: bool = False) -> str:
    """One row per policy; with adapters, loads and unloads per 1,000 requests too."""
    head = f"{'policy':<14}{'cached':>8}{'/oracle':>9}{'ttft p50':>10}{'ttft p90':>10}{'req/s':>8}{'max/mean':>9}"
    lines = [head + (f"{'loads/1k':>10}{'unloads/1k':>11}" if adapters else "")]
    for r in results:
        line = (f"{r.policy:<14}{r.cached_ratio:>8.1%}{r.ratio_to_oracle:>9.1%}{r.ttft_p50_s * 1000:>8.0f}ms"
                f"{r.ttft_p90_s * 1000:>8.0f}ms{r.throughput_rps:>8.1f}{r.load_max_over_mean:>9.2f}")
        lines.append(line + (f"{r.loads_per_1k:>10.0f}{r.unloads_per_1k:>11.0f}" if adapters else ""))
    return "\n".join(lines)
