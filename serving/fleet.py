"""The running fleet: replicas with health, load and engine metrics kept fresh in the background."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .config import FleetConfig, ReplicaConfig
from .discovery import Discovery, sources_for

log = logging.getLogger("yieldgate.fleet")

# Called when a replica comes back serving other weights than its label (its engine restarted):
# puts the labelled version back, or leaves the replica out of routing saying why.
RestoreHook = Callable[["Replica", str], Awaitable[None]]
# Called when a discovered replica has passed its join probes (before it gets traffic), and when one
# that left has drained (its last in-flight request is over) and is gone from the fleet.
MembershipHook = Callable[["Replica"], Awaitable[None]]
# How often a leaving replica's in-flight count is looked at until it drains.
DRAIN_POLL_S = 0.1

# vLLM reports "default" as the weight version it was launched with; the gateway calls it "base".
BASE_VERSION = "base"
ENGINE_BASE_VERSION = "default"

# Engine counters and gauges the gateway reads; summed over label sets (engine index, position).
SCRAPED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    # The engine API server's start (prometheus_client's process collector): a new value is a
    # restarted engine, even one restarted between two health probes.
    "process_start_time_seconds",
)


@dataclass(eq=False)
class Replica:
    """One engine as the gateway sees it. Satisfies cache's routing candidate protocol."""

    config: ReplicaConfig
    healthy: bool = False
    admitted: bool = True          # False while a weight rollout has it out of routing
    inflight: int = 0              # requests in flight through this gateway
    weight_version: str = "base"
    weight_generation: int = 0     # bumped by every swap's label (`label_weights`)
    engine_metrics: dict[str, float] = field(default_factory=dict)
    kv_capacity_blocks: int | None = None
    last_health_at: float = 0.0
    consecutive_failures: int = 0
    probe_timeouts: int = 0        # health probes in a row that timed out
    seen_up: bool = False          # answered health at least once since the gateway started
    engine_started: float | None = None  # its engine's process start time, when it reports one
    restoring: bool = False        # back from a restart; its weights are being put back
    note: str = ""                 # why it is out of routing, when it is for a reason of ours
    source: str = "static"         # where the replica came from: "static" or a discovery label
    joining: bool = False          # discovered, not through its join probes yet: no traffic
    leaving: bool = False          # gone from its source: no new requests, dropped once drained

    @property
    def name(self) -> str:
        return self.config.name

    def label_weights(self, version: str) -> None:
        """Label the replica with the version a weight swap (or its restore) just verified. A
        version read that began before this is stale from now on: see `_on_up`."""
        self.weight_version = version
        self.weight_generation += 1

    @property
    def tier(self) -> str:
        return self.config.tier

    @property
    def url(self) -> str:
        return self.config.base_url

    @property
    def speculative(self) -> bool:
        return self.config.speculates

    @property
    def num_waiting(self) -> float:
        return self.engine_metrics.get("vllm:num_requests_waiting", 0.0)

    @property
    def num_running(self) -> float:
        return self.engine_metrics.get("vllm:num_requests_running", 0.0)

    @property
    def swapping(self) -> bool:
        """Out of routing for a weight rollout (not held out for a reason, see `note`)."""
        return self.healthy and not self.admitted and not self.note

    @property
    def routable(self) -> bool:
        return self.healthy and self.admitted and not self.restoring and not self.joining and not self.leaving

    @property
    def state(self) -> str:
        """One word for GET /admin/fleet: joining, leaving, down, restoring, out or serving."""
        if self.leaving or self.joining:
            return "leaving" if self.leaving else "joining"
        if not self.healthy:
            return "down"
        if self.restoring:
            return "restoring"
        return "serving" if self.admitted else "out"


