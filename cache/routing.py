"""Routing policies: which replica serves a request.

`Router(policy, index, ...)` runs a tier's pipeline of registered parts (cache/policies.py,
cache/scorers.py): the presets `round_robin`, `least_loaded`, `session` and `cache_aware`
(Dynamo's KV-router cost with hot-spot and share guards). Only policies that key on tokens make
the gateway tokenize. The cost model and its guards: docs/routing.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from .blocks import BlockHash, BlockHasher, BlockHashConfig
from .policies import (  # noqa: F401  (RouterConfig, UnknownPolicy re-exported)
    PRESETS, PipelineSpec, RouterConfig, UnknownPolicy, build_parts, preset,  # noqa: F401
)
from .scorers import (
    AdapterAffinityScorer, Candidate, Filter, Picker, RecentPicks, RouteContext, RouteRequest, Scorer, load_of,
)

POLICIES = tuple(PRESETS)  # the built-in presets; a tier may also compose its own PipelineSpec


class NoCandidates(RuntimeError):
    """No replica to route to."""


class RouteDecision(msgspec.Struct):
    replica: Any  # the chosen Candidate
    predicted_cached_tokens: int
    block_hashes: list[BlockHash]
    policy: str
    scores: dict[str, float] = {}
    pending_blocks: int = 0  # prefill this request adds to its replica until its first token
    recorded: bool = False   # the index knows its blocks are on their way to the replica


class PendingPrefill:
    """Blocks of prefill routed to each replica whose first token is not back yet: work queued
    there that the engine's own counters do not show yet (read by the kv_cost scorer)."""

    def __init__(self) -> None:
        self.blocks: dict[str, float] = {}

    def snapshot(self, candidates: Sequence[Candidate]) -> dict[str, float]:
        out = {}
        for c in candidates:
            if c.inflight <= 0 and self.blocks.get(c.name):
                self.blocks[c.name] = 0.0  # nothing in flight there: nothing can be pending (self-healing)
            out[c.name] = self.blocks.get(c.name, 0.0)
        return out

    def add(self, decision: RouteDecision) -> None:
        if decision.pending_blocks:
            name = decision.replica.name
            self.blocks[name] = self.blocks.get(name, 0.0) + decision.pending_blocks

    def settle(self, decision: RouteDecision) -> None:
        if decision.pending_blocks:
            name = decision.replica.name
            self.blocks[name] = max(0.0, self.blocks.get(name, 0.0) - decision.pending_blocks)
            decision.pending_blocks = 0


