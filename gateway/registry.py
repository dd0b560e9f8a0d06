"""The models one gateway serves (docs/models.md): each base model is a pool of its own — fleet,
routing (with its own prefix index and tokenizer), LoRA adapters, stored-response affinity and lanes —
and a request's `model` resolves to exactly one pool before anything is routed:

    "auto" → a target chosen by $ per solved task → an alias → its target (a weighted split,
    sticky per session) → `name[:fast]` → a pool by its model's name, or the pool that has the
    adapter of that name (`name@version` pins a version).

A request never reaches another pool's replica: routing, candidates and adapters are all the pool's.
Cross-model fallback (`fleet.fallback_model`) moves a request whole to another pool before it is
routed, while its own pool has no routable replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from yieldgate.serving import AdapterRoute, Adapters, Fleet, FleetConfig, open_store

from .adapters import AdapterCard, adapter_cards
from .affinity import ResponseAffinity
from .config import AliasConfig, Config
from .errors import ModelNotFound
from .lanes import Lanes
from .routing import Routing
from .schemas import ModelCard
from .tiers import FAST, FAST_SUFFIX

if TYPE_CHECKING:
    from yieldgate.pricing import TargetChooser

    from .accounting import Accounting

log = logging.getLogger("yieldgate.models")

# The task class of an `auto` request that names none (x-yieldgate-task or metadata.task).
UNLABELLED = "unlabelled"


class ModelPool:
    """One base model's serving parts."""

    def __init__(self, config: Config, fleet_config: FleetConfig, instance_id: str = ""):
        self.name = fleet_config.model
        self.config = fleet_config
        self.fleet = Fleet(fleet_config)
        self.routing = Routing(config, self.fleet)
        self.adapters = Adapters(self.fleet, instance_id=instance_id)
        self.slots = self.adapters.slots
        self.affinity = ResponseAffinity(self.name)
        self.lanes = Lanes(config.lanes, self.fleet)

    async def start(self, redis_url: str | None) -> None:
        """Once the fleet has started: routing (index, tokenizer, KV events), and the adapter
        registry shared through Redis (`redis_url` None: this process's own, as the picker's)."""
        await self.routing.start()
        if redis_url is not None:
            await self.adapters.start(await open_store(redis_url, self.name))

    async def close(self) -> None:
        await self.adapters.close()
        await self.routing.close()
        await self.fleet.close()

    def routable(self, tier: str) -> bool:
        """Whether a request for `tier` has somewhere to go in this pool (its tier or its fallback tier)."""
        return bool(self.fleet.candidates(tier) or self.fleet.fallback(tier)[1])

    def model_ids(self) -> list[str]:
        """What /v1/models lists for the base model: its name, and its fast tier's name."""
        return [self.name, self.name + FAST_SUFFIX] if self.fleet.in_tier(FAST) else [self.name]


@dataclass(slots=True)
class Resolution:
    """Where a request's model name led: the pool, the name it stands for there, and how it got there."""

    pool: ModelPool
    model: str                      # the target's name as the client could have sent it (":fast" kept)
    adapter: AdapterRoute | None = None
    requested: str = ""             # the alias or auto name the client sent ("" = a model or adapter name)
    reason: str = ""                # auto's why (the x-yieldgate-auto header)
    task: str = ""                  # auto's task class