class Fleet:
    def __init__(self, config: FleetConfig):
        self.config = config
        self.replicas: dict[str, Replica] = {r.name: Replica(r) for r in config.replicas}
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None
        # Set except while an all-at-once weight swap has every replica out: requests that find
        # no candidate then wait for it instead of failing.
        self._released: asyncio.Event | None = None
        self.restore: RestoreHook | None = None
        self._restores: dict[str, asyncio.Task] = {}
        self.on_join: list[MembershipHook] = []
        # Called (synchronously, before the replica is routable again) when its engine restarted:
        # whatever was loaded into it at run time (LoRA adapters) is gone.
        self.on_restart: list[Callable[["Replica"], None]] = []
        self.on_leave: list[MembershipHook] = []
        self._drains: dict[str, asyncio.Task] = {}
        self.discovery = Discovery(sources_for(config), self.reconcile,
                                   {t: c.discovery.interval_s for t, c in config.tiers.items()})

    def tiers(self) -> list[str]:
        return sorted({r.tier for r in self.replicas.values()} | set(self.config.tier_names()))

    def in_tier(self, tier: str) -> list[Replica]:
        return [r for r in self.replicas.values() if r.tier == tier]

    def candidates(self, tier: str) -> list[Replica]:
        own = [r for r in self.replicas.values() if r.tier == tier and r.routable]
        if own or not any(r.tier == tier and r.swapping for r in self.replicas.values()):
            return own
        # The tier's only replicas are out for a weight rollout: borrow the others (same model)
        # meanwhile; the request keeps its tier (and tier price), x-yieldgate-replica says who served.
        return [r for r in self.replicas.values() if r.routable]

    def fallback(self, tier: str) -> tuple[str, list[Replica]]:
        """Where `tier`'s requests go while it has no routable replica: its configured fallback
        tier and that tier's routable replicas (one hop; fallbacks do not chain)."""
        other = self.config.tier(tier).fallback
        if not other or other == tier:
            return tier, []
        return other, [r for r in self.replicas.values() if r.tier == other and r.routable]

    def hold(self) -> None:
        """New requests that find no routable replica wait (see `wait_released`) until `release`."""
        self._released = asyncio.Event()

    def release(self) -> None:
        released, self._released = self._released, None
        if released is not None:
            released.set()

    async def wait_released(self, timeout_s: float) -> bool:
        """-> True once the fleet is released (at once if it is not held); False on timeout."""
        released = self._released
        if released is None:
            return True
        try:
            await asyncio.wait_for(released.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s))
        await self.check_health()
        await self.scrape()
        await self.discovery.start()
        self._tasks = [
            asyncio.create_task(self._every(self.config.health_interval_s, self.check_health)),
            asyncio.create_task(self._every(self.config.scrape_interval_s, self.scrape)),
        ]

    async def close(self) -> None:
        await self.discovery.close()
        tasks = self._tasks + list(self._restores.values()) + list(self._drains.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session:
            await self._session.close()

    async def _every(self, interval: float, fn) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()
            except Exception:  # a probe must never kill its loop
                log.exception("fleet probe failed")

    async def check_health(self) -> None:
        # Joining replicas are probed by their discovery pass (see `_join`), not here.
        await asyncio.gather(*(self._probe(r) for r in self.replicas.values() if not r.joining))

    # -- membership: discovered replicas join and leave ------------------------------------------

    async def reconcile(self, tier: str, source: str, found: list[ReplicaConfig]) -> None:
        """Make `tier`'s replicas from `source` the ones found: new ones are probed before they
        get traffic, missing ones drain and go, returning ones stay. Replicas of other sources
        (a static list, another tier) are never touched."""
        mine = {n: r for n, r in self.replicas.items() if r.tier == tier and r.source == source}
        wanted: dict[str, ReplicaConfig] = {}
        for config in found:
            other = self.replicas.get(config.name)
            if other is not None and other.name not in mine:
                log.warning("discovery for tier %s found %s, already a replica of tier %s (%s): skipped",
                            tier, config.name, other.tier, other.source)
                continue
            wanted[config.name] = config
        for name, replica in mine.items():
            if name not in wanted and not replica.leaving:
                self.leave(replica, f"no longer listed by {source}")
        joins = []
        for name, config in wanted.items():
            replica = mine.get(name)
            if replica is None:
                replica = self.replicas[name] = Replica(config, source=source, joining=True,
                                                        note="joining: not probed yet")
                log.warning("replica %s found by %s (tier %s): probing it before it gets traffic",
                            name, source, tier)
            elif replica.leaving:
                self._stay(replica)
            if replica.joining:
                joins.append(self._join(replica))
        await asyncio.gather(*joins)

    async def _join(self, replica: Replica) -> None:
        """Health, served model and KV capacity: all three read before the first request."""
        problem = await self._join_problem(replica)
        if replica.leaving or self.replicas.get(replica.name) is not replica:
            return  # left while it was being probed
        if problem:
            if replica.note != f"joining: {problem}":
                log.warning("replica %s cannot join yet: %s", replica.name, problem)
            replica.note = f"joining: {problem}"
            return
        await self._on_up(replica)  # label it with the weights its engine serves
        self.set_health(replica, True)
        for hook in self.on_join:
            try:
                await hook(replica)
            except Exception:  # a subscriber that cannot start must not keep a replica out
                log.exception("replica %s: join hook failed", replica.name)
        replica.joining, replica.note = False, ""
        log.warning("replica %s joined tier %s (%s): kv capacity %s blocks", replica.name, replica.tier,
                    replica.source, replica.kv_capacity_blocks)

    async def _join_problem(self, replica: Replica) -> str:
        assert self._session is not None
        try:
            async with self._session.get(replica.url + "/health") as resp:
                if resp.status != 200:
                    return f"/health answers {resp.status}"
            async with self._session.get(replica.url + "/v1/models") as resp:
                served = [m.get("id") for m in (await resp.json()).get("data", [])] if resp.status == 200 else []
            if self.config.model not in served:
                return f"/v1/models lists {served}, not {self.config.model!r}"
            async with self._session.get(replica.url + "/metrics") as resp:
                text = await resp.text() if resp.status == 200 else ""
            replica.engine_metrics, capacity = parse_engine_metrics(text)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return f"unreachable ({type(exc).__name__})"
        except (ValueError, AttributeError, TypeError) as exc:
            return f"unreadable answer ({type(exc).__name__})"
        if not capacity:
            return "/metrics has no KV capacity (vllm:cache_config_info num_gpu_blocks)"
        replica.kv_capacity_blocks = capacity
        return ""

    def leave(self, replica: Replica, why: str) -> None:
        """Out of routing at once; dropped from the fleet when its last in-flight request is over."""
        replica.leaving, replica.note = True, f"leaving: {why}"
        log.warning("replica %s leaves tier %s: %s (%d in flight)", replica.name, replica.tier, why,
                    replica.inflight)
        self._drains[replica.name] = asyncio.create_task(self._drain(replica))

    def _stay(self, replica: Replica) -> None:
        drain = self._drains.pop(replica.name, None)
        if drain is not None:
            drain.cancel()
        replica.leaving, replica.note = False, "joining: listed again" if replica.joining else ""
        log.warning("replica %s is listed again by %s: it stays", replica.name, replica.source)

    async def _drain(self, replica: Replica) -> None:
        while replica.inflight > 0:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.replicas.get(replica.name) is replica:
            del self.replicas[replica.name]
        self._drains.pop(replica.name, None)
        log.warning("replica %s drained and left the fleet", replica.name)
        if replica.joining:
            return  # never joined: nothing was set up for it
        for hook in self.on_leave:
            try:
                await hook(replica)
            except Exception:
                log.exception("replica %s: leave hook failed", replica.name)

    async def _probe(self, replica: Replica) -> None:
        assert self._session is not None
        try:
            async with self._session.get(replica.url + "/health") as resp:
                ok = resp.status == 200
        except asyncio.TimeoutError:  # before ClientError: aiohttp's timeouts are both
            replica.probe_timeouts += 1
            if replica.healthy and replica.probe_timeouts < self.config.health_timeouts_to_eject:
                log.info("replica %s: health probe timed out (%d in a row)", replica.name, replica.probe_timeouts)
                return
            ok = False
        except (aiohttp.ClientError, OSError):
            ok = False
        else:
            replica.probe_timeouts = 0
        if ok and not replica.healthy:
            await self._on_up(replica)
        self.set_health(replica, ok)

    async def _on_up(self, replica: Replica) -> None:
        """Label responses with what the engine really serves (it may have been updated before)."""
        started = await self._engine_started(replica)
        restarted = started is not None and replica.engine_started not in (None, started)
        if started is not None:
            replica.engine_started = started
        if restarted:
            self._restarted(replica)
        # Without a start time to tell, a replica seen before that returns on other weights is
        # taken for a restarted one.
        await self._check_weights(replica, restarted or (started is None and replica.seen_up))

    async def _check_weights(self, replica: Replica, restarted: bool) -> None:
        """An engine that restarted serves its launch weights: it stays out of routing until the
        restore hook has put its labelled version back. Otherwise the engine's own version is
        the label (a version another gateway pushed, say)."""
        # The answer may predate a swap that a rollout labelled while it was on its way (asked
        # before the engine committed, answered after the rollout verified): then it is dropped.
        generation = replica.weight_generation
        version = await self._engine_version(replica)
        if version is None or replica.weight_generation != generation or version == replica.weight_version:
            return
        if restarted and self.restore is not None and replica.name not in self._restores:
            log.warning("replica %s restarted serving %s, labelled %s: restoring its weights",
                        replica.name, version, replica.weight_version)
            replica.restoring = True
            self._restores[replica.name] = asyncio.create_task(self._restore(replica, version))
        elif replica.name not in self._restores:
            replica.weight_version = version

    def _restarted(self, replica: Replica) -> None:
        for hook in self.on_restart:
            try:
                hook(replica)
            except Exception:
                log.exception("replica %s: restart hook failed", replica.name)

    async def _engine_started(self, replica: Replica) -> float | None:
        assert self._session is not None
        try:
            async with self._session.get(replica.url + "/metrics") as resp:
                if resp.status != 200:
                    return None
                values, _ = parse_engine_metrics(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return None
        return values.get("process_start_time_seconds")

    async def _restore(self, replica: Replica, found: str) -> None:
        assert self.restore is not None
        try:
            await self.restore(replica, found)
        except Exception as exc:  # noqa: BLE001 - the replica stays out, saying why
            log.exception("replica %s: weight restore failed", replica.name)
            replica.admitted, replica.note = False, f"weight restore failed: {type(exc).__name__}: {exc}"
        finally:
            replica.restoring = False
            self._restores.pop(replica.name, None)

    async def _engine_version(self, replica: Replica) -> str | None:
        assert self._session is not None
        try:
            async with self._session.get(replica.url + "/weight_info") as resp:
                if resp.status == 200:
                    version = str((await resp.json()).get("weight_version") or ENGINE_BASE_VERSION)
                    return BASE_VERSION if version == ENGINE_BASE_VERSION else version
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            pass  # older engines without /weight_info keep the configured label
        return None

    def set_health(self, replica: Replica, ok: bool) -> None:
        if ok != replica.healthy:
            log.warning("replica %s is %s", replica.name, "up" if ok else "down")
        replica.healthy = ok
        replica.seen_up = replica.seen_up or ok
        replica.consecutive_failures = 0 if ok else replica.consecutive_failures + 1
        replica.last_health_at = time.monotonic()

    async def scrape(self) -> None:
        await asyncio.gather(*(self._scrape(r) for r in self.replicas.values() if r.healthy))

    async def _scrape(self, replica: Replica) -> None:
        assert self._session is not None
        try:
            async with self._session.get(replica.url + "/metrics") as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return
        try:
            values, capacity = parse_engine_metrics(text)
        except ValueError:  # not Prometheus text: not an engine we can read, not a reason to stop
            log.warning("replica %s: /metrics is not Prometheus text; engine metrics not read", replica.name)
            return
        replica.engine_metrics = values
        if capacity:
            replica.kv_capacity_blocks = capacity
        started = values.get("process_start_time_seconds")
        if started is not None and replica.engine_started not in (None, started):
            # Restarted between two health probes: never seen down, yet on its launch weights.
            replica.engine_started = started
            self._restarted(replica)
            await self._check_weights(replica, restarted=True)
        elif started is not None:
            replica.engine_started = started


def only_families(text: str, names: tuple[str, ...]) -> str:
    """The lines of Prometheus text that belong to these metric families (a name may match a
    longer one; the parser's sample names tell them apart). An engine's /metrics keeps growing:
    vLLM keeps a `vllm:lora_requests_info` series for every set of adapters it ever ran, and parsing
    all of that in pure Python held the gateway's event loop for seconds per scrape."""
    keep = names + tuple(f"# TYPE {n}" for n in names) + tuple(f"# HELP {n}" for n in names)
    return "\n".join(line for line in text.split("\n") if line.startswith(keep)) + "\n"


def parse_engine_metrics(text: str) -> tuple[dict[str, float], int | None]:
    """Sum the scraped series over their labels; also return the KV capacity in blocks."""
    values: dict[str, float] = {}
    capacity = None
    for family in text_string_to_metric_families(only_families(text, SCRAPED + ("vllm:cache_config_info",))):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in SCRAPED:
                values[name] = values.get(name, 0.0) + sample.value
            elif sample.name == "vllm:cache_config_info":
                blocks = sample.labels.get("num_gpu_blocks", "")
                capacity = int(blocks) if blocks.isdigit() else capacity
    return values, capacity
