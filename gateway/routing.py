"""Per-tier routing: the gateway's adapter to the policies, tokenizer and prefix index in `cache`.

One prefix index for the model's fleet (shared with other gateways through Redis when reachable), one
`cache.Router` per tier with the tier's policy, one KV-event subscriber per engine that publishes;
a discovered replica gets its subscriber and index slot when it joins and loses them when it leaves.
The prompt is tokenized only when the tier's policy needs tokens.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import redis.asyncio as aioredis

from yieldgate.cache import (KVEventSubscriber, PrefixIndex, PrefixIndexConfig, RouteDecision, RouteRequest,
                   Router, RouterConfig, SharedPrefixIndex, Tokenizer, lora_extra_keys, pack_tokens)
from yieldgate.serving import Fleet, Replica, TierConfig, reachable_redis

from .context import RequestContext
from .config import Config
from .errors import PreviousResponseNotFound, ServiceUnavailable

log = logging.getLogger("yieldgate.routing")


class Routing:
    def __init__(self, config: Config, fleet: Fleet):
        self.config = config
        self.fleet = fleet
        self.index: PrefixIndex | SharedPrefixIndex = PrefixIndex()
        self.routers: dict[str, Router] = {}
        self.tokenizer: Tokenizer | None = None
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self._redis: aioredis.Redis | None = None

    async def start(self) -> None:
        fleet_cfg = self.fleet.config
        self.index = await self._open_index()
        self.routers = {tier: self._router(fleet_cfg.tier(tier)) for tier in self.fleet.tiers()}
        # Loaded even when no policy needs tokens: a stream cut short is billed by it (gateway/relay.py).
        # In a thread: a 49k-token vocabulary takes a second or two to convert, and probes go on.
        self.tokenizer = await asyncio.to_thread(self._load_tokenizer, fleet_cfg.model_path)
        for replica in self.fleet.replicas.values():
            if not replica.joining:
                await self.joined(replica)
        self.fleet.on_join.append(self.joined)
        self.fleet.on_leave.append(self.left)

    async def joined(self, replica: Replica) -> None:
        """Follow the replica's KV events (when it publishes them) and size its index slot."""
        endpoint = replica.config.kv_events
        if endpoint and replica.name not in self.subscribers:
            sub = KVEventSubscriber(replica.name, endpoint, self.index)
            sub.start()
            self.subscribers[replica.name] = sub
        if replica.kv_capacity_blocks:
            self.index.set_capacity(replica.name, replica.kv_capacity_blocks)

    async def left(self, replica: Replica) -> None:
        """The replica is gone: stop following it and drop what the index says it holds."""
        sub = self.subscribers.pop(replica.name, None)
        if sub is not None:
            await sub.stop()
        self.index.clear(replica.name)

    def _router(self, tier: TierConfig) -> Router:
        config = RouterConfig(policy=tier.policy, overlap_weight=tier.overlap_weight,
                              queued_request_blocks=tier.queued_request_blocks,
                              spill_factor=tier.spill_factor, spill_slack=tier.spill_slack,
                              share_factor=tier.share_factor, share_slack=tier.share_slack,
                              share_keep_blocks=tier.share_keep_blocks,
                              share_keep_tail_blocks=tier.share_keep_tail_blocks,
                              share_spread_fraction=tier.share_spread_fraction,
                              share_seed_fraction=tier.share_seed_fraction, share_seed_slack=tier.share_seed_slack,
                              pending_weight=tier.pending_weight,
                              share_weight=tier.share_weight,
                              speculate_max_temperature=tier.speculate_max_temperature,
                              default_temperature=tier.default_temperature)
        return Router(tier.policy, self.index, block_size=self.fleet.config.block_size, config=config,
                      pipeline=tier.pipeline)

    async def _open_index(self) -> PrefixIndex | SharedPrefixIndex:
        client = await reachable_redis(self.config.server.redis_url, "the prefix index", socket_timeout=2)
        if client is None:
            return PrefixIndex()
        self._redis = client
        index = SharedPrefixIndex(client, PrefixIndexConfig(redis_key_prefix=f"yg:prefix:{self.fleet.config.model}"))
        await index.start()
        return index

    @staticmethod
    def _load_tokenizer(model_path: str) -> Tokenizer | None:
        if not model_path or not (Path(model_path) / "tokenizer.json").exists():
            log.warning("no tokenizer (fleet.model_path=%r): cache-aware routing sees no prefixes, and a "
                        "stream cut short is billed one token per event relayed", model_path)
            return None
        return Tokenizer.from_model_dir(model_path)

    async def close(self) -> None:
        for sub in self.subscribers.values():
            await sub.stop()
        if isinstance(self.index, SharedPrefixIndex):
            await self.index.close()
        if self._redis is not None:
            await self._redis.aclose()

    def prepare(self, ctx: RequestContext, raw: dict[str, Any]) -> RouteRequest:
        """What the policy keys on; tokenizes only if the tier's policy needs tokens."""
        request = RouteRequest(session_id=ctx.session_id or None, temperature=ctx.typed.temperature)
        router = self.routers.get(ctx.tier)
        if router is not None and router.needs_tokens and self.tokenizer is not None:
            tokens, packed = self._tokenize(ctx.kind, raw)
            ctx.prompt_tokens = tokens
            request.token_ids = tokens
            if tokens:
                # Packed once: the block hasher and the cache advisor both read these bytes.
                ctx.prompt_packed = request.packed_ids = packed if packed is not None else pack_tokens(tokens)
            if ctx.adapter is not None:  # the engine caches an adapter version's blocks apart
                request.extra_keys = lora_extra_keys(ctx.adapter.engine_name, ctx.adapter.path)
        return request

    def _tokenize(self, kind: str, raw: dict[str, Any]) -> tuple[list[int] | None, bytes | None]:
        """The prompt's token ids, and packed (None: pack them) when the tokenizer had that at hand."""
        assert self.tokenizer is not None
        try:
            if kind != "completions":  # chat, and the APIs the proxy renders as chat messages
                return self.tokenizer.encode_chat_packed(raw["messages"], raw.get("tools"))
            prompt = raw["prompt"]
            if isinstance(prompt, list) and prompt:
                prompt = prompt[0]  # a batch routes on its first prompt
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt), None
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt, None
        except Exception as exc:  # the engine validates the request; routing just loses its hint
            log.debug("could not tokenize for routing: %s", type(exc).__name__)
        return None, None

    async def candidates(self, ctx: RequestContext, failed: set[str],
                         on_failover: Callable[[str, str], None],
                         holds: Callable[[Replica], bool] | None = None) -> list[Replica]:
        """The replicas a try may go to: the tier's routable ones that have not failed this
        request (and, with `holds`, hold what it needs: its adapter version), else its fallback
        tier's (`on_failover(requested, served_by)` is told), else (a last try) any routable one
        of the tier. Empty: nothing can serve it."""
        routable = self.fleet.candidates(ctx.tier)
        if not routable:
            hold_s = self.config.limits.weight_swap_hold_s
            if not await self.fleet.wait_released(hold_s):
                raise ServiceUnavailable(
                    f"Every replica of tier '{ctx.tier}' is swapping to new weights; the request "
                    f"waited {hold_s:g} s. Retry shortly.",
                    code="weight_swap_in_progress", headers={"retry-after": "1"})
            routable = self.fleet.candidates(ctx.tier)  # an all-at-once weight swap just ended
        if holds is not None:
            routable = [r for r in routable if holds(r)]
        candidates = [r for r in routable if r.name not in failed]
        if not candidates:
            # None of the tier's replicas can take it (down, or failed this request): its
            # fallback tier serves it, priced and labelled as that tier.
            served_by, spare = self.fleet.fallback(ctx.tier)
            candidates = [r for r in spare if r.name not in failed and (holds is None or holds(r))]
            if candidates:
                ctx.serve_from(served_by)
                on_failover(ctx.requested_tier, served_by)
            else:
                candidates = routable
        elif any(r.speculative for r in candidates):
            plain_tier = self.fleet.config.tier(ctx.tier).plain_tier
            if plain_tier:  # the tier's policy may send a request that would not gain from speculation there
                candidates += [r for r in self.fleet.candidates(plain_tier) if r.name not in failed
                               and not r.speculative and r not in candidates and (holds is None or holds(r))]
        return candidates

    def scores_adapters(self, tier: str) -> bool:
        router = self.routers.get(tier)
        return router is not None and router.scores_adapters

    async def targets(self, ctx: RequestContext, failed: set[str],
                      on_failover: Callable[[str, str], None]) -> list[Replica]:
        """Where a try may go: a Responses follow-up only to the replica that stored its previous
        response (`ctx.pinned`; 404 once that one failed or left), anything else to `candidates`."""
        if ctx.pinned is not None:
            if ctx.pinned.name in failed or not ctx.pinned.routable:
                raise PreviousResponseNotFound(
                    f"Previous response not found: replica {ctx.pinned.name}, which stored it, "
                    "failed.", param="previous_response_id")
            return [ctx.pinned]
        return await self.candidates(ctx, failed, on_failover)

    def no_replica(self, ctx: RequestContext) -> ServiceUnavailable:
        """The 503 for a request that nothing in its tier or fallback tier can serve."""
        fallback = self.fleet.config.tier(ctx.tier).fallback
        if ctx.adapter is not None:
            return ServiceUnavailable(f"Adapter '{ctx.adapter.label}' is on no routable replica of tier "
                                      f"'{ctx.tier}'" + (f" nor of its fallback tier '{fallback}'." if fallback else "."),
                                      headers={"retry-after": "1"})
        return ServiceUnavailable(f"No healthy replica in tier '{ctx.tier}'"
                                  + (f" nor in its fallback tier '{fallback}'." if fallback else "."),
                                  headers={"retry-after": "1"})

    def pick(self, ctx: RequestContext, request: RouteRequest, candidates: Sequence[Replica]) -> RouteDecision:
        ctx.router_tier = ctx.tier
        decision = self.routers[ctx.tier].pick(request, candidates)
        served = decision.replica
        if (served.tier != ctx.tier and served.tier == self.fleet.config.tier(ctx.tier).plain_tier
                and not served.speculative and any(r.speculative for r in candidates)):
            ctx.serve_from(served.tier)  # the speculation filter chose not to speed it up: priced as served
        return decision

    # -- the request's lifecycle on its replica (one try; a retry is a new pick) ------------------

    def sent(self, ctx: RequestContext, decision: RouteDecision) -> None:
        """The request goes to `decision.replica`: it counts as in flight there, and the index
        records its prefix there now, so requests routed meanwhile already see it."""
        ctx.decision = decision
        decision.replica.inflight += 1
        router = self.routers.get(ctx.router_tier)
        if router is not None:
            router.sent(decision)

    def first_token(self, ctx: RequestContext) -> None:
        """Its first byte is back: its prefill stops counting as work queued on the replica."""
        decision, router = ctx.decision, self.routers.get(ctx.router_tier)
        if decision is not None and router is not None:
            router.first_token(decision)

    def done(self, ctx: RequestContext) -> None:
        """This try ended, however it ended. Safe to call more than once."""
        decision, ctx.decision = ctx.decision, None
        if decision is None:
            return
        decision.replica.inflight -= 1
        router = self.routers.get(ctx.router_tier)
        if router is not None:
            router.done(decision)

    def forget_cached(self, replica: str) -> None:
        """The replica's engine dropped its prefix cache (new weights, or a restart): route as if
        it held nothing."""
        self.index.clear(replica)

    def stats(self) -> dict[str, Any]:
        s = self.index.stats()
        return {"replicas": s.replicas, "capacity": s.capacity, "total_blocks": s.total_blocks}
