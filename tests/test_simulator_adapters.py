"""LoRA adapters in the fleet simulator: slots, loads, adapter-keyed prefix blocks, and routing
that weighs them (cache/simulator.py). No engines."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from yieldgate.cache.scorers import RouteRequest, adapter_affinity
from yieldgate.cache.simulator import EngineModel, FleetSimulator, PromptBuilder, SimConfig, SimRequest, run_simulation
from yieldgate.gateway.simulate import demo_tokenizer
from yieldgate.loadtest import AdapterWorkload, Session, SharedPrefixWorkload, Turn


@pytest.fixture(scope="module")
def prompts():
    return PromptBuilder(demo_tokenizer())


def one_replica(max_loras: int = 2, lora_load_s: float = 0.5, lora_unload_s: float = 0.0
                ) -> tuple[FleetSimulator, object]:
    """A one-replica fleet without clients: requests are submitted to its replica by hand."""
    cfg = SimConfig(replicas=1, engine=EngineModel(max_loras=max_loras, lora_load_s=lora_load_s,
                                                   lora_unload_s=lora_unload_s))
    fleet = FleetSimulator(cfg, iter(()), prompts=None)
    return fleet, fleet.replicas[0]


def request(rid: int, adapter: str | None, at: float, n_out: int = 1) -> SimRequest:
    return SimRequest(rid, f"s{rid}", 0, list(range(64)), [], n_out=n_out, arrival=at, adapter=adapter)


def submit_all(fleet: FleetSimulator, replica, reqs: list[SimRequest]) -> None:
    for r in reqs:
        fleet.schedule(r.arrival, replica.submit, r)
    fleet.run()


def test_a_full_replica_unloads_its_least_recently_used_adapter():
    fleet, replica = one_replica(max_loras=2)
    # a, then b, then a again (b is now the least recently used), then c: b goes, a stays.
    submit_all(fleet, replica, [request(0, "a", 0.0), request(1, "b", 2.0), request(2, "a", 4.0),
                                request(3, "c", 6.0)])
    assert list(replica.adapters) == ["a", "c"]
    assert (replica.loads, replica.unloads) == (3, 1)


def test_an_adapter_with_a_request_on_the_replica_is_never_unloaded():
    fleet, replica = one_replica(max_loras=1, lora_load_s=0.1)
    long_a, b = request(0, "a", 0.0, n_out=100), request(1, "b", 0.2)
    submit_all(fleet, replica, [long_a, b])
    # b waited for a's last request to end before its load could empty a's slot.
    assert b.first_token >= long_a.finish + 0.1
    assert (replica.loads, replica.unloads) == (2, 1)


def test_a_load_delays_the_first_token_by_the_load_time_and_is_counted():
    ttft = {}
    for load_s in (0.0, 0.3):
        fleet, replica = one_replica(lora_load_s=load_s)
        first, again = request(0, "a", 0.0), request(1, "a", 5.0)
        submit_all(fleet, replica, [first, again])
        ttft[load_s] = [r.first_token - r.arrival for r in (first, again)]
        assert (replica.loads, replica.unloads) == (1, 0)
    assert ttft[0.3][0] - ttft[0.0][0] == pytest.approx(0.3)
    assert ttft[0.3][1] == pytest.approx(ttft[0.0][1])  # resident by then: no load


def test_a_load_that_empties_a_slot_also_waits_for_the_unload():
    fleet, replica = one_replica(max_loras=1, lora_load_s=0.1, lora_unload_s=0.05)
    a, b = request(0, "a", 0.0), request(1, "b", 2.0)
    submit_all(fleet, replica, [a, b])
    assert (b.first_token - b.arrival) - (a.first_token - a.arrival) == pytest.approx(0.05)
    assert (replica.loads, replica.unloads) == (2, 1)


def test_loads_on_one_replica_run_one_at_a_time_and_share_a_load_in_progress():
    fleet, replica = one_replica(lora_load_s=0.3)
    a, b, a2 = request(0, "a", 0.0), request(1, "b", 0.0), request(2, "a", 0.1)
    submit_all(fleet, replica, [a, b, a2])
    assert b.first_token >= 0.6  # b's load waited for a's
    assert 0.3 <= a2.first_token < 0.6  # a2 waited for a's load, not a load of its own
    assert replica.loads == 2


def test_affinity_is_the_gateways_resident_then_free_slot_then_must_unload():
    assert [adapter_affinity(True, 2, 2), adapter_affinity(False, 1, 2), adapter_affinity(False, 2, 2)] == [1, 0.5, 0]
    fleet, replica = one_replica(max_loras=2)
    submit_all(fleet, replica, [request(0, "a", 0.0)])
    assert (replica.affinity("a"), replica.affinity("b")) == (1.0, 0.5)
    submit_all(fleet, replica, [request(1, "b", fleet.now + 1)])
    assert replica.affinity("c") == 0.0


class Sessions:
    """Hand-written sessions: one prompt, sent for the base model or an adapter."""

    def __init__(self, adapters: list[str | None]) -> None:
        system = "You are the assistant of tenant 0. " + "cache token model router engine " * 60
        self.sessions = [Session(id=f"s{i}", system=system, adapter=a,
                                 turns=[Turn(user="the same question", max_tokens=4, input_tokens_est=400)])
                         for i, a in enumerate(adapters)]

    def sessions_iter(self):
        return iter(self.sessions)


def test_adapter_blocks_are_cached_apart_from_the_base_models_and_each_others(prompts):
    order = [None, "a", "a", None, "b"]
    cfg = SimConfig(policy="round_robin", replicas=1, requests=len(order), arrival="concurrency", concurrency=1,
                    engine=EngineModel(kv_capacity_blocks=10**5))
    fleet = FleetSimulator(cfg, Sessions(order).sessions_iter(), prompts)
    result = fleet.run()
    hits = [r.cached_blocks for r in sorted(fleet.done, key=lambda r: r.id)]
    assert hits[0] == 0 and hits[1] == 0  # the base model's prefix is no hit for adapter a
    assert hits[2] > 0 and hits[3] > 0  # a's own prefix, and the base model's, are
    assert hits[4] == 0  # nor is a's for adapter b
    assert [r.oracle_blocks for r in sorted(fleet.done, key=lambda r: r.id)] == hits  # the oracle keys them alike
    assert result.adapter_requests == 3
    assert result.loads_per_1k == pytest.approx(1000 * 2 / 5) and result.unloads_per_1k == 0


def adapter_run(policy: str, prompts) -> object:
    workload = AdapterWorkload(seed=3, adapters=12, tenants=4, prefix_tokens=300, users_per_tenant=4,
                               suffix_tokens=32, output_tokens=16, words_per_token=0.42)
    cfg = SimConfig(policy=policy, replicas=4, requests=300, rate=20.0,
                    engine=EngineModel(kv_capacity_blocks=512, max_loras=2, lora_load_s=0.1))
    return run_simulation(workload, cfg, prompts=prompts)


def three_replicas(policy: str, adapter_replicas: int = 0) -> tuple[FleetSimulator, list]:
    """r0 holds "a", r1's two slots hold "x" and "y", r2 has both slots free."""
    cfg = SimConfig(policy=policy, replicas=3, adapter_replicas=adapter_replicas,
                    engine=EngineModel(max_loras=2, lora_load_s=0.1))
    fleet = FleetSimulator(cfg, iter(()), prompts=None)
    for replica, adapters in zip(fleet.replicas, (["a"], ["x", "y"])):
        for adapter in adapters:
            replica.preload(adapter)
    return fleet, fleet.replicas


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_a_policy_blind_to_adapters_goes_where_the_gateway_sends_it(policy):
    fleet, (r0, _, r2) = three_replicas(policy)
    route = RouteRequest()
    assert fleet._adapter_candidates("a", route) == [r0] and route.adapter_affinity is None
    assert "a" not in r2.adapters  # its holder is idle: nothing to spread
    r0.inflight = 1  # every holder busy: the gateway loads it into a free slot in the background
    assert fleet._adapter_candidates("a", route) == [r0] and "a" in r2.adapters
    # Held nowhere: loaded where a slot is free, before a replica that would have to unload one.
    assert fleet._adapter_candidates("b", route) == [r2]


