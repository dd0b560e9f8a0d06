"""An agent with tools through the gateway, on two real engines: cached tokens vs the oracle, per
wire format (chat completions, Responses, Messages) and routing policy.

    yieldgate up -c examples/routing-fleet.toml     # two identical standard engines on 8101/8102
    python benchmarks/agent_routing.py              # writes benchmarks/results/agent_routing.json

For each load (`--concurrency`, concurrent sessions), wire format and policy: a fresh gateway
process whose `standard` tier has both engines as replicas (as benchmarks/routing.py), both engines'
prefix caches reset, then the load tester's `agent-tools` workload (multi-turn sessions re-sending a
growing conversation with a fixed tool list, tool calls and results) in that wire format, closed
loop, fresh cache salt. That is one round (`--rounds`, 3): the policies take turns within it on the
same new sessions, so the shared machine's drift hits them alike, in reverse order every other time
(loadtest.turn_order), so that none always goes first. Per load and wire format the
rounds are pooled, and cache_aware's TTFT p90 is compared with round robin's as a difference with a
90% bootstrap interval (benchmarks/routing.py's `bootstrap_p90_diff`).

The oracle is the simulator's (cache.simulator.PrefixOracle): one infinite cache that has seen
every earlier request. It scores the exact conversations the load tester sent, real answers
included, in send order, tokenized by the gateway's chat renderer (identical to the engine's
/tokenize on agent chats with tools). `ratio_to_oracle` = (cached / prompt tokens measured) /
(oracle cached / prompt tokens). Responses and Messages requests are rendered as the chat
conversation they carry; their measured prompt tokens are reported next to the oracle's.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402  benchmarks/harness.py
from fleet_rig import (REDIS_URL, WORDS_PER_TOKEN, _reset_prefix_cache, bootstrap_p90_diff,  # noqa: E402
                     clear_bench_index, two_replica_config)

from yieldgate.cache.blocks import BlockHashConfig, BlockHasher  # noqa: E402
from yieldgate.cache.simulator import PrefixOracle  # noqa: E402
from yieldgate.gateway.embedded import GatewayProcess  # noqa: E402
from yieldgate.gateway.simulate import demo_tokenizer  # noqa: E402
from yieldgate.loadtest import (AgentToolsWorkload, Bounds, CacheSalt, ConcurrencyLoad, Runner,  # noqa: E402
                                Target, turn_order)
from yieldgate.loadtest.stats import percentile  # noqa: E402
from yieldgate.serving.config import kv_events_ipc  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BLOCK = 32  # the gateway's and the engines' block size (two_replica_config)


def workload(seed: int) -> AgentToolsWorkload:
    return AgentToolsWorkload(seed=seed, system_tokens=300, first_user_tokens=100, turns_min=3, turns_max=6,
                              tool_output_tokens=100, followup_tokens=20, output_tokens=8,
                              words_per_token=WORDS_PER_TOKEN)


async def one_run(url: str, api: str, policy: str, requests: int, concurrency: int, seed: int,
                  tokenizer: Any) -> dict[str, Any]:
    sent: list[tuple[list[dict], list[dict] | None]] = []
    runner = Runner(Target(base_url=url, model="demo", api=api, name=f"{api}/{policy}"), workload(seed),
                    cache_salt=CacheSalt.random(), seed=seed,
                    on_body=lambda s, k, messages: sent.append((json.loads(json.dumps(messages)), s.tools)))
    async with runner:
        summary, records, duration = await runner.run_phase(ConcurrencyLoad(concurrency=concurrency),
                                                            Bounds(requests=requests, timeout_s=120))
    ok = [r for r in records if r.ok]
    oracle = PrefixOracle(BLOCK)
    hasher = BlockHasher(BlockHashConfig(block_size=BLOCK))
    oracle_prompt = oracle_cached = 0
    for messages, tools in sent:
        tokens = tokenizer.encode_chat(messages, tools)
        oracle_prompt += len(tokens)
        oracle_cached += oracle.observe(hasher.hashes(tokens), len(tokens)) * BLOCK
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    later = [r for r in ok if r.turn > 0]
    counts: dict[str, int] = {}
    for r in ok:
        counts[r.replica or "?"] = counts.get(r.replica or "?", 0) + 1
    oracle_ratio = oracle_cached / oracle_prompt if oracle_prompt else 0.0
    ttft = sorted(r.ttft_ms for r in ok if r.ttft_ms is not None)
    row = {
        "api": api, "policy": policy, "concurrency": concurrency, "requests": len(records), "ok": len(ok),
        "sessions": len({r.session for r in records}),
        "prompt_tokens": prompt, "cached_tokens": cached, "cached_ratio": cached / prompt if prompt else 0.0,
        "later_turns_with_cache_hits": sum(1 for r in later if (r.cached_tokens or 0) > 0) / len(later) if later else None,
        "oracle_prompt_tokens": oracle_prompt, "oracle_cached_tokens": oracle_cached, "oracle_ratio": oracle_ratio,
        "ratio_to_oracle": (cached / prompt) / oracle_ratio if oracle_ratio and prompt else None,
        "client_cost_usd": sum(r.cost or 0.0 for r in ok),
        "ttft_p50_ms": percentile(ttft, 50) if ttft else None, "ttft_p90_ms": percentile(ttft, 90) if ttft else None,
        "duration_s": duration, "requests_per_replica": counts, "ttft_ms": ttft,
    }
    print(f"c={concurrency:<3} {api:<10} {policy:<12} cached {row['cached_ratio']:.1%} oracle {oracle_ratio:.1%} "
          f"-> {row['ratio_to_oracle'] or 0:.1%} of oracle; prompt tokens {prompt} (oracle's {oracle_prompt}); "
          f"{len(ok)}/{len(records)} ok; replicas {counts}", flush=True)
    return row


def pooled(runs: list[dict[str, Any]], replicas: int) -> list[dict[str, Any]]:
    """Per load, wire format and policy, the rounds added up: tokens, requests per replica (of
    `replicas`, a replica that got none counting 0), TTFT samples; for each policy but round robin,
    its TTFT p90 minus round robin's with a 90% interval."""
    out: dict[tuple[int, str, str], dict[str, Any]] = {}
    for r in runs:
        row = out.setdefault((r["concurrency"], r["api"], r["policy"]), {
            "concurrency": r["concurrency"], "api": r["api"], "policy": r["policy"], "rounds": 0, "requests": 0,
            "ok": 0, "prompt_tokens": 0, "cached_tokens": 0, "oracle_prompt_tokens": 0, "oracle_cached_tokens": 0,
            "requests_per_replica": {}, "ttft": []})
        row["rounds"] += 1
        for k in ("requests", "ok", "prompt_tokens", "cached_tokens", "oracle_prompt_tokens", "oracle_cached_tokens"):
            row[k] += r[k]
        for name, n in r["requests_per_replica"].items():
            row["requests_per_replica"][name] = row["requests_per_replica"].get(name, 0) + n
        row["ttft"] += r["ttft_ms"]
    for row in out.values():
        cached = row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else 0.0
        oracle = row["oracle_cached_tokens"] / row["oracle_prompt_tokens"] if row["oracle_prompt_tokens"] else 0.0
        counts = list(row["requests_per_replica"].values())
        counts += [0] * (replicas - len(counts))
        ttft = sorted(row["ttft"])
        row.update(cached_ratio=cached, oracle_ratio=oracle, ratio_to_oracle=cached / oracle if oracle else None,
                   load_max_over_mean=max(counts) / (sum(counts) / len(counts)) if counts else 1.0,
                   ttft_p50_ms=percentile(ttft, 50) if ttft else None,
                   ttft_p90_ms=percentile(ttft, 90) if ttft else None)
    for (conc, api, policy), row in out.items():
        base = out.get((conc, api, "round_robin"))
        if base is not None and policy != "round_robin" and row["ttft"] and base["ttft"]:
            row["ttft_p90_vs_round_robin"] = d = bootstrap_p90_diff(row["ttft"], base["ttft"])
            print(f"c={conc:<3} {api:<10} {policy:<12} {row['ratio_to_oracle'] or 0:.1%} of oracle over {row['rounds']} rounds; "
                  f"TTFT p90 - round robin {d['diff_ms']:+.0f} ms (90% CI {d['ci90_ms'][0]:+.0f}..{d['ci90_ms'][1]:+.0f})",
                  flush=True)
    for row in out.values():
        del row["ttft"]
    return list(out.values())


