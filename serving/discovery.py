"""Replica discovery: where a tier's replicas come from while the gateway runs.

A `ReplicaSource` answers "which replicas are there now" (`resolve`); `Discovery` asks each
discovered tier's source every `interval_s` and hands the answer to the fleet, which probes new
replicas before they get traffic and drains the ones that left (serving/fleet.py). A failed or
unreadable answer keeps the last good set: a DNS outage must never empty a serving fleet.
Sources: `StaticSource` (a fixed list), `DnsSource` (A/AAAA + port, or SRV) and `KubernetesSource`
(serving/kubernetes.py: EndpointSlices or pods by label selector, watched).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver

from .config import DiscoveryConfig, FleetConfig, ReplicaConfig, nameserver_address
from .kubernetes import KubernetesSource
from .source import DiscoveryError, ReplicaSource, host_port

__all__ = ["Discovery", "DiscoveryError", "DnsSource", "KubernetesSource", "ReplicaSource", "StaticSource",
           "host_port", "sources_for"]

log = logging.getLogger("yieldgate.discovery")

# (tier, source label, replicas found) -> the fleet joins and drains replicas to match.
Reconcile = Callable[[str, str, list[ReplicaConfig]], Awaitable[None]]
# (tier, reason) on every failed lookup; reason is a short label: nxdomain, no_answer, timeout, ...
FailureHook = Callable[[str, str], None]


class StaticSource:
    """A fixed list: what [[fleet.replicas]] gives a tier."""

    def __init__(self, tier: str, replicas: list[ReplicaConfig], label: str = "static"):
        self.tier, self.label, self.replicas = tier, label, list(replicas)

    async def resolve(self) -> list[ReplicaConfig]:
        return list(self.replicas)

    async def close(self) -> None:
        pass


class DnsSource:
    """A name re-resolved on every call: A and AAAA records plus the configured port, or SRV
    records (of the lowest priority present, as SRV clients do) whose targets are resolved in turn.
    Each address:port is one replica, named after it."""

    def __init__(self, tier: str, config: DiscoveryConfig):
        self.tier, self.config = tier, config
        self.label = f"dns:{'srv:' if config.srv else ''}{config.name}"
        self.name = dns.name.from_text(config.name)  # absolute: no search domains
        self.resolver = dns.asyncresolver.Resolver(configure=not config.nameservers)
        if config.nameservers:
            self.resolver.nameservers = [dns.nameserver.Do53Nameserver(*nameserver_address(ns))
                                         for ns in config.nameservers]
        self.resolver.lifetime = config.timeout_s
        self.resolver.timeout = config.timeout_s

    async def resolve(self) -> list[ReplicaConfig]:
        if self.config.srv:
            endpoints = await self._srv()
        else:
            endpoints = [(a, self.config.port) for a in await self._addresses(self.name)]
        if not endpoints:
            raise DiscoveryError("empty", f"{self.config.name} lists no replica")
        return [self._replica(address, port) for address, port in sorted(set(endpoints))]

    async def close(self) -> None:
        pass

    def _replica(self, address: str, port: int) -> ReplicaConfig:
        where = host_port(address, port)
        kv = self.config.kv_events_port
        return ReplicaConfig(name=where, tier=self.tier, url=f"http://{where}",
                             cost_per_hour=self.config.cost_per_hour,
                             kv_events_endpoint=f"tcp://{host_port(address, kv)}" if kv else "")

    async def _srv(self) -> list[tuple[str, int]]:
        answer = await self._query(self.name, "SRV")
        records = [rr for rr in answer if rr.target != dns.name.root]  # "." = no service here
        if not records:
            return []
        best = min(rr.priority for rr in records)
        out: list[tuple[str, int]] = []
        for rr in records:
            if rr.priority != best:
                continue
            try:
                out += [(a, rr.port) for a in await self._addresses(rr.target)]
            except DiscoveryError as exc:
                if exc.reason not in ("no_answer", "nxdomain"):
                    raise  # cannot tell whether the target is there: the whole answer is unusable
                log.info("SRV target %s of %s has no address: skipped", rr.target, self.config.name)
        return out

    async def _addresses(self, name: dns.name.Name) -> list[str]:
        found: list[str] = []
        missing: DiscoveryError | None = None
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self._query(name, rdtype)
            except DiscoveryError as exc:
                if exc.reason not in ("no_answer", "nxdomain"):
                    raise
                missing = missing or exc
                continue
            found += [str(ipaddress.ip_address(rr.address)) for rr in answer]
        if not found and missing is not None:
            raise missing
        return found

    async def _query(self, name: dns.name.Name, rdtype: str) -> dns.resolver.Answer:
        try:
            return await self.resolver.resolve(name, rdtype, search=False)
        except dns.resolver.NXDOMAIN:
            raise DiscoveryError("nxdomain", f"{name} {rdtype}: no such name") from None
        except dns.resolver.NoAnswer:
            raise DiscoveryError("no_answer", f"{name} {rdtype}: no records") from None
        except dns.resolver.LifetimeTimeout:
            raise DiscoveryError("timeout", f"{name} {rdtype}: no answer in {self.config.timeout_s}s") from None
        except dns.resolver.NoNameservers as exc:
            raise DiscoveryError("servfail", f"{name} {rdtype}: {exc}") from None
        except (dns.exception.DNSException, ValueError) as exc:  # malformed answers among them
            raise DiscoveryError("unreadable", f"{name} {rdtype}: {type(exc).__name__}: {exc}") from None


SOURCE_KINDS: dict[str, type] = {"dns": DnsSource, "kubernetes": KubernetesSource}


def sources_for(config: FleetConfig) -> list[ReplicaSource]:
    """One source per tier whose replicas are discovered; static tiers need none (their replicas
    are the listed ones, in the fleet from the start)."""
    sources: list[ReplicaSource] = []
    for tier in sorted(config.tiers):
        discovery = config.tiers[tier].discovery
        kind = SOURCE_KINDS.get(discovery.kind)
        if kind is not None:
            sources.append(kind(tier, discovery))
    return sources


@dataclass
class SourceStatus:
    tier: str
    source: str
    interval_s: float
    replicas: int = 0             # in the last good answer
    lookups: int = 0
    failures: int = 0
    stale: bool = False           # the last lookup failed: the fleet keeps the last good set
    last_error: str = ""
    last_ok_at: float | None = None  # time.time()


class Discovery:
    """Re-resolves each source every interval and hands good answers to `reconcile`."""

    def __init__(self, sources: list[ReplicaSource], reconcile: Reconcile,
                 intervals: dict[str, float] | None = None):
        self.sources = sources
        self.reconcile = reconcile
        self.on_failure: FailureHook | None = None
        self.status = {s.tier: SourceStatus(s.tier, s.label, (intervals or {}).get(s.tier, 5.0))
                       for s in sources}
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """The first lookups are awaited: a gateway starts with the replicas there already are."""
        await asyncio.gather(*(self.refresh(s) for s in self.sources))
        self._tasks = [asyncio.create_task(self._loop(s)) for s in self.sources]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for source in self.sources:
            await source.close()

    async def _loop(self, source: ReplicaSource) -> None:
        while True:
            await asyncio.sleep(self.status[source.tier].interval_s)
            try:
                await self.refresh(source)
            except Exception:  # a bug in one pass must not end discovery for good
                log.exception("discovery pass for tier %s failed", source.tier)

    async def refresh(self, source: ReplicaSource) -> None:
        status = self.status[source.tier]
        status.lookups += 1
        try:
            found = await source.resolve()
        except DiscoveryError as exc:
            status.failures += 1
            status.stale, status.last_error = True, f"{exc.reason}: {exc}"
            log.warning("discovery for tier %s (%s) failed: %s; keeping the last good set (%d replicas)",
                        source.tier, source.label, status.last_error, status.replicas)
            if self.on_failure is not None:
                self.on_failure(source.tier, exc.reason)
            return
        if status.stale:
            log.warning("discovery for tier %s (%s) answers again: %d replicas", source.tier, source.label,
                        len(found))
        status.stale, status.last_error = False, ""
        status.replicas, status.last_ok_at = len(found), time.time()
        await self.reconcile(source.tier, source.label, found)