class Policy:
    """filters -> weighted scorers -> picker."""

    def __init__(self, name: str, filters: Sequence[Filter], scorers: Sequence[tuple[Scorer, float]],
                 picker: Picker, needs_tokens: bool = False, fallback: "Policy | None" = None,
                 needs_session: bool = False) -> None:
        self.name = name
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.picker = picker
        self.needs_tokens = needs_tokens
        self.needs_session = needs_session
        self.fallback = fallback  # used when a session-keyed policy sees a request without a session

    def choose(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> tuple[Candidate, dict[str, float]]:
        if self.needs_session and not ctx.request.session_id and self.fallback is not None:
            return self.fallback.choose(ctx, candidates)
        kept = list(candidates)
        for f in self.filters:
            kept = f.filter(ctx, kept)
        scores = {c.name: 0.0 for c in kept}
        for scorer, weight in self.scorers:
            for name, s in scorer.score(ctx, kept).items():
                scores[name] += weight * s
        return self.picker.pick(ctx, kept, scores), scores


def build_policy(name: str, config: RouterConfig = RouterConfig(), spec: PipelineSpec | None = None) -> Policy:
    """The preset `name`, or the pipeline `spec` composed from registered parts (labelled `name`)."""
    spec = spec if spec is not None else preset(name)
    parts = build_parts(spec, config)
    fallback = build_policy(spec.fallback, config) if spec.fallback else None
    return Policy(name, parts.filters, parts.scorers, parts.picker, needs_tokens="tokens" in parts.needs
                  or bool(fallback and fallback.needs_tokens), fallback=fallback,
                  needs_session="session" in parts.needs)


class Router:
    """Picks a replica per request and teaches the prefix index where prefixes went.

    A decision follows its request's lifecycle (each step idempotent):

    >>> router = Router("cache_aware", index, block_size=32)
    >>> if router.needs_tokens: req = RouteRequest(token_ids=tok.encode(prompt))
    >>> decision = router.pick(req, replicas)   # counts as a recent pick, its prefill as pending
    >>> router.sent(decision)          # on its way: the index learns where its prefix goes
    >>> router.first_token(decision)   # prefill over: no longer work queued on the replica
    >>> router.done(decision)          # ended (also settles a request that never got a token)
    """

    def __init__(self, policy: str | Policy = "cache_aware", index: Any = None, block_size: int = 32,
                 hasher: BlockHasher | None = None, config: RouterConfig = RouterConfig(),
                 pipeline: PipelineSpec | None = None) -> None:
        self.policy = policy if isinstance(policy, Policy) else build_policy(policy, config, pipeline)
        self.index = index  # PrefixIndex | SharedPrefixIndex | None
        self.hasher = hasher or BlockHasher(BlockHashConfig(block_size=block_size))
        self.block_size = self.hasher.block_size
        self._known_capacity: dict[str, int] = {}
        self.recent = RecentPicks()
        self.pending = PendingPrefill()

    @property
    def needs_tokens(self) -> bool:
        return self.policy.needs_tokens

    @property
    def scores_adapters(self) -> bool:
        """The policy weighs adapter affinity: replicas without the adapter may be candidates."""
        return any(isinstance(s, AdapterAffinityScorer) for s, _ in self.policy.scorers)

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision:
        if not candidates:
            raise NoCandidates("no replica available")
        hashes: list[BlockHash] = []
        matches: dict[str, int] = {}
        if self.policy.needs_tokens:
            if request.block_hashes is not None:
                hashes = list(request.block_hashes)
            elif request.token_ids is not None:
                hashes = self.hasher.hashes(request.token_ids, request.packed_ids, request.extra_keys)
            if self.index is not None:
                self._sync_capacity(candidates)
                if hashes:
                    matches = self.index.match(hashes)
        ctx = RouteContext(request=request, block_hashes=hashes, block_size=self.block_size,
                           matches=matches, loads={c.name: load_of(c) for c in candidates},
                           recent=self.recent.snapshot([c.name for c in candidates]),
                           pending=self.pending.snapshot(candidates), index=self.index)
        chosen, scores = self.policy.choose(ctx, candidates)
        self.recent.add(chosen.name, len(candidates))
        decision = RouteDecision(replica=chosen, predicted_cached_tokens=matches.get(chosen.name, 0) * self.block_size,
                                 block_hashes=hashes, policy=self.policy.name, scores=scores,
                                 pending_blocks=len(hashes) + 1 - matches.get(chosen.name, 0) if hashes else 0)
        self.pending.add(decision)
        return decision

    def sent(self, decision: RouteDecision) -> None:
        """The request is on its way to its replica: record (approximately) that its blocks will
        live there, so requests routed meanwhile already see the prefix."""
        if decision.recorded:
            return
        decision.recorded = True
        if self.index is not None and decision.block_hashes:
            self.index.record(decision.replica.name, decision.block_hashes)

    def first_token(self, decision: RouteDecision) -> None:
        """Its prefill is over: its blocks stop counting as work queued on the replica."""
        self.pending.settle(decision)

    def done(self, decision: RouteDecision) -> None:
        """It ended, however (answered, failed, abandoned): nothing of it is pending any more."""
        self.pending.settle(decision)

    def _sync_capacity(self, candidates: Sequence[Candidate]) -> None:
        for c in candidates:
            cap = c.kv_capacity_blocks
            if cap and self._known_capacity.get(c.name) != cap:
                self._known_capacity[c.name] = cap
                self.index.set_capacity(c.name, cap)