def plot(summary: list[dict[str, Any]], path: Path) -> None:
    """Per load and wire format: cached tokens / oracle per policy, and cache_aware's TTFT p90 minus
    round robin's with its 90% interval."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["concurrency"], r["api"]) for r in summary})
    by = {(r["concurrency"], r["api"], r["policy"]): r for r in summary}
    labels = [f"{api}\n{conc} sessions" for conc, api in keys]
    policies = sorted({r["policy"] for r in summary})
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        vals = [100 * (by[k + (policy,)]["ratio_to_oracle"] or 0) if k + (policy,) in by else 0 for k in keys]
        left.bar([x + i * width for x in range(len(keys))], vals, width, label=policy)
    left.axhline(95, color="grey", linestyle="--", linewidth=1, label="goal 95%")
    left.set_xticks([x + 0.4 - width / 2 for x in range(len(keys))], labels)
    left.set_ylim(80, 106)
    left.set_ylabel("cached tokens / oracle's, %")
    left.legend(loc="upper center", ncol=3)
    diffs = [by.get(k + ("cache_aware",), {}).get("ttft_p90_vs_round_robin") for k in keys]
    xs = [x for x, d in enumerate(diffs) if d]
    mid = [d["diff_ms"] for d in diffs if d]
    err = [[d["diff_ms"] - d["ci90_ms"][0] for d in diffs if d], [d["ci90_ms"][1] - d["diff_ms"] for d in diffs if d]]
    right.errorbar(xs, mid, yerr=err, fmt="o", capsize=4)
    right.axhline(0, color="grey", linewidth=1)
    right.set_xticks(range(len(keys)), labels)
    right.set_ylabel("TTFT p90, cache_aware − round robin, ms (90% CI)")
    fig.suptitle("agent with tools, 2 real engines")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="http://127.0.0.1:8101,http://127.0.0.1:8102")
    ap.add_argument("--kv", default=",".join(kv_events_ipc(f"standard-{i}") for i in range(2)),
                    help="KV-event endpoints of the engines, comma separated ('' for none)")
    ap.add_argument("--apis", default="chat,responses,messages")
    ap.add_argument("--policies", default="round_robin,cache_aware")
    ap.add_argument("--requests", type=int, default=120, help="requests per load, wire format, policy and round")
    ap.add_argument("--concurrency", default="4,12", help="concurrent sessions, comma separated: one run each")
    ap.add_argument("--gateway-port", type=int, default=0, help="0: any free port")
    ap.add_argument("--redis-url", default=REDIS_URL, help="the gateways' Redis (prefix index)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every load, wire format and policy (seeds seed, seed+1, ...)")
    ap.add_argument("--out", default=str(RESULTS / "agent_routing.json"))
    args = ap.parse_args()

    engines = args.engines.split(",")
    kv = args.kv.split(",") if args.kv else [""] * len(engines)
    pairs = list(zip(engines, kv))
    from yieldgate.serving.demo_model import ensure_demo_model

    model_path = str(ensure_demo_model())
    tokenizer = demo_tokenizer(model_path)
    workdir = Path(tempfile.mkdtemp(prefix="yg-agent-routing-"))
    load_start = os.getloadavg()[0]
    runs = []
    loads = [int(c) for c in args.concurrency.split(",")]
    for rnd in range(args.rounds):
        for cell, (conc, api) in enumerate(itertools.product(loads, args.apis.split(","))):
            # Policies in reverse order every other time a load and wire format come round.
            for i, policy in turn_order(list(enumerate(args.policies.split(","))), rnd + cell):
                clear_bench_index(args.redis_url)
                for url in engines:  # every run starts on empty engine caches
                    _reset_prefix_cache(url)
                gw = GatewayProcess(two_replica_config(policy, pairs, model_path, redis_url=args.redis_url, tag=f"a{i}",
                                                       data_dir=str(workdir / f"{rnd}-{conc}-{api}-{policy}")),
                                    workdir, port=args.gateway_port or None)
                try:
                    time.sleep(1.5)  # first health check and scrape; KV-event subscribers connect
                    row = asyncio.run(one_run(gw.url, api, policy, args.requests, conc, args.seed + rnd,
                                              tokenizer))
                    runs.append({"round": rnd, **row})
                finally:
                    gw.stop()
                    clear_bench_index(args.redis_url)
    summary = pooled(runs, len(engines))
    doc = {
        "meta": harness.meta(
            ["gateway/", "cache/", "serving/", "pricing/", "loadtest/", "benchmarks/agent_routing.py",
             "benchmarks/fleet_rig.py"],
            setup=f"closed loop, {args.concurrency} concurrent sessions, {args.requests} requests per load, wire "
                  f"format, policy and round, {args.rounds} rounds; two demo engines (examples/routing-fleet.toml), "
                  "prefix caches reset before each run",
            load_before=load_start, workload=workload(args.seed).describe(), platform=platform.platform(),
            oracle="cache.simulator.PrefixOracle over the sent conversations (send order, chat rendering)"),
        "summary": summary,
        "runs": [{k: v for k, v in r.items() if k != "ttft_ms"} for r in runs],
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    plot(summary, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out} and its .png")


if __name__ == "__main__":
    main()
