"""The fleet simulator: real Router/PrefixIndex/Tokenizer on modelled engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from yieldgate.cache import PrefixIndex
from yieldgate.cache.simulator import (EngineModel, KVCache, PromptBuilder, SimConfig, SimRequest, WorkloadMix,
                             run_simulation)
from yieldgate.gateway.simulate import demo_tokenizer
from yieldgate.loadtest import AgentSessionWorkload, SharedPrefixWorkload


@pytest.fixture(scope="module")
def prompts():
    return PromptBuilder(demo_tokenizer())


def shared_prefix(seed: int = 0) -> SharedPrefixWorkload:
    return SharedPrefixWorkload(seed=seed, tenants=12, prefix_tokens=400, users_per_tenant=4, suffix_tokens=32,
                                output_tokens=16, words_per_token=0.42)


def sim(policy: str, **kw) -> SimConfig:
    base = dict(policy=policy, replicas=4, requests=300, rate=20.0, engine=EngineModel(kv_capacity_blocks=256))
    base.update(kw)
    return SimConfig(**base)


def test_prompts_match_the_engine_chat_tokenization(prompts):
    session = AgentSessionWorkload(seed=3, words_per_token=0.42).take(1)[0]
    messages = prompts.start(session)
    for k, turn in enumerate(session.turns):
        prompts.add_user(messages, turn)
        assert prompts.encode(messages) == prompts.tokenizer.encode_chat(messages)
        prompts.add_answer(messages, session.id, k, 16)


def test_same_inputs_same_result(prompts):
    mix = WorkloadMix([(shared_prefix(), 0.7), (AgentSessionWorkload(words_per_token=0.42, output_tokens=16), 0.3)])
    a = run_simulation(mix, sim("cache_aware"), prompts=prompts)
    b = run_simulation(mix, sim("cache_aware"), prompts=prompts)
    assert a == b
    assert a.requests == 300


def test_cache_aware_beats_round_robin_on_shared_prefixes(prompts):
    rr = run_simulation(shared_prefix(), sim("round_robin"), prompts=prompts)
    ca = run_simulation(shared_prefix(), sim("cache_aware"), prompts=prompts)
    assert ca.cached_ratio > rr.cached_ratio
    assert ca.ratio_to_oracle >= 0.9
    assert ca.cached_tokens <= ca.oracle_cached_tokens and rr.cached_tokens <= rr.oracle_cached_tokens
    # The router's index predicted what the engines then served from cache.
    assert abs(ca.predicted_cached_tokens - ca.cached_tokens) <= 0.05 * ca.cached_tokens
    assert rr.predicted_cached_tokens == 0  # round robin never consults the index


def test_one_replica_infinite_cache_reaches_the_oracle(prompts):
    r = run_simulation(shared_prefix(), sim("round_robin", replicas=1, engine=EngineModel(kv_capacity_blocks=10**6)),
                       prompts=prompts)
    assert r.cached_tokens == r.oracle_cached_tokens
    assert r.evicted_blocks == 0


def test_cold_phases_start_with_empty_caches_and_oracle(prompts):
    """As the real benchmark resetting the engines' prefix caches between phases: the same
    requests find fewer cached tokens, and the oracle (reset too) still bounds every policy."""
    kw = dict(replicas=2, requests=120, phases=[40, 40, 40], arrival="concurrency", concurrency=2,
              engine=EngineModel(kv_capacity_blocks=10**5))
    warm = run_simulation(shared_prefix(), sim("cache_aware", **kw), prompts=prompts)
    cold = run_simulation(shared_prefix(), sim("cache_aware", cold_phases=True, **kw), prompts=prompts)
    assert cold.prompt_tokens == warm.prompt_tokens
    assert cold.oracle_cached_tokens < warm.oracle_cached_tokens
    assert cold.cached_tokens < warm.cached_tokens <= warm.oracle_cached_tokens
    assert cold.cached_tokens <= cold.oracle_cached_tokens
    # The prefix index heard the reset (KV events) and did not predict blocks that were dropped.
    assert abs(cold.predicted_cached_tokens - cold.cached_tokens) <= 0.05 * cold.cached_tokens


def test_lru_eviction_drops_oldest_unpinned_blocks_and_reports_them():
    stored: list[int] = []
    removed: list[int] = []
    cache = KVCache(7, lambda req, hashes: stored.extend(hashes), removed.extend)
    a = SimRequest(0, "a", 0, list(range(64)), [1, 2], n_out=1, arrival=0.0)   # 2 hashed + 1 tail block
    cache.allocate(a, 32)
    assert stored == [1, 2] and cache.used() == 3
    cache.release(a)
    assert cache.used() == 0 and list(cache.free) == [2, 1]  # freed tail-first: head evicted last
    b = SimRequest(1, "b", 0, list(range(100, 164)), [3, 4], n_out=1, arrival=0.0)
    cache.allocate(b, 32)
    c = SimRequest(2, "c", 0, list(range(200, 264)), [5, 6], n_out=1, arrival=0.0)
    cache.allocate(c, 32)  # needs 3 blocks; 3 pinned + 2 cached of 7: evicts the oldest cached block
    assert removed == [2]
    assert cache.hit_blocks([1, 2], 65, 32) == 1  # block 1 (the prefix head) survived
    d = SimRequest(3, "d", 0, list(range(64)) + [9], [1, 2], n_out=1, arrival=0.0)
    assert cache.hit_blocks(d.hashes, d.n_prompt, 32) == 1


def test_engine_events_keep_the_prefix_index_in_step_with_evictions(prompts):
    from yieldgate.cache.simulator import FleetSimulator

    cfg = sim("cache_aware", requests=200, engine=EngineModel(kv_capacity_blocks=128))
    fleet = FleetSimulator(cfg, shared_prefix().sessions(), prompts)
    result = fleet.run()
    assert result.evicted_blocks > 0
    index: PrefixIndex = fleet.index
    for replica in fleet.replicas:
        indexed = set(index.blocks(replica.name))
        assert indexed, replica.name  # an empty index is trivially a subset: it must hold blocks
        engine_blocks = set(replica.cache.pinned) | set(replica.cache.free)
        assert indexed <= engine_blocks  # nothing the engine evicted


def routing_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "routing_bench", Path(__file__).resolve().parent.parent / "benchmarks" / "routing.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_routing_benchmark_p90_comparison_has_an_interval():
    """benchmarks/routing.py compares TTFT p90s as a difference with a bootstrap interval."""
    import random

    bench = routing_bench()
    rng = random.Random(1)
    fast = [rng.gauss(100, 10) for _ in range(200)]
    slow = [rng.gauss(150, 10) for _ in range(200)]
    better = bench.bootstrap_p90_diff(fast, slow)
    assert better["ci90_ms"][1] < 0 < -better["diff_ms"] and better["p_not_worse"] > 0.99
    worse = bench.bootstrap_p90_diff(slow, fast)
    assert worse["ci90_ms"][0] > 0 and worse["p_not_worse"] < 0.01
    same = bench.bootstrap_p90_diff(fast, list(fast))
    assert same["ci90_ms"][0] <= 0 <= same["ci90_ms"][1]


def test_routing_benchmark_merge_replaces_the_loads_run_and_keeps_each_runs_meta():
    """--merge: a long real run goes one load per invocation into one result file."""
    merge = routing_bench().merge_real
    row = lambda conc, policy, v: {"concurrency": conc, "policy": policy, "v": v}  # noqa: E731
    first = {"meta": {"command": "a"}, "real": [row(4, "rr", 1), row(4, "ca", 1), row(6, "rr", 1)]}
    real, runs = merge(first, [row(1, "rr", 2), row(6, "rr", 2)], {"command": "b"})
    assert real == [row(1, "rr", 2), row(4, "rr", 1), row(4, "ca", 1), row(6, "rr", 2)]
    assert [r["command"] for r in runs] == ["a", "b"]
    _, runs = merge({"meta": {"command": "b", "runs": runs}, "real": real}, [row(2, "rr", 3)], {"command": "c"})
    assert [r["command"] for r in runs] == ["a", "b", "c"]
    assert merge({}, [row(1, "rr", 4)], {"command": "d"}) == ([row(1, "rr", 4)], [{"command": "d"}])
