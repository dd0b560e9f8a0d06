"""Routing policies as registered parts: presets, pipelines composed in the TOML config, and a
part registered by name."""

from __future__ import annotations

import pytest
from test_cache_routing import Replica

from yieldgate.cache import PipelineSpec, RouteRequest, Router, WeightedScorer, register_scorer
from yieldgate.cache.routing import POLICIES
from yieldgate.gateway.config import ConfigError, load_config


def replicas(loads):
    return [Replica(name=f"r{i}", inflight=load) for i, load in enumerate(loads)]


def test_the_four_presets_are_pipelines_of_registered_parts():
    assert set(POLICIES) >= {"round_robin", "least_loaded", "session", "cache_aware"}
    assert Router("cache_aware").needs_tokens and not Router("least_loaded").needs_tokens
    # session keys on the session id; without one it falls back to least loaded
    r = Router("session")
    assert r.pick(RouteRequest(), replicas([3, 0, 5])).replica.name == "r1"
    homes = {r.pick(RouteRequest(session_id="s-42"), replicas([0, 0, 0])).replica.name for _ in range(5)}
    assert len(homes) == 1


def test_a_tier_composes_its_own_pipeline_in_the_config(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[fleet.tiers.standard]\npolicy = "loaded_first"\n'
                   '[fleet.tiers.standard.pipeline]\nscorers = [{ name = "load", weight = -1.0 }]\n')
    tier = load_config(cfg, env={}).fleet.tiers["standard"]
    router = Router(tier.policy, pipeline=tier.pipeline)
    # a negative load weight prefers the busiest replica: proof the pipeline, not a preset, routes
    assert router.pick(RouteRequest(), replicas([1, 7, 2])).replica.name == "r1"
    assert router.policy.name == "loaded_first"


@pytest.mark.parametrize("toml", [
    '[fleet.tiers.standard]\npolicy = "fastest"\n',
    '[fleet.tiers.standard.pipeline]\nfilters = ["nope"]\n',
    '[fleet.tiers.standard.pipeline]\nscorers = [{ name = "kv_cost" }]\npicker = "random"\n',
])
def test_an_unknown_name_is_a_config_error_at_start_up(tmp_path, toml):
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    with pytest.raises(ConfigError, match="unknown routing"):
        load_config(cfg, env={})


def test_a_registered_scorer_is_usable_by_name():
    class Prefer:
        def __init__(self, name):
            self.name = name

        def score(self, ctx, candidates):
            return {c.name: (1.0 if c.name == self.name else 0.0) for c in candidates}

    register_scorer("prefer_r2", lambda config: Prefer("r2"))
    router = Router("pinned", pipeline=PipelineSpec(scorers=[WeightedScorer("prefer_r2")]))
    assert {router.pick(RouteRequest(), replicas([0, 0, 9])).replica.name for _ in range(3)} == {"r2"}


def test_adapter_affinity_prefers_resident_then_a_free_slot_and_composes_with_load():
    router = Router("adapters", pipeline=PipelineSpec(scorers=[WeightedScorer("adapter_affinity", 1.5),
                                                               WeightedScorer("load")]))
    assert router.scores_adapters and not Router("cache_aware").scores_adapters
    affinity = {"r0": 0.0, "r1": 0.5, "r2": 1.0}   # must evict, free slot, resident
    assert router.pick(RouteRequest(adapter_affinity=affinity), replicas([0, 0, 0])).replica.name == "r2"
    # A busy resident replica loses to an idle one with a free slot, never to one that must evict.
    assert router.pick(RouteRequest(adapter_affinity=affinity), replicas([0, 0, 9])).replica.name == "r1"
    assert router.pick(RouteRequest(adapter_affinity={"r0": 0.0, "r1": 1.0}), replicas([0, 9])).replica.name == "r1"
    # Base-model requests: every replica scores the same, load decides.
    assert router.pick(RouteRequest(), replicas([4, 1, 3])).replica.name == "r1"