class ModelRegistry:
    """Model names, aliases and `auto` -> pools. `pools` keeps [fleet] first."""

    def __init__(self, config: Config, pools: list[ModelPool], seed: int | None = None):
        self.config = config
        self.pools = {p.name: p for p in pools}
        self.primary = pools[0]
        self.aliases: dict[str, AliasConfig] = config.aliases  # type: ignore[assignment]  # str targets normalised by Config
        self.auto_name = config.auto.name if config.auto.enabled else ""
        self.chooser: TargetChooser | None = None  # made by start_auto, once the adapters are known
        self._random = random.Random(seed)
        self._seed = seed
        self._refresher: asyncio.Task[None] | None = None
        self._classes: set[str] = set()

    # -- auto: the graded outcomes, read from the ledger ------------------------------------------

    async def start_auto(self, accounting: "Accounting") -> None:
        """Choose among the targets by what the ledger says each one costs per solved task."""
        if not self.auto_name:
            return
        from yieldgate.pricing import AutoRule, TargetChooser

        auto = self.config.auto
        rule = AutoRule(explore=auto.explore, min_graded=auto.min_graded, confidence=auto.confidence,
                        default_class=UNLABELLED)
        self.chooser = TargetChooser(rule, auto.targets or self.targets(), seed=self._seed)
        await self.refresh(accounting)
        self._refresher = asyncio.create_task(self._refresh_every(accounting))

    async def refresh(self, accounting: "Accounting") -> None:
        """Read the graded outcomes per (task class, target) again: the chooser learns from every
        gateway's requests, and a restart loses nothing."""
        from yieldgate.pricing import AUTO_GROUP_BY

        if self.chooser is None or accounting.ledger is None:
            return
        since = time.time() - self.config.auto.window_s
        ledger = await accounting.flushed_ledger()  # this gateway's latest records too
        self.chooser.load(await ledger.success(group_by=AUTO_GROUP_BY, since=since))

    async def _refresh_every(self, accounting: "Accounting") -> None:
        while True:
            await asyncio.sleep(self.config.auto.refresh_s)
            try:
                await self.refresh(accounting)
            except Exception as exc:  # the ledger's store away: choose on what was read last
                log.warning("auto: graded outcomes not refreshed: %s: %s", type(exc).__name__, exc)

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)

    def __iter__(self) -> Iterator[ModelPool]:
        return iter(self.pools.values())

    def pool(self, name: str) -> ModelPool:
        return self.pools[name]

    def resolve(self, name: str, session: str = "", task: str = "") -> Resolution:
        """The pool (and adapter) a request's `model` names; ModelNotFound (404) when none."""
        requested = reason = chosen_task = ""
        if self.auto_name and name == self.auto_name:
            assert self.chooser is not None
            chosen_task = self._task_class(task)
            choice = self.chooser.choose(chosen_task)
            requested, reason, name = name, choice.reason, choice.target
        base, fast = (name[: -len(FAST_SUFFIX)], True) if name.endswith(FAST_SUFFIX) else (name, False)
        alias = self.aliases.get(base)
        if alias is not None:
            requested = requested or name
            name = self._pick(alias, session)
            if fast and not name.endswith(FAST_SUFFIX):  # `prod:fast`: the alias's target on its fast tier
                name += FAST_SUFFIX
            base = name[: -len(FAST_SUFFIX)] if name.endswith(FAST_SUFFIX) else name
        found = self._find(base)
        if found is None:
            raise ModelNotFound(f"The model '{requested or name}' does not exist.", param="model")
        pool, adapter = found
        return Resolution(pool, name, adapter, requested, reason, chosen_task)

    def _task_class(self, task: str) -> str:
        """Clients name task classes, and each one is learned apart: past `auto.max_classes` of them,
        a new name is learned as unlabelled."""
        if not task:
            return UNLABELLED
        if task not in self._classes:
            if len(self._classes) >= self.config.auto.max_classes:
                return UNLABELLED
            self._classes.add(task)
        return task

    def _find(self, base: str) -> tuple[ModelPool, AdapterRoute | None] | None:
        pool = self.pools.get(base)
        if pool is not None:
            return pool, None
        adapter_name, _, version = base.partition("@")
        for pool in self.pools.values():
            route = pool.adapters.resolve_at(adapter_name, version) if version else pool.adapters.resolve(base)
            if route is not None:
                return pool, route
        return None

    def _pick(self, alias: AliasConfig, session: str) -> str:
        """One target by weight; a sticky alias gives a session the same one every time."""
        targets = alias.targets
        if len(targets) == 1:
            return targets[0].model
        total = sum(t.weight for t in targets)
        if alias.sticky and session:
            point = int.from_bytes(hashlib.blake2b(session.encode(), digest_size=8).digest()) / 2**64 * total
        else:
            point = self._random.random() * total
        for t in targets:
            point -= t.weight
            if point < 0:
                return t.model
        return targets[-1].model

    def fallback(self, pool: ModelPool, tier: str) -> ModelPool | None:
        """The pool that serves `pool`'s requests while it has nothing routable for `tier` (one hop)."""
        other = self.pools.get(pool.config.fallback_model)
        if other is None or pool.routable(tier):
            return None
        return other if other.routable(tier) or other.routable("standard") else None

    def targets(self) -> list[str]:
        """Every name `auto` may choose: models, their fast tiers, their adapters."""
        names: list[str] = []
        for pool in self.pools.values():
            names += pool.model_ids() + list(pool.adapters.names())
        return names


def open_pools(config: Config, instance_id: str = "") -> list[ModelPool]:
    """A pool per model of the config, [fleet]'s first."""
    return [ModelPool(config, f, instance_id) for f in config.fleets]



def model_cards(models: ModelRegistry) -> list[ModelCard]:
    """/v1/models: each model (and its fast tier), its adapters as children, the aliases and `auto`."""
    cards: list[ModelCard] = []
    for pool in models:
        cards += [ModelCard(id=i) for i in pool.model_ids()] + adapter_cards(pool.adapters)
    for alias, config in models.aliases.items():
        cards.append(AdapterCard(id=alias, root=",".join(t.model for t in config.targets)))
    if models.auto_name:
        cards.append(ModelCard(id=models.auto_name))
    return cards
