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

log = logging.getLogger("yieldgate.fleet")

# Called when a replica comes back serving other weights than its label (its engine restarted):
# puts the labelled version back, or leaves the replica out of routing saying why.
RestoreHook = Callable[["Replica", str], Awaitable[None]]

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
        return self.healthy and self.admitted and not self.restoring


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

    def tiers(self) -> list[str]:
        return sorted({r.tier for r in self.replicas.values()})

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
        self._tasks = [
            asyncio.create_task(self._every(self.config.health_interval_s, self.check_health)),
            asyncio.create_task(self._every(self.config.scrape_interval_s, self.scrape)),
        ]

    async def close(self) -> None:
        tasks = self._tasks + list(self._restores.values())
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
        await asyncio.gather(*(self._probe(r) for r in self.replicas.values()))

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
            await self._check_weights(replica, restarted=True)
        elif started is not None:
            replica.engine_started = started


def parse_engine_metrics(text: str) -> tuple[dict[str, float], int | None]:
    """Sum the scraped series over their labels; also return the KV capacity in blocks."""
    values: dict[str, float] = {}
    capacity = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in SCRAPED:
                values[name] = values.get(name, 0.0) + sample.value
            elif sample.name == "vllm:cache_config_info":
                blocks = sample.labels.get("num_gpu_blocks", "")
                capacity = int(blocks) if blocks.isdigit() else capacity
    return values, capacity