def test_adapter_aware_weighs_every_replica_until_the_adapter_reaches_its_placement():
    fleet, (r0, r1, r2) = three_replicas("adapter_aware")
    route = RouteRequest()
    assert fleet._adapter_candidates("a", route) == [r0, r1, r2]
    assert route.adapter_affinity == {r0.name: 1.0, r1.name: 0.0, r2.name: 0.5}
    route = RouteRequest()  # held nowhere: the policy picks where to load it
    assert fleet._adapter_candidates("b", route) == [r0, r1, r2]
    assert route.adapter_affinity == {r0.name: 0.5, r1.name: 0.0, r2.name: 0.5}
    fleet, (r0, r1, r2) = three_replicas("adapter_aware", adapter_replicas=1)
    assert fleet._adapter_candidates("a", RouteRequest()) == [r0]  # placed on 1 replica, and it is there


def test_adapter_aware_loads_no_more_than_a_policy_blind_to_adapters(prompts):
    blind, aware = adapter_run("cache_aware", prompts), adapter_run("adapter_aware", prompts)
    assert blind.adapter_requests == aware.adapter_requests == 300
    assert aware.loads_per_1k <= blind.loads_per_1k


def test_base_model_runs_count_no_loads(prompts):
    workload = SharedPrefixWorkload(tenants=4, prefix_tokens=200, output_tokens=8, words_per_token=0.42)
    r = run_simulation(workload, SimConfig(policy="adapter_aware", replicas=2, requests=50), prompts=prompts)
    assert (r.adapter_requests, r.loads_per_1k, r.unloads_per_1k) == (0, 0.0, 0.0)


