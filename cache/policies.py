"""Routing policies as registered parts (the llm-d shape): filters, scorers and pickers are
registered by name, and a policy is a `PipelineSpec` composing them. The four built-in
policies are presets of this registry; a tier may compose its own in the TOML config:

    [fleet.tiers.standard.pipeline]
    filters = ["hotspot"]
    scorers = [{ name = "kv_cost", weight = 1.0 }, { name = "load", weight = 2.0 }]
    picker = "max_score"

A new policy part is a class with `filter` / `score` / `pick` plus one `register_*` call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec

from .scorers import (
    AdapterAffinityScorer, ConsistentHashScorer, EvictionScorer, Filter, HotspotFilter, KVCostScorer, LoadScorer,
    MaxScorePicker, Picker, PrefixCacheScorer, RoundRobinPicker, Scorer, SessionAffinityScorer, ShareFilter,
    SpeculationFilter,
)

# What a part keys on: "tokens" parts make the gateway tokenize and hash the prompt; a pipeline
# with a "session" part falls back to its `fallback` preset for requests without a session id.
Needs = Literal["tokens", "session", "nothing"]


# adapter_aware's adapter_affinity weight, in kv_cost's units (overlap_weight per block of prefill):
# a resident adapter beats one that must unload another by this many blocks at overlap_weight 1.
ADAPTER_AFFINITY_WEIGHT = 64.0


class UnknownPolicy(ValueError):
    """A policy, filter, scorer or picker name that is not registered."""


class RouterConfig(msgspec.Struct, frozen=True):
    """Knobs the built-in parts read (see cache/scorers.py for each one's meaning)."""
    policy: str = "cache_aware"
    overlap_weight: float | None = None  # None: 1 + 1 / (replicas - 1) (KVCostScorer)
    queued_request_blocks: float = 2.0
    spill_factor: float = 2.0
    spill_slack: float = 2.5
    share_factor: float = 1.15
    share_keep_blocks: int = 16
    share_keep_tail_blocks: int = 2
    share_spread_fraction: float = 0.3
    share_seed_fraction: float = 0.85
    share_seed_slack: float = 8.0
    share_slack: float = 4.0
    pending_weight: float = 0.25
    share_weight: float = 4.0
    speculate_max_temperature: float = 0.0
    default_temperature: float = 1.0


class WeightedScorer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    weight: float = 1.0


class PipelineSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """filters -> weighted scorers -> picker, by registered name."""
    filters: list[str] = []
    scorers: list[WeightedScorer] = []
    picker: str = "max_score"
    fallback: str | None = None  # preset used when a session-keyed pipeline sees no session id


class _Part(msgspec.Struct, frozen=True):
    factory: Callable[[RouterConfig], object]
    needs: Needs = "nothing"


FILTERS: dict[str, _Part] = {}
SCORERS: dict[str, _Part] = {}
PICKERS: dict[str, _Part] = {}
PRESETS: dict[str, PipelineSpec] = {}


def register_filter(name: str, factory: Callable[[RouterConfig], Filter], needs: Needs = "nothing") -> None:
    FILTERS[name] = _Part(factory, needs)


def register_scorer(name: str, factory: Callable[[RouterConfig], Scorer], needs: Needs = "nothing") -> None:
    SCORERS[name] = _Part(factory, needs)


def register_picker(name: str, factory: Callable[[RouterConfig], Picker], needs: Needs = "nothing") -> None:
    PICKERS[name] = _Part(factory, needs)


def register_preset(name: str, spec: PipelineSpec) -> None:
    PRESETS[name] = spec


def _lookup(table: dict[str, _Part], kind: str, name: str) -> _Part:
    try:
        return table[name]
    except KeyError:
        raise UnknownPolicy(f"unknown routing {kind} {name!r}; choose one of {', '.join(sorted(table))}") from None


def preset(name: str) -> PipelineSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPolicy(f"unknown routing policy {name!r}; choose one of {', '.join(PRESETS)}") from None


class BuiltParts(msgspec.Struct):
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    picker: Picker
    needs: set[str]


def build_parts(spec: PipelineSpec, config: RouterConfig) -> BuiltParts:
    """Instantiate a pipeline's parts; raises UnknownPolicy for a name that is not registered."""
    filters = [_lookup(FILTERS, "filter", n) for n in spec.filters]
    scorers = [(_lookup(SCORERS, "scorer", s.name), s.weight) for s in spec.scorers]
    picker = _lookup(PICKERS, "picker", spec.picker)
    needs = {p.needs for p in filters} | {p.needs for p, _ in scorers} | {picker.needs}
    return BuiltParts(filters=[p.factory(config) for p in filters],
                      scorers=[(p.factory(config), w) for p, w in scorers],
                      picker=picker.factory(config), needs=needs - {"nothing"})


register_filter("hotspot", lambda c: HotspotFilter(c.spill_factor, c.spill_slack))
register_filter("share", lambda c: ShareFilter(c.share_factor, c.share_keep_blocks, c.share_slack,
                                                c.share_keep_tail_blocks, c.share_spread_fraction,
                                                c.share_seed_fraction, c.share_seed_slack))
register_filter("speculation", lambda c: SpeculationFilter(c.speculate_max_temperature, c.default_temperature))
register_scorer("kv_cost", lambda c: KVCostScorer(c.overlap_weight, c.queued_request_blocks, c.pending_weight,
                                                  c.share_weight), needs="tokens")
register_scorer("prefix_cache", lambda c: PrefixCacheScorer(), needs="tokens")
register_scorer("load", lambda c: LoadScorer())
register_scorer("eviction", lambda c: EvictionScorer(), needs="tokens")
register_scorer("consistent_hash", lambda c: ConsistentHashScorer(), needs="tokens")
register_scorer("session_affinity", lambda c: SessionAffinityScorer(), needs="session")
register_scorer("adapter_affinity", lambda c: AdapterAffinityScorer())
register_picker("max_score", lambda c: MaxScorePicker())
register_picker("round_robin", lambda c: RoundRobinPicker())

register_preset("round_robin", PipelineSpec(picker="round_robin"))
register_preset("least_loaded", PipelineSpec(scorers=[WeightedScorer("load")]))
register_preset("session", PipelineSpec(scorers=[WeightedScorer("session_affinity")], fallback="least_loaded"))
register_preset("cache_aware", PipelineSpec(filters=["hotspot", "share"], scorers=[WeightedScorer("kv_cost")]))
register_preset("consistent_hash", PipelineSpec(scorers=[WeightedScorer("consistent_hash")]))
# Opt-in: cache_aware that also counts the cached blocks a pick would evict (docs/routing.md).
register_preset("cache_aware_evict", PipelineSpec(filters=["hotspot", "share"],
                                                  scorers=[WeightedScorer("kv_cost"), WeightedScorer("eviction")]))
# LoRA adapters placed on demand: cache_aware plus the adapter's affinity (resident > free slot >
# must unload one), in blocks of prefill a load is worth (tuned on the simulator, docs/routing.md).
register_preset("adapter_aware", PipelineSpec(filters=["hotspot", "share"],
                                              scorers=[WeightedScorer("kv_cost"),
                                                       WeightedScorer("adapter_affinity", ADAPTER_AFFINITY_WEIGHT)]))
# A fast tier that also reaches plain replicas (`fleet.tiers.fast.plain_tier`): each request goes
# where it decodes fastest, then by cache_aware's cost (docs/routing.md#speculation).
register_preset("speculation_aware", PipelineSpec(filters=["speculation", "hotspot", "share"],
                                                  scorers=[WeightedScorer("kv_cost")]))
