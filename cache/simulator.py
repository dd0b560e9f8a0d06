"""Discrete-event fleet simulator: the gateway's routing code on N modelled vLLM replicas.

Real: `cache.Router`, `PrefixIndex`, `BlockHasher`, the served model's tokenizer and the load
tester's seeded workloads. Modelled: each replica's continuous batching, step time and LRU KV
cache, and its LoRA adapter slots (a session's `adapter`: loaded on demand, least recently used
unloaded). `cached / oracle` is the share of achievable prefix reuse a policy captures. Method and
model: docs/routing.md#simulator.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import Any, Literal, NamedTuple, Protocol

import msgspec

from .blocks import BlockHash, BlockHashConfig, BlockHasher, lora_extra_keys
from .prefix_index import PrefixIndex, PrefixIndexConfig
from .routing import Router, RouterConfig
from .scorers import RouteRequest, adapter_affinity, adapter_candidacy
from .tokenizer import Tokenizer

# Filler words for simulated assistant answers; ~0.45 words per demo-model token.
_ANSWER_WORDS = "ok so the result is done next step we will check cache and tokens then reply".split()
_ANSWER_WORDS_PER_TOKEN = 0.45


class EngineModel(msgspec.Struct, frozen=True, kw_only=True):
    """Cost model of one replica. Defaults: roughly an 8B model on one modern GPU."""

    prefill_s_per_token: float = 5e-5
    # Prefill of the new tokens still attends over the cached prefix: cost per cached token read.
    # Small on a GPU; on CPU engines a cached prompt still costs a fair share of an uncached one.
    context_s_per_token: float = 0.0
    step_s: float = 0.008  # fixed cost of one engine step (kernel launches, sampling)
    decode_s_per_seq: float = 2e-4  # extra step time per running sequence
    max_running: int = 64
    max_batched_tokens: int = 8192  # prefill tokens admitted per step (first request always fits)
    kv_capacity_blocks: int = 8192
    kv_events: bool = True  # False: the index learns only from Router.observe (approximate)
    # LoRA: adapters resident at once (vLLM's --max-loras, fleet.lora.max_loras), and the time one
    # load (and the unload that empties a slot for it) takes; a request for an adapter not resident
    # waits for its load, loads run one at a time (benchmarks/lora_load.py measures a demo engine's).
    max_loras: int = 2
    lora_load_s: float = 0.1
    lora_unload_s: float = 0.0


class SimConfig(msgspec.Struct, kw_only=True):
    policy: str = "cache_aware"
    replicas: int = 4
    engine: EngineModel = EngineModel()
    engines: list[EngineModel] | None = None  # per replica, overrides `engine`
    router: RouterConfig = RouterConfig()
    block_size: int = 32
    hash_seed: str | None = "0"
    # Load model, as loadtest: "poisson" = sessions arrive at `rate`/s; "concurrency" = closed loop.
    arrival: Literal["poisson", "concurrency"] = "poisson"
    rate: float = 10.0
    burstiness: float = 1.0
    concurrency: int = 8
    requests: int = 1000  # turns sent (a multi-turn session sends one per turn)
    phases: list[int] = []  # split `requests` into successive load-test phases (sizes); [] = one
    # Every phase after the first starts with empty engine caches (and oracle), as when the real
    # benchmark resets each engine's prefix cache between phases (/reset_prefix_cache).
    cold_phases: bool = False
    # The first `warmup_phases` of `phases` warm the fleet up and are left out of the results
    # (requests, cached tokens, loads, per-replica counts), as a load test's warm-up phase is.
    warmup_phases: int = 0
    seed: int = 0
    cache_salt: str = ""  # loadtest CacheSalt.value in "prefix" mode: same prompts as a salted run
    session_ids: bool = False  # send the session id (x-session-id); the load tester does not
    scrape_interval_s: float = 2.0  # engine gauges (running/waiting) the router sees are this stale
    kv_event_delay_s: float = 0.0
    # The gateway calls Router.observe once the upstream POST has answered (response headers),
    # not at pick time: concurrent requests in between do not see the prefix on its replica.
    observe_delay_s: float = 0.0
    # LoRA placement on demand (an adapter's `placement = {replicas = N}`): on up to this many
    # replicas at once; 0 = up to every replica.
    adapter_replicas: int = 0


class PolicyResult(msgspec.Struct, kw_only=True):
    policy: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    oracle_cached_tokens: int
    cached_ratio: float
    oracle_ratio: float  # oracle_cached_tokens / prompt_tokens
    ratio_to_oracle: float  # cached_tokens / oracle_cached_tokens
    ttft_p50_s: float
    ttft_p90_s: float
    e2e_p50_s: float
    throughput_rps: float
    throughput_tokens_s: float  # prompt + completion tokens per second
    duration_s: float
    requests_per_replica: dict[str, int]
    load_max_over_mean: float  # requests per replica
    busy_max_over_mean: float  # engine busy time per replica
    predicted_cached_tokens: int  # what the router's index predicted at dispatch
    evicted_blocks: int
    adapter_requests: int = 0  # requests for a LoRA adapter
    loads_per_1k: float = 0.0  # adapter loads per 1,000 requests (0 without adapters)
    unloads_per_1k: float = 0.0  # adapters unloaded to free a slot, per 1,000 requests


class ReplicaCounters(NamedTuple):
    """What a replica has counted so far; `minus` an earlier snapshot gives what came since."""

    served: int
    busy_s: float
    evicted: int
    loads: int
    unloads: int

    def minus(self, before: ReplicaCounters | None) -> ReplicaCounters:
        return self if before is None else ReplicaCounters(*(a - b for a, b in zip(self, before)))


class SimRequest:
    __slots__ = ("id", "session", "turn", "tokens", "hashes", "n_prompt", "n_out", "arrival", "replica",
                 "cached_blocks", "pinned", "anon_blocks", "first_token", "finish", "remaining", "done_cb",
                 "predicted", "oracle_blocks", "on_first_token", "adapter")

    def __init__(self, rid: int, session: str, turn: int, tokens: list[int], hashes: list[BlockHash],
                 n_out: int, arrival: float, adapter: str | None = None) -> None:
        self.id = rid
        self.adapter = adapter  # the LoRA adapter it runs with (None: the base model)
        self.session = session
        self.turn = turn
        self.tokens = tokens
        self.hashes = hashes
        self.n_prompt = len(tokens)
        self.n_out = max(1, n_out)
        self.arrival = arrival
        self.replica: SimReplica | None = None
        self.cached_blocks = 0
        self.pinned: list[BlockHash] = []
        self.anon_blocks = 0
        self.first_token: float | None = None
        self.finish: float | None = None
        self.remaining = self.n_out
        self.done_cb: Callable[[SimRequest, float], None] | None = None
        self.predicted = 0
        self.oracle_blocks = 0
        self.on_first_token: Callable[[], None] | None = None


class KVCache:
    """Block pool of one engine: pinned blocks (refcounted) + LRU of evictable cached blocks."""

    def __init__(self, capacity_blocks: int, on_store: Callable[[SimRequest, list[BlockHash]], None],
                 on_remove: Callable[[list[BlockHash]], None]) -> None:
        self.capacity = capacity_blocks
        self.pinned: dict[BlockHash, int] = {}
        self.free: OrderedDict[BlockHash, None] = OrderedDict()  # oldest first
        self.anon = 0  # blocks without a reusable hash (partial tail, decode)
        self.on_store = on_store
        self.on_remove = on_remove
        self.evicted = 0

    def used(self) -> int:
        return len(self.pinned) + self.anon

    def hit_blocks(self, hashes: Sequence[BlockHash], n_prompt: int, block_size: int) -> int:
        # vLLM recomputes at least the last prompt token, so a full hit stops one block short.
        limit = min(len(hashes), (n_prompt - 1) // block_size)
        n = 0
        while n < limit and (hashes[n] in self.pinned or hashes[n] in self.free):
            n += 1
        return n

    def allocate(self, req: SimRequest, block_size: int, force: bool = False) -> bool:
        """Pin the request's blocks, evicting LRU cached blocks; False if it does not fit now.

        `force` (an idle engine) admits a request even if it overcommits the pool, as vLLM
        would rather than hang; such requests are rare and only in tiny-capacity configs.
        """
        hit = self.hit_blocks(req.hashes, req.n_prompt, block_size)
        anon = math.ceil((req.n_prompt + req.n_out) / block_size) - len(req.hashes)
        fresh = [h for h in req.hashes if h not in self.pinned and h not in self.free]
        reused = [h for h in req.hashes if h in self.free]
        if not force and len(fresh) + anon + len(self.pinned) + self.anon + len(reused) > self.capacity:
            return False
        for h in reused:
            del self.free[h]
        removed: list[BlockHash] = []
        held = len(self.pinned) + self.anon + len(reused) + len(fresh) + anon
        while self.free and held + len(self.free) > self.capacity:
            removed.append(self.free.popitem(last=False)[0])
        if removed:
            self.evicted += len(removed)
            self.on_remove(removed)
        for h in req.hashes:
            self.pinned[h] = self.pinned.get(h, 0) + 1
        self.anon += anon
        req.pinned = list(req.hashes)
        req.anon_blocks = anon
        req.cached_blocks = hit
        if fresh:
            self.on_store(req, fresh)
        return True

    def clear(self) -> None:
        """Drop every cached block nobody holds (vLLM's reset_prefix_cache)."""
        if self.free:
            removed = list(self.free)
            self.free.clear()
            self.on_remove(removed)

    def release(self, req: SimRequest) -> None:
        self.anon -= req.anon_blocks
        # Freed tail-first (vLLM frees in reverse): the prefix head is evicted last.
        for h in reversed(req.pinned):
            n = self.pinned[h] - 1
            if n:
                self.pinned[h] = n
            else:
                del self.pinned[h]
                self.free[h] = None
        req.pinned = []
        req.anon_blocks = 0


class EngineHost(Protocol):
    """What a SimReplica runs on: a clock with timers, the block size, and where the blocks it
    stores and evicts are reported. FleetSimulator is one (simulated time, the router's index);
    serving.emulator's engines run on the event loop's clock and publish KV events."""

    config: Any  # .block_size, .scrape_interval_s

    @property
    def now(self) -> float: ...
    def schedule(self, at: float, fn: Callable[..., None], *args: Any) -> None: ...
    def blocks_stored(self, replica: "SimReplica", req: "SimRequest", hashes: list[BlockHash]) -> None: ...
    def blocks_removed(self, replica: "SimReplica", hashes: list[BlockHash]) -> None: ...


class SimReplica:
    """One modelled engine. Satisfies cache.Candidate (name, inflight, num_waiting, num_running,
    kv_capacity_blocks, speculative) so the real Router scores it like a serving.Replica."""

    def __init__(self, sim: EngineHost, name: str, model: EngineModel) -> None:
        self.sim = sim
        self.name = name
        self.model = model
        self.kv_capacity_blocks: int | None = model.kv_capacity_blocks
        self.inflight = 0
        self.speculative = False
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.cache = KVCache(model.kv_capacity_blocks, self._stored, self._removed)
        self.busy = False
        self.busy_s = 0.0
        self.served = 0
        self._version = 0
        self._plan: tuple[float, float, int, list[SimRequest]] | None = None  # start, step, k, admitted
        self._gauges = (0.0, 0.0)
        self._scraped_at = -math.inf
        # LoRA slots: resident adapters (least recently used first), this replica's requests per
        # adapter (an adapter with a request here is never unloaded), loads in progress.
        self.adapters: OrderedDict[str, None] = OrderedDict()
        self.adapter_requests: Counter[str] = Counter()
        self.loads = 0
        self.unloads = 0
        self._loaded_at: dict[str, float] = {}
        self._loader_free_at = 0.0
        self._no_slot: list[SimRequest] = []  # every slot holds an adapter with requests here

    # -- Candidate protocol: engine gauges as last scraped ---------------------------------------
    def _scrape(self) -> tuple[float, float]:
        now = self.sim.now
        if now - self._scraped_at >= self.sim.config.scrape_interval_s:
            self._gauges = (float(len(self.waiting)), float(len(self.running)))
            self._scraped_at = now
        return self._gauges

    @property
    def num_waiting(self) -> float:
        return self._scrape()[0]

    @property
    def num_running(self) -> float:
        return self._scrape()[1]

    # -- KV events -------------------------------------------------------------------------------
    def _stored(self, req: SimRequest, hashes: list[BlockHash]) -> None:
        self.sim.blocks_stored(self, req, hashes)

    def _removed(self, hashes: list[BlockHash]) -> None:
        self.sim.blocks_removed(self, hashes)

    # -- LoRA adapter slots ----------------------------------------------------------------------
    def affinity(self, adapter: str) -> float:
        """The gateway's adapter affinity for this replica (cache.scorers.adapter_affinity)."""
        return adapter_affinity(adapter in self.adapters, len(self.adapters), self.model.max_loras)

    def _adapter_ready(self, adapter: str) -> float | None:
        """When `adapter` is loaded here: now if resident, else after a load (queued behind this
        replica's other loads) that unloads the least recently used adapter without requests
        here when every slot is taken; None if each slot's adapter has requests here."""
        if adapter in self.adapters:
            self.adapters.move_to_end(adapter)
            return max(self.sim.now, self._loaded_at.get(adapter, 0.0))  # a load in progress is waited for
        unload_s = 0.0
        if len(self.adapters) >= self.model.max_loras:
            victim = next((a for a in self.adapters if not self.adapter_requests[a]), None)
            if victim is None:
                return None
            del self.adapters[victim]
            self._loaded_at.pop(victim, None)
            self.unloads += 1
            unload_s = self.model.lora_unload_s
        self.adapters[adapter] = None
        self.loads += 1
        self._loader_free_at = max(self.sim.now, self._loader_free_at) + unload_s + self.model.lora_load_s
        self._loaded_at[adapter] = self._loader_free_at
        return self._loader_free_at

    def counters(self) -> ReplicaCounters:
        return ReplicaCounters(self.served, self.busy_s, self.cache.evicted, self.loads, self.unloads)

    def preload(self, adapter: str) -> None:
        """Load `adapter` into a free slot with no request waiting for it (the gateway's spread)."""
        self._adapter_ready(adapter)

    def _admit_adapter_request(self, req: SimRequest) -> bool:
        """Queue `req` once its adapter is loaded; False if no slot can take the adapter yet."""
        ready = self._adapter_ready(req.adapter)
        if ready is None:
            return False
        if ready > self.sim.now:
            self.sim.schedule(ready, self._enqueue, req)
        else:
            self.waiting.append(req)
        return True

    def _adapter_released(self, req: SimRequest) -> None:
        """`req` is over: its adapter's slot may be emptied, so requests waiting for one try again."""
        self.adapter_requests[req.adapter] -= 1
        if self._no_slot and not self.adapter_requests[req.adapter]:
            waiting, self._no_slot = self._no_slot, []
            self._no_slot = [r for r in waiting if not self._admit_adapter_request(r)]

    # -- engine loop -----------------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        self.inflight += 1
        if req.adapter is not None:
            self.adapter_requests[req.adapter] += 1
            ready = self._adapter_ready(req.adapter)
            if ready is None:
                self._no_slot.append(req)
                return
            if ready > self.sim.now:
                self.sim.schedule(ready, self._enqueue, req)
                return
        self._enqueue(req)

    def _enqueue(self, req: SimRequest) -> None:
        self.waiting.append(req)
        if not self.busy:
            self._next_step()
        elif self._plan is not None and self._plan[2] > 1:
            self._cut_plan()

    def _cut_plan(self) -> None:
        """A request arrived during a multi-step decode run: end the run at the next step boundary."""
        start, step, k, admitted = self._plan
        done = int((self.sim.now - start) / step) + 1
        if done < k:
            self._plan = (start, step, done, admitted)
            self._version += 1
            self.sim.schedule(start + done * step, self._step_end, self._version)

    def _next_step(self) -> None:
        m = self.model
        bs = self.sim.config.block_size
        admitted: list[SimRequest] = []
        prefill = 0
        context = 0
        while self.waiting and len(self.running) + len(admitted) < m.max_running:
            req = self.waiting[0]
            hit = self.cache.hit_blocks(req.hashes, req.n_prompt, bs)
            uncached = req.n_prompt - hit * bs
            if admitted and prefill + uncached > m.max_batched_tokens:
                break
            idle = not admitted and not self.running
            if not self.cache.allocate(req, bs, force=idle):
                break
            self.waiting.pop(0)
            prefill += req.n_prompt - req.cached_blocks * bs
            context += req.cached_blocks * bs
            admitted.append(req)
        decoding = len(self.running)
        if not admitted and not decoding:
            self.busy = False
            self._plan = None
            return
        self.busy = True
        step = m.step_s + m.decode_s_per_seq * (decoding + len(admitted))
        if admitted:
            k, duration = 1, step + m.prefill_s_per_token * prefill + m.context_s_per_token * context
        else:
            k = min(r.remaining for r in self.running)
            duration = step
        self._plan = (self.sim.now, duration, k, admitted)
        self._version += 1
        self.sim.schedule(self.sim.now + duration * k, self._step_end, self._version)

    def _step_end(self, version: int) -> None:
        if version != self._version or self._plan is None:
            return
        start, step, k, admitted = self._plan
        now = self.sim.now
        self.busy_s += now - start
        for r in self.running:
            r.remaining -= k
        for r in admitted:
            r.first_token = now
            r.remaining -= 1
            if r.on_first_token is not None:
                r.on_first_token()
            self.running.append(r)
        still: list[SimRequest] = []
        for r in self.running:
            if r.remaining <= 0:
                r.finish = now
                self.cache.release(r)
                self.inflight -= 1
                if r.adapter is not None:
                    self._adapter_released(r)
                self.served += 1
                if r.done_cb is not None:
                    r.done_cb(r, now)
            else:
                still.append(r)
        self.running = still
        self._plan = None
        self._next_step()


class FleetSimulator:
    """Event loop + clients + router. ``run()`` returns a PolicyResult."""

    def __init__(self, config: SimConfig, sessions: Iterator[Any], prompts: "PromptBuilder") -> None:
        self.config = config
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self.index = PrefixIndex(PrefixIndexConfig(default_capacity_blocks=config.engine.kv_capacity_blocks))
        self.hasher = BlockHasher(BlockHashConfig(block_size=config.block_size, hash_seed=config.hash_seed))
        self.router = Router(config.policy, self.index, hasher=self.hasher, config=config.router)
        engines = config.engines or [config.engine] * config.replicas
        self.replicas = [SimReplica(self, f"r{i:02d}", m) for i, m in enumerate(engines)]
        self.sessions = sessions
        self.prompts = prompts
        self.done: list[SimRequest] = []
        self.issued = 0
        self._oracle = PrefixOracle(config.block_size)
        self._arrivals = random.Random(f"{config.seed}:arrivals")
        self._ids = itertools.count()

    # -- event loop ------------------------------------------------------------------------------
    def schedule(self, at: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (at, next(self._seq), fn, args))

    def kv_event(self, apply: Callable[[], None]) -> None:
        if self.config.kv_event_delay_s > 0:
            self.schedule(self.now + self.config.kv_event_delay_s, apply)
        else:
            apply()

    # -- EngineHost: a replica's KV events feed the router's index -----------------------------------
    def blocks_stored(self, replica: SimReplica, req: SimRequest, hashes: list[BlockHash]) -> None:
        if replica.model.kv_events:
            self.kv_event(lambda: self.index.store(replica.name, hashes))

    def blocks_removed(self, replica: SimReplica, hashes: list[BlockHash]) -> None:
        if replica.model.kv_events:
            self.kv_event(lambda: self.index.remove(replica.name, hashes))

    def run(self) -> PolicyResult:
        sizes = self.config.phases or [self.config.requests]
        self._limits = list(itertools.accumulate(sizes))
        self._phase = -1
        self._holders = 0
        self._counted_from = 0
        self._before: dict[str, ReplicaCounters] = {}
        self._next_phase()
        while self._events:
            at, _, fn, args = heapq.heappop(self._events)
            self.now = at
            fn(*args)
        return self._result()

    # -- clients (mirror loadtest.runner) ---------------------------------------------------------
    def _next_phase(self) -> None:
        """Like Runner.run_phase: fresh workers (or a fresh arrival stream) on the same session
        stream; sessions still running when a phase runs out of requests are cut there."""
        self._phase += 1
        if self._phase >= len(self._limits):
            return
        if self._phase == self.config.warmup_phases:  # what the results count starts here
            self._counted_from = len(self.done)
            self._before = {r.name: r.counters() for r in self.replicas}
        if self._phase > 0 and self.config.cold_phases:
            for replica in self.replicas:
                replica.cache.clear()
            self._oracle.clear()
        if self.config.arrival == "concurrency":
            for _ in range(max(1, self.config.concurrency)):
                self._holders += 1
                self.schedule(self.now, self._worker_next)
        else:
            self._holders += 1
            self.schedule(self.now, self._poisson_next)

    def _release(self) -> None:
        self._holders -= 1
        if self._holders == 0:
            self._next_phase()

    def _claim(self) -> bool:
        if self.issued >= self._limits[self._phase]:
            return False
        self.issued += 1
        return True

    def _poisson_next(self) -> None:
        session = next(self.sessions, None)
        if session is None or not self._claim():
            self._release()
            return
        self._holders += 1
        self._start_session(session, then=self._release)
        k = self.config.burstiness
        self.schedule(self.now + self._arrivals.gammavariate(k, 1.0 / (self.config.rate * k)), self._poisson_next)

    def _worker_next(self) -> None:
        if not self._claim():
            self._release()
            return
        session = next(self.sessions, None)
        if session is None:
            self.issued -= 1
            self._release()
            return
        self._start_session(session, then=self._worker_next)

    def _start_session(self, session: Any, then: Callable[[], None]) -> None:
        state = {"messages": self.prompts.start(session), "turn": 0}

        def send_turn() -> None:
            k = state["turn"]
            turn = session.turns[k]
            self.prompts.add_user(state["messages"], turn)
            self._dispatch(session, k, state["messages"], turn.max_tokens, on_done)

        def on_done(req: SimRequest, now: float) -> None:
            self.prompts.add_answer(state["messages"], session.id, req.turn, req.n_out)
            state["turn"] += 1
            k = state["turn"]
            if k < len(session.turns) and self._claim():
                self.schedule(now + session.turns[k].think_time_s, send_turn)
            else:
                then()

        send_turn()

    # -- the gateway's routing step ---------------------------------------------------------------
    def _dispatch(self, session: Any, turn: int, messages: list[dict[str, str]], max_tokens: int,
                  on_done: Callable[[SimRequest, float], None]) -> None:
        tokens = self.prompts.encode(messages)
        adapter = session.adapter
        # As vLLM, an adapter's blocks are hashed with its name and path: cached per adapter.
        hashes = self.hasher.hashes(tokens, extra_keys=lora_extra_keys(adapter, f"/adapters/{adapter}")
                                    if adapter is not None else None)
        req = SimRequest(next(self._ids), session.id, turn, tokens, hashes, max_tokens, self.now, adapter)
        req.oracle_blocks = self._oracle.observe(hashes, len(tokens))
        route = RouteRequest(block_hashes=hashes, session_id=session.id if self.config.session_ids else None)
        candidates = self.replicas if adapter is None else self._adapter_candidates(adapter, route)
        decision = self.router.pick(route, candidates)
        req.predicted = decision.predicted_cached_tokens
        if self.config.observe_delay_s > 0:
            self.schedule(self.now + self.config.observe_delay_s, self.router.sent, decision)
        else:
            self.router.sent(decision)
        req.done_cb = lambda r, now: (self.done.append(r), self.router.done(decision), on_done(r, now))
        # As in the gateway, a request's prefill stops counting as pending at its first token.
        req.on_first_token = lambda: self.router.first_token(decision)
        decision.replica.submit(req)

    def _adapter_candidates(self, adapter: str, route: RouteRequest) -> list[SimReplica]:
        """Where a request for `adapter` may go: the gateway's rule (cache.scorers.adapter_candidacy)
        on the simulated replicas, an adapter on demand on up to `adapter_replicas` of them. Held
        nowhere, it goes to the replica the rule loads it on; a spread loads it in the background."""
        limit = self.config.adapter_replicas or len(self.replicas)
        holders = [r for r in self.replicas if adapter in r.adapters]
        candidacy = adapter_candidacy(holders, self.replicas, lambda r: r.affinity(adapter),
                                      weighs_affinity=self.router.scores_adapters, room=len(holders) < limit,
                                      busy=bool(holders) and min(r.inflight for r in holders) >= 1)
        if candidacy.affinity is not None:
            route.adapter_affinity = candidacy.affinity
        if candidacy.spread_to is not None:
            candidacy.spread_to.preload(adapter)
        return candidacy.candidates or candidacy.load_on[:1]

    # -- results -----------------------------------------------------------------------------------
    def _result(self) -> PolicyResult:
        bs = self.config.block_size
        done = self.done[self._counted_from:]
        counted = [r.counters().minus(self._before.get(r.name)) for r in self.replicas]  # since the warm-up
        prompt = sum(r.n_prompt for r in done)
        cached = sum(r.cached_blocks * bs for r in done)
        oracle = sum(r.oracle_blocks * bs for r in done)
        ttft = sorted(r.first_token - r.arrival for r in done)
        e2e = sorted(r.finish - r.arrival for r in done)
        t0 = min((r.arrival for r in done), default=0.0)
        t1 = max((r.finish for r in done), default=0.0)
        duration = max(t1 - t0, 1e-9)
        served = {r.name: c.served for r, c in zip(self.replicas, counted)}
        mean = sum(served.values()) / len(served) if served else 0.0
        busy = [c.busy_s for c in counted]
        busy_mean = sum(busy) / len(busy) if busy else 0.0
        return PolicyResult(
            policy=self.config.policy, requests=len(done), prompt_tokens=prompt, cached_tokens=cached,
            oracle_cached_tokens=oracle, cached_ratio=cached / prompt if prompt else 0.0,
            oracle_ratio=oracle / prompt if prompt else 0.0,
            ratio_to_oracle=cached / oracle if oracle else 1.0,
            ttft_p50_s=_pct(ttft, 50), ttft_p90_s=_pct(ttft, 90), e2e_p50_s=_pct(e2e, 50),
            throughput_rps=len(done) / duration,
            throughput_tokens_s=(prompt + sum(r.n_out for r in done)) / duration, duration_s=duration,
            requests_per_replica=served, load_max_over_mean=max(served.values()) / mean if mean else 1.0,
            busy_max_over_mean=max(busy) / busy_mean if busy_mean else 1.0,
            predicted_cached_tokens=sum(r.predicted for r in done),
            evicted_blocks=sum(c.evicted for c in counted),
            adapter_requests=sum(r.adapter is not None for r in done),
            loads_per_1k=1000.0 * sum(c.loads for c in counted) / len(done) if done else 0.0,
            unloads_per_1k=1000.0 * sum(c.unloads for c in counted) / len(done) if done else 0.0,
        )


class PrefixOracle:
    """The most prefix reuse any router could get: one infinite cache that has seen every earlier
    request. Benchmarks of the real fleet score their prompts with it too (benchmarks/agent_routing.py)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._seen: set[BlockHash] = set()

    def observe(self, hashes: Sequence[BlockHash], n_tokens: int) -> int:
        """Blocks of this prompt such a cache holds (as vLLM, never the block of the prompt's last
        token: that token is always computed), then remember the prompt's blocks."""
        limit = min(len(hashes), (n_tokens - 1) // self.block_size)
        n = 0
        while n < limit and hashes[n] in self._seen:
            n += 1
        self._seen.update(hashes)
        return n

    def clear(self) -> None:
        self._seen.clear()


def _pct(values: Sequence[float], p: float) -> float:
    if not values:
        return 0.0
    k = (len(values) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


class PromptBuilder:
    """Chat messages as loadtest.runner builds them, tokenized as the engine's chat endpoint does.

    The rendered ChatML text is cut before every special token that opens a message; each piece is
    tokenized once and memoized. Exact, because the tokenizer never merges across special tokens.
    """

    def __init__(self, tokenizer: Tokenizer, cache_salt: str = "") -> None:
        self.tokenizer = tokenizer
        self.salt_prefix = f"[cache-salt {cache_salt}]\n" if cache_salt else ""
        self._piece = lru_cache(maxsize=65536)(self._encode_piece)

    def _encode_piece(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def start(self, session: Any) -> list[dict[str, str]]:
        if session.system is None:
            return []
        return [{"role": "system", "content": self.salt_prefix + session.system}]

    def add_user(self, messages: list[dict[str, str]], turn: Any) -> None:
        content = turn.user if turn.tool_output is None else f"{turn.tool_output}\n\n{turn.user}"
        if not messages and self.salt_prefix:
            content = self.salt_prefix + content
        messages.append({"role": "user", "content": content})

    def add_answer(self, messages: list[dict[str, str]], session_id: str, turn: int, n_tokens: int) -> None:
        rng = random.Random(f"answer:{session_id}:{turn}")
        words = max(1, round(n_tokens * _ANSWER_WORDS_PER_TOKEN))
        messages.append({"role": "assistant", "content": " ".join(rng.choices(_ANSWER_WORDS, k=words))})

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.render_chat(messages)
        out: list[int] = []
        for i, piece in enumerate(text.split("<|im_start|>")):
            if i:
                piece = "<|im_start|>" + piece
            if piece:
                out.extend(self._piece(piece))
        return out


class WorkloadMix:
    """Interleaves several loadtest workloads' sessions by weight (seeded), e.g. 70% shared-prefix
    requests and 30% agent sessions."""

    def __init__(self, parts: Sequence[tuple[Any, float]], seed: int = 0) -> None:
        self.parts = list(parts)
        self.seed = seed

    def sessions(self) -> Iterator[Any]:
        rng = random.Random(f"{self.seed}:mix")
        streams = [w.sessions() for w, _ in self.parts]
        weights = [wt for _, wt in self.parts]
        while True:
            k = rng.choices(range(len(streams)), weights=weights)[0]
            yield next(streams[k])


def run_simulation(workload: Any, config: SimConfig = SimConfig(), tokenizer: Tokenizer | None = None,
                   prompts: PromptBuilder | None = None) -> PolicyResult:
    """Simulate `workload` (a loadtest Workload or a WorkloadMix) under `config.policy`, with the
    served model's `tokenizer` (or a shared `prompts` builder).

    Deterministic: the same workload, config and tokenizer give the same result.
    """
    if prompts is None:
        if tokenizer is None:
            raise ValueError("run_simulation needs the served model's tokenizer (or a PromptBuilder)")
        prompts = PromptBuilder(tokenizer, config.cache_salt)
    return FleetSimulator(config, workload.sessions(), prompts).run()


def compare_policies(workload: Any, config: SimConfig, policies: Sequence[str],
                     tokenizer: Tokenizer) -> list[PolicyResult]:
    """The same workload and load under each policy (tokenization memo shared across runs)."""
    prompts = PromptBuilder(tokenizer, config.cache_salt)
    return [run_simulation(workload, msgspec.structs.replace(config, policy=p), prompts=prompts)
            for p in policies]