def test_adapter_workload_gives_each_adapter_its_tenants_prefix_and_hot_adapters_most_requests():
    sessions = AdapterWorkload(seed=1, adapters=30, tenants=10, adapter_zipf=1.0, base_share=0.2).take(2000)
    by_adapter: dict[str | None, set[str]] = {}
    for s in sessions:
        by_adapter.setdefault(s.adapter, set()).add(s.system)
    assert all(len(systems) == 1 for a, systems in by_adapter.items() if a is not None)
    assert by_adapter["adapter-0"] == by_adapter["adapter-10"] != by_adapter["adapter-1"]  # 0 and 10: tenant 0
    counts = {a: sum(s.adapter == a for s in sessions) for a in by_adapter}
    assert counts["adapter-0"] > counts["adapter-5"] > counts.get("adapter-29", 0)
    assert 300 < counts[None] < 500  # base_share of the requests name no adapter


def test_simulate_cli_compares_adapter_policies_with_loads_per_1000_requests():
    from yieldgate.gateway.cli import app

    runner = CliRunner()
    out = runner.invoke(app, ["simulate", "--replicas", "2", "--tenants", "4", "--adapters", "8", "--max-loras", "2",
                              "--requests", "120", "--rate", "10", "--agent-share", "0", "--json"])
    assert out.exit_code == 0, out.output
    results = {r["policy"]: r for r in json.loads(out.stdout)}
    assert set(results) == {"round_robin", "least_loaded", "cache_aware", "adapter_aware"}
    assert all(r["adapter_requests"] == 120 for r in results.values())
    assert results["adapter_aware"]["loads_per_1k"] < results["round_robin"]["loads_per_1k"]
    table = runner.invoke(app, ["simulate", "--replicas", "2", "--adapters", "8", "--requests", "40",
                                "--policies", "adapter_aware"])
    assert table.exit_code == 0 and "loads/1k" in table.stdout and "adapter_aware" in table.stdout
    # Placed on one replica at most, no adapter is loaded a second time beside its first copy.
    one = runner.invoke(app, ["simulate", "--replicas", "2", "--tenants", "4", "--adapters", "8", "--max-loras", "2",
                              "--requests", "120", "--rate", "10", "--agent-share", "0", "--json",
                              "--policies", "adapter_aware", "--adapter-replicas", "1"])
    assert one.exit_code == 0, one.output
    assert json.loads(one.stdout)[0]["loads_per_1k"] < results["adapter_aware"]["loads_per_1k"]


