"""Routing building blocks in the llm-d EPP shape: filters -> weighted scorers -> picker.

A filter drops candidates; a scorer gives each remaining candidate a number
(higher is better); the picker chooses from the weighted sum. A new policy is
a new combination of these, not a new branch in the router.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from .blocks import BlockHash


@runtime_checkable
class Candidate(Protocol):
    """A replica as routing sees it (serving.Replica satisfies this)."""

    name: str
    inflight: int  # requests in flight through this gateway
    num_waiting: float  # scraped vllm:num_requests_waiting
    num_running: float  # scraped vllm:num_requests_running
    kv_capacity_blocks: int | None
    speculative: bool  # its engine runs speculative decoding


def load_of(c: Candidate) -> float:
    # The gateway's own in-flight count is fresh; the scraped engine counts lag
    # by a scrape interval but include other gateways' traffic. Take the larger.
    return max(float(c.inflight), c.num_waiting + c.num_running)


class RouteRequest(msgspec.Struct):
    token_ids: list[int] | None = None
    packed_ids: bytes | None = None  # cache.blocks.pack_tokens(token_ids), when the caller packed them
    block_hashes: list[BlockHash] | None = None
    session_id: str | None = None
    # vLLM's per-block extra hash keys (cache.blocks.lora_extra_keys for a LoRA request): the
    # engine caches an adapter's blocks under other hashes than the base model's.
    extra_keys: tuple | None = None
    # A LoRA adapter request: per replica, 1 where its version is resident, 0.5 where a slot is
    # free to load it, 0 where loading it means unloading another adapter (the gateway's view).
    adapter_affinity: dict[str, float] | None = None
    temperature: float | None = None  # the request's sampling temperature; None = the engine's default


class RouteContext(msgspec.Struct):
    """Everything scorers may read about one routing decision."""

    request: RouteRequest
    block_hashes: list[BlockHash]
    block_size: int
    matches: dict[str, int]  # replica -> cached leading blocks (from the prefix index)
    loads: dict[str, float]
    recent: dict[str, float] = {}  # replica -> decayed count of this router's recent picks
    pending: dict[str, float] = {}  # replica -> prefill blocks routed there, first token not back yet
    index: Any = None  # the router's PrefixIndexView (None without an index), for index-reading parts


class PrefixIndexView(Protocol):
    """What scorers may ask the prefix index beyond `matches` (cache.PrefixIndex satisfies it)."""

    def holders(self, block_hash: BlockHash) -> int: ...

    def eviction_victims(self, replica: str, new_blocks: int, keep: Collection[BlockHash] = ()) -> list[BlockHash]: ...


class RecentPicks:
    """Exponentially decayed count of picks per replica, half-life ``half_life_per_replica``
    picks per replica. In-flight load is ~0 everywhere on a quiet fleet, so it cannot tell
    where a *new* prefix should go; this long-memory signal can, and placing new prefixes on
    the least-picked replica keeps request shares even (instead of balls-into-bins)."""

    def __init__(self, half_life_per_replica: float = 32.0) -> None:
        self.half_life_per_replica = half_life_per_replica
        self._counts: dict[str, float] = {}
        self._weight = 1.0  # grows instead of decaying every count: one multiply per pick

    def add(self, name: str, replicas: int) -> None:
        self._counts[name] = self._counts.get(name, 0.0) + self._weight
        self._weight *= 2.0 ** (1.0 / (self.half_life_per_replica * max(1, replicas)))
        if self._weight > 1e100:
            self._counts = {k: v / self._weight for k, v in self._counts.items()}
            self._weight = 1.0

    def snapshot(self, names: Sequence[str]) -> dict[str, float]:
        return {n: self._counts.get(n, 0.0) / self._weight for n in names}


def rendezvous(key: str | bytes, name: str) -> int:
    """Highest-random-weight hash: stable, same on every gateway, moves ~1/N keys per change."""
    k = key.encode() if isinstance(key, str) else key
    return int.from_bytes(hashlib.blake2b(k + b"\x00" + name.encode(), digest_size=8).digest(), "big")


class Filter(Protocol):
    def filter(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[Candidate]: ...


class Scorer(Protocol):
    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> dict[str, float]: ...


class Picker(Protocol):
    def pick(self, ctx: RouteContext, candidates: Sequence[Candidate], scores: dict[str, float]) -> Candidate: ...


# -- filters ------------------------------------------------------------------
class HotspotFilter:
    """Drops replicas whose load exceeds ``max(factor * others_mean, mean + slack)``, where
    ``others_mean`` is the mean load of the other candidates: however hot a prefix is, its
    replica stops attracting work once it runs far above the rest of the fleet. Against the
    others' mean rather than the fleet's, the guard also works on two replicas (there the
    fleet's mean includes the hot replica itself, and twice it is the whole fleet's load): a
    replica is dropped once it carries more than twice the other's load and more than
    ``2 * slack`` requests more (with slack 2.5, 9 of 12 in flight, never 5 of 5). On a large
    fleet the two means are about equal."""

    def __init__(self, factor: float = 2.0, slack: float = 2.5) -> None:
        self.factor = factor
        self.slack = slack

    def filter(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[Candidate]:
        n = len(candidates)
        if n < 2:
            return list(candidates)
        total = sum(ctx.loads[c.name] for c in candidates)
        floor = total / n + self.slack
        kept = [c for c in candidates
                if ctx.loads[c.name] <= max(self.factor * (total - ctx.loads[c.name]) / (n - 1), floor)]
        return kept or list(candidates)


class ShareFilter:
    """Drops replicas that took more than ``factor`` times their fair share of this router's
    recent picks (`RecentPicks`), unless the replica saves at least ``keep_blocks`` blocks of
    prefill over the best replica within its share. The load guard above sees only requests
    in flight, ~0 on a quiet fleet; this one bounds each replica's share over time. A prefix
    everyone shares (one agent system prompt) then gets cached on several replicas instead of
    pulling every new session to the first one, while long contexts (an agent session's
    history, a tenant's long prefix) stay where they are cached.

    Once a replica within its share already holds at least ``spread_fraction`` of what the
    busy one holds, the shared head has spread; what the busy replica has beyond it is this
    request's own context (a session's last turns, a user's lines), and ``keep_tail_blocks``
    of it keep the request home: moving it recomputes that context and spreads nothing shared.

    A replica that has taken more than ``seed_fraction`` of all recent picks (and ``seed_slack``
    picks over the mean) keeps nothing by its savings while no replica within its share holds any
    of the request's prefix: a few long agent sessions that share one system prompt would
    otherwise all stay on the replica that cached it first while the others idle, since each one's
    context outweighs ``keep_blocks``. The one request moved gives the head a second home; from
    then on the tail rule keeps each session's own context where it is and sends new sessions to
    the replica within its share. A replica on a fleet of more than a few never takes that
    fraction of all picks.

    For a LoRA adapter request, a replica that holds the adapter where none within its share
    does stays too: moving it would load the adapter and unload another one that its own
    requests then load back, which the share of picks does not weigh (whether spreading an
    adapter is worth a load is the adapter_affinity scorer's call, made on every candidate).
    """

    def __init__(self, factor: float = 1.15, keep_blocks: int = 16, slack: float = 4.0,
                 keep_tail_blocks: int = 2, spread_fraction: float = 0.3, seed_fraction: float = 0.85,
                 seed_slack: float = 8.0) -> None:
        self.factor = factor
        self.keep_blocks = keep_blocks
        self.slack = slack  # picks: a young or small fleet is not "over its share" after one pick
        self.keep_tail_blocks = keep_tail_blocks
        self.spread_fraction = spread_fraction
        self.seed_fraction = seed_fraction  # 0: off
        self.seed_slack = seed_slack

    def filter(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[Candidate]:
        if self.factor <= 0 or len(candidates) < 2 or not ctx.recent:
            return list(candidates)
        mean = sum(ctx.recent.get(c.name, 0.0) for c in candidates) / len(candidates)
        limit = max(self.factor * mean, mean + self.slack)
        within = [c for c in candidates if ctx.recent.get(c.name, 0.0) <= limit]
        if not within or len(within) == len(candidates):
            return list(candidates)
        spread = max(ctx.matches.get(c.name, 0) for c in within)
        # Past this many picks, savings keep nothing home while the head is nowhere else.
        seeding = max(self.seed_fraction * mean * len(candidates), mean + self.seed_slack) \
            if self.seed_fraction > 0 and spread == 0 else float("inf")
        affinity = ctx.request.adapter_affinity  # a LoRA adapter request's
        held = max(affinity.get(c.name, 0.0) for c in within) if affinity else 0.0
        return [c for c in candidates if c in within
                or (ctx.recent.get(c.name, 0.0) <= seeding and self._saves_enough(ctx.matches.get(c.name, 0), spread))
                or (affinity and affinity.get(c.name, 0.0) > held)]

    def _saves_enough(self, cached: int, spread: int) -> bool:
        """A replica past its share, holding `cached` blocks, stays a candidate (`spread`: the most
        any replica within its share holds)."""
        tail = spread > 0 and spread >= self.spread_fraction * cached
        return cached - spread >= (self.keep_tail_blocks if tail else self.keep_blocks)


class SpeculationFilter:
    """Keeps the replicas on which the request decodes fastest: speculating ones for greedy
    requests, plain ones for sampled ones. Under sampling a draft token is accepted with the
    model's probability of it, so n-gram drafts are mostly rejected while each verify step still
    costs about two plain ones (docs/routing.md#speculation). A sampled request on a plain replica
    of the standard tier is served exactly as a standard request: never slower than that tier.
    A fleet with only one kind keeps them all."""

    def __init__(self, max_temperature: float = 0.0, default_temperature: float = 1.0) -> None:
        self.max_temperature = max_temperature  # at or below: drafts are worth verifying
        self.default_temperature = default_temperature  # what the engine samples with when unset

    def filter(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> list[Candidate]:
        spec = [c for c in candidates if c.speculative]
        plain = [c for c in candidates if not c.speculative]
        if not spec or not plain:
            return list(candidates)
        t = ctx.request.temperature
        return spec if (self.default_temperature if t is None else t) <= self.max_temperature else plain


# -- scorers ------------------------------------------------------------------
class PrefixCacheScorer:
    """Fraction of the request's full blocks already cached on the replica."""

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> dict[str, float]:
        n = len(ctx.block_hashes)
        return {c.name: (ctx.matches.get(c.name, 0) / n if n else 0.0) for c in candidates}


class LoadScorer:
    """1 for the least loaded candidate, falling linearly to 0 for the most loaded."""

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> dict[str, float]:
        hi = max((ctx.loads[c.name] for c in candidates), default=0.0)
        if hi <= 0:
            return {c.name: 1.0 for c in candidates}
        return {c.name: 1.0 - ctx.loads[c.name] / hi for c in candidates}


class KVCostScorer:
    """NVIDIA Dynamo's KV-router cost, negated so that higher is better:

        cost = overlap_weight * prefill_blocks + queued_request_blocks * load
               + pending_weight * pending_blocks

    ``prefill_blocks`` = the request's blocks not cached on the replica (the work
    a prefix hit saves); ``load`` = requests running + waiting there, each
    counted as ``queued_request_blocks`` blocks of decode work ahead;
    ``pending_blocks`` = prefill this router sent there whose first token has not
    come back: a new request waits for what is left of it, on average about half
    (pending_weight 0.5), so two requests with one hot prefix arriving together split.
    ``share_weight * max(0, recent_picks - mean) / max(mean, 1)`` is added too: a replica
    already taking more than its share needs a real saving, not a one-block header, to win.

    ``overlap_weight`` None (the default) is ``1 + 1 / (replicas - 1)``: 2 on two replicas,
    1.33 on four, near 1 on a large fleet. On two engines under KV pressure, weighing prefill
    twice keeps a tenant on its warm engine while its previous request still prefills there;
    on a large fleet the same weight concentrates load on the replicas of popular prefixes and
    caches less (measured: docs/routing.md#the-cache_aware-cost).
    """

    def __init__(self, overlap_weight: float | None = None, queued_request_blocks: float = 2.0,
                 pending_weight: float = 0.25, share_weight: float = 4.0) -> None:
        self.overlap_weight = overlap_weight
        self.queued_request_blocks = queued_request_blocks
        self.pending_weight = pending_weight
        self.share_weight = share_weight
        self.share_floor = 1.0  # picks: below one pick per replica, shares are noise

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> dict[str, float]:
        # Partial last block is always computed: count it so short prompts still weigh load.
        total = len(ctx.block_hashes) + 1
        out = {}
        mean = sum(ctx.recent.values()) / len(ctx.recent) if ctx.recent and self.share_weight else 0.0
        overlap = self.overlap_weight
        if overlap is None:  # the tier's replicas, before any filter dropped some
            overlap = 1.0 + 1.0 / max(1, len(ctx.loads) - 1)
        for c in candidates:
            prefill = total - ctx.matches.get(c.name, 0)
            out[c.name] = -(overlap * prefill + self.queued_request_blocks * ctx.loads[c.name]
                            + self.pending_weight * ctx.pending.get(c.name, 0.0)
                            + (self.share_weight * max(0.0, ctx.recent.get(c.name, 0.0) - mean)
                               / max(mean, self.share_floor) if mean > 0 else 0.0))
        return out


class EvictionScorer:
    """Minus the cached blocks a pick would destroy: under KV pressure, prefilling a request's
    missing blocks on a replica whose cache is full evicts that replica's least recently used
    blocks (predicted from the index's LRU and the replica's KV capacity), and a victim no other
    replica holds is a future hit lost. Sending a request cold to a less loaded replica then
    costs more than its own prefill: it pushes another prefix out. 0 everywhere while caches
    have room, so it changes nothing until they fill."""

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> dict[str, float]:
        index: PrefixIndexView | None = ctx.index
        n = len(ctx.block_hashes)
        if index is None or not n:
            return {c.name: 0.0 for c in candidates}
        keep = set(ctx.block_hashes)
        out = {}
        for c in candidates:
            victims = index.eviction_victims(c.name, n - ctx.matches.get(c.name, 0), keep)
            out[c.name] = -float(sum(1 for h in victims if index.holders(h) <= 1))
        return out


class ConsistentHashScorer:
    """Consistent hashing of the prompt's first block (rendezvous): 1 for the prefix's home
    replica, else 0. A baseline: every request of a prefix goes home however loaded home is,
    which is what makes a popular prefix's replica a hot spot."""

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> dict[str, float]:
        if not ctx.block_hashes or not candidates:
            return {c.name: 0.0 for c in candidates}
        h = ctx.block_hashes[0]
        key = h if isinstance(h, bytes) else str(h)
        home = max(candidates, key=lambda c: rendezvous(key, c.name))
        return {c.name: (1.0 if c is home else 0.0) for c in candidates}


class SessionAffinityScorer:
    """Rendezvous hash of the session id: 1 for the session's home replica, else 0."""

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> dict[str, float]:
        sid = ctx.request.session_id
        if not sid or not candidates:
            return {c.name: 0.0 for c in candidates}
        home = max(candidates, key=lambda c: rendezvous(sid, c.name))
        return {c.name: (1.0 if c is home else 0.0) for c in candidates}


def adapter_affinity(resident: bool, loaded: int, max_loras: int) -> float:
    """A replica's affinity for a LoRA adapter request: 1 where the adapter is resident, 0.5
    where one of its `max_loras` slots is free (`loaded` are taken), 0 where loading it means
    unloading another adapter. The gateway (serving.Adapters) and the simulator both use it."""
    if resident:
        return 1.0
    return 0.5 if loaded < max_loras else 0.0


class AdapterAffinityScorer:
    """For a LoRA adapter request: resident (1) > free adapter slot (0.5) > must unload one (0);
    every replica scores 0 for a base-model request. Weighted against cache and load scorers, it
    decides when spreading an adapter to one more replica is worth its load."""

    def score(self, ctx: RouteContext, candidates: Sequence[Candidate]) -> dict[str, float]:
        affinity = ctx.request.adapter_affinity or {}
        return {c.name: affinity.get(c.name, 0.0) for c in candidates}


class AdapterCandidacy(msgspec.Struct):
    """Where a LoRA adapter request may go (`adapter_candidacy`), and what to load first."""

    candidates: list[Any]                       # route among these now (empty: load first)
    affinity: dict[str, float] | None = None    # RouteRequest.adapter_affinity, for AdapterAffinityScorer
    load_on: list[Any] = []                     # held by no candidate: load it on one of these (best
                                                # first), the request waiting, then route again
    spread_to: Any = None                       # every holder busy: load it here too, in the background


def adapter_candidacy(holders: Sequence[Any], routable: Sequence[Any], affinity: Callable[[Any], float], *,
                      weighs_affinity: bool, room: bool, busy: bool, tier: str | None = None) -> AdapterCandidacy:
    """The one rule for where a request for a LoRA adapter version may go, for the gateway
    (gateway/exchange.py) and the fleet simulator (cache/simulator.py) alike.

    `holders`: the replicas it may go to that hold the version; `routable`: every replica it may
    go to (of `tier`, when given, where new copies go); `affinity(replica)`: adapter_affinity;
    `weighs_affinity`: the policy has the adapter_affinity scorer; `room`: the version is on fewer
    replicas than its placement allows; `busy`: every replica holding it has a request in flight.

    A policy that weighs affinity, while there is room, gets the holders and every other routable
    replica with their affinity: the pick decides where one more copy is worth its load. Otherwise
    the holders, and with room and every holder busy, one more copy where a slot is free. Held
    nowhere: loaded first where a slot is free, else on the least loaded replica."""
    if weighs_affinity and room:
        candidates = list(holders) + [r for r in routable if r not in holders and (tier is None or r.tier == tier)]
        if candidates:
            return AdapterCandidacy(candidates, {r.name: affinity(r) for r in candidates})
    elif holders:
        spread_to = None
        if room and busy:
            spread_to = next((r for r in routable if r not in holders and affinity(r) > 0), None)
        return AdapterCandidacy(list(holders), spread_to=spread_to)
    return AdapterCandidacy([], load_on=sorted(routable, key=lambda r: (-affinity(r), r.inflight)))


# -- pickers ------------------------------------------------------------------
class MaxScorePicker:
    """Highest score; ties go to the lowest load, then to the replica this router picked
    least lately (`RecentPicks`), then to a rendezvous hash of the prefix's first block (or
    session), so different prefixes spread over the tied replicas."""

    def __init__(self) -> None:
        self._rotation = itertools.count()

    def pick(self, ctx: RouteContext, candidates: Sequence[Candidate], scores: dict[str, float]) -> Candidate:
        best = max(scores[c.name] for c in candidates)
        tied = [c for c in candidates if scores[c.name] >= best - 1e-9]
        if len(tied) == 1:
            return tied[0]
        low = min(ctx.loads[c.name] for c in tied)
        tied = [c for c in tied if ctx.loads[c.name] <= low]
        if len(tied) == 1:
            return tied[0]
        if ctx.recent:
            least = min(ctx.recent.get(c.name, 0.0) for c in tied)
            tied = [c for c in tied if ctx.recent.get(c.name, 0.0) <= least + 1e-9]
            if len(tied) == 1:
                return tied[0]
        key: str | bytes | None = ctx.request.session_id
        if key is None and ctx.block_hashes:
            h = ctx.block_hashes[0]
            key = h if isinstance(h, bytes) else str(h)
        if key is None:  # nothing to be sticky about: rotate
            return tied[next(self._rotation) % len(tied)]
        return max(tied, key=lambda c: rendezvous(key, c.name))


class RoundRobinPicker:
    def __init__(self) -> None:
        self._next = itertools.count()

    def pick(self, ctx: RouteContext, candidates: Sequence[Candidate], scores: dict[str, float]) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.name)
        return ordered[next(self._next) % len(ordered)]