def test_a_warm_up_phase_is_left_out_of_the_results(prompts):
    """As the real benchmark leaves its warm-up requests out (benchmarks/adapter_routing.py's twin):
    requests, per-replica counts and loads count from the first measured phase on."""
    workload = AdapterWorkload(seed=3, adapters=12, tenants=4, prefix_tokens=300, users_per_tenant=4,
                               suffix_tokens=32, output_tokens=16, words_per_token=0.42)

    def run(warmup_phases: int):
        cfg = SimConfig(policy="adapter_aware", replicas=2, requests=116, phases=[16, 100], arrival="concurrency",
                        concurrency=4, warmup_phases=warmup_phases,
                        engine=EngineModel(kv_capacity_blocks=512, max_loras=2, lora_load_s=0.1))
        return run_simulation(workload, cfg, prompts=prompts)

    whole, measured = run(0), run(1)
    assert whole.requests == 116 and measured.requests == sum(measured.requests_per_replica.values()) == 100
    loads = lambda r: round(r.loads_per_1k * r.requests / 1000)  # noqa: E731
    assert 0 < loads(measured) < loads(whole)  # the cold start's first loads are the warm-up's
    assert measured.cached_ratio > whole.cached_ratio


# -- the candidacy rule the gateway and the simulator share ---------------------------------------

class _Replica:
    def __init__(self, name: str, tier: str = "standard", inflight: int = 0):
        self.name, self.tier, self.inflight = name, tier, inflight


def test_adapter_candidacy_is_one_rule_for_gateway_and_simulator():
    """cache.scorers.adapter_candidacy: holders; holders and the tier's others with affinity
    while the policy weighs it and there is room; a spread to a free slot when every holder is
    busy; held nowhere, loaded first where a slot is free, then least loaded."""
    from yieldgate.cache import adapter_candidacy
    from yieldgate.cache import simulator

    a, b, c, other = _Replica("a", inflight=1), _Replica("b", inflight=3), _Replica("c"), _Replica("x", "fast")
    affinity = {"a": 1.0, "b": 0.5, "c": 0.0, "x": 0.5}.__getitem__
    aff = lambda r: affinity(r.name)  # noqa: E731

    weighs = adapter_candidacy([a], [a, b, c, other], aff, weighs_affinity=True, room=True, busy=True, tier="standard")
    assert ([r.name for r in weighs.candidates], weighs.affinity) == (["a", "b", "c"], {"a": 1.0, "b": 0.5, "c": 0.0})
    full = adapter_candidacy([a], [a, b, c], aff, weighs_affinity=True, room=False, busy=True)
    assert ([r.name for r in full.candidates], full.affinity, full.spread_to) == (["a"], None, None)
    busy = adapter_candidacy([a], [a, b, c], aff, weighs_affinity=False, room=True, busy=True)
    assert ([r.name for r in busy.candidates], busy.spread_to) == (["a"], b)
    idle = adapter_candidacy([a], [a, b, c], aff, weighs_affinity=False, room=True, busy=False)
    assert idle.spread_to is None
    nowhere = adapter_candidacy([], [c, b], aff, weighs_affinity=False, room=True, busy=False)
    assert (nowhere.candidates, [r.name for r in nowhere.load_on]) == ([], ["b", "c"])
    # The simulator routes with this rule, not a copy of it.
    assert simulator.adapter_candidacy is adapter_candidacy
