"""FleetCostMeter: what serving a token actually costs (operating yield) vs what it is sold for.

Replicas cost their $/hour whether busy or idle, so actual cost per 1M tokens is
    hourly_usd * elapsed_hours / tokens_served * 1e6
and margin is list revenue minus the replica cost allocated to a (model, tier) by its token share.
Time is integer nanoseconds from a monotonic clock, so the arithmetic stays in Decimal.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from decimal import Decimal

import msgspec

from .config import PricingConfig, ReplicaCost
from .cost import Cost, Usage

NS_PER_HOUR = Decimal(3_600_000_000_000)
NS_PER_S = Decimal(1_000_000_000)
MILLION = Decimal(1_000_000)


class ReplicaYield(msgspec.Struct):
    replica: str
    hourly_usd: Decimal
    elapsed_s: Decimal
    cost_usd: Decimal
    tokens: int
    busy_s: Decimal
    utilization: Decimal          # busy time / elapsed time, 0..1 (can exceed 1 with batching)
    cost_per_mtok: Decimal | None  # None until the replica served a token


class TierYield(msgspec.Struct):
    model: str
    tier: str
    tokens: int
    requests: int
    list_revenue_usd: Decimal
    allocated_cost_usd: Decimal
    list_per_mtok: Decimal | None
    cost_per_mtok: Decimal | None
    margin_usd: Decimal
    margin_ratio: Decimal | None   # margin / revenue


class FleetYield(msgspec.Struct):
    replicas: list[ReplicaYield]
    tiers: list[TierYield]


class _Slice:
    __slots__ = ("tokens", "requests", "revenue")

    def __init__(self) -> None:
        self.tokens = 0
        self.requests = 0
        self.revenue = Decimal(0)


class FleetCostMeter:
    def __init__(self, config: PricingConfig | None = None,
                 clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self._replicas: dict[str, ReplicaCost] = dict((config or PricingConfig()).replicas)
        self._clock = clock_ns
        self._started: dict[str, int] = {}
        self._tokens: dict[str, int] = {}
        self._busy_ns: dict[str, int] = {}
        self._slices: dict[tuple[str, str, str], _Slice] = {}  # (replica, model, tier)
        now = clock_ns()
        for name in self._replicas:
            self._start(name, now)

    def _start(self, replica: str, now: int) -> None:
        self._started.setdefault(replica, now)
        self._tokens.setdefault(replica, 0)
        self._busy_ns.setdefault(replica, 0)

    def add_replica(self, replica: str, hourly_usd: Decimal, tier: str = "", model: str = "") -> None:
        """Register a replica (e.g. scaled up at runtime); its cost accrues from now."""
        self._replicas[replica] = ReplicaCost(hourly_usd=hourly_usd, tier=tier or None, model=model or None)
        self._start(replica, self._clock())

    def observe(self, replica: str, model: str, tier: str, usage: Usage, list_cost: Cost,
                busy_ns: int = 0) -> None:
        """Account one finished request; busy_ns is its wall time on the replica (optional)."""
        if replica not in self._started:
            self._start(replica, self._clock())
        tokens = usage.total_tokens
        self._tokens[replica] += tokens
        self._busy_ns[replica] += busy_ns
        s = self._slices.get((replica, model, tier))
        if s is None:
            s = self._slices[(replica, model, tier)] = _Slice()
        s.tokens += tokens
        s.requests += 1
        s.revenue += list_cost.total

    def report(self) -> FleetYield:
        now = self._clock()
        replicas: list[ReplicaYield] = []
        replica_cost: dict[str, Decimal] = {}
        for name, started in sorted(self._started.items()):
            hourly = self._replicas[name].hourly_usd if name in self._replicas else Decimal(0)
            elapsed = Decimal(now - started)
            cost = hourly * elapsed / NS_PER_HOUR
            replica_cost[name] = cost
            tokens = self._tokens[name]
            busy = Decimal(self._busy_ns[name])
            replicas.append(ReplicaYield(
                replica=name, hourly_usd=hourly, elapsed_s=elapsed / NS_PER_S, cost_usd=cost,
                tokens=tokens, busy_s=busy / NS_PER_S,
                utilization=busy / elapsed if elapsed else Decimal(0),
                cost_per_mtok=cost * MILLION / tokens if tokens else None))
        # Allocate each replica's cost to the (model, tier) slices it served, by token share.
        agg: dict[tuple[str, str], list] = {}
        for (replica, model, tier), s in self._slices.items():
            share = Decimal(s.tokens) / self._tokens[replica] if self._tokens[replica] else Decimal(0)
            a = agg.setdefault((model, tier), [0, 0, Decimal(0), Decimal(0)])
            a[0] += s.tokens
            a[1] += s.requests
            a[2] += s.revenue
            a[3] += replica_cost[replica] * share
        tiers = []
        for (model, tier), (tokens, requests, revenue, cost) in sorted(agg.items()):
            margin = revenue - cost
            tiers.append(TierYield(
                model=model, tier=tier, tokens=tokens, requests=requests, list_revenue_usd=revenue,
                allocated_cost_usd=cost,
                list_per_mtok=revenue * MILLION / tokens if tokens else None,
                cost_per_mtok=cost * MILLION / tokens if tokens else None,
                margin_usd=margin, margin_ratio=margin / revenue if revenue else None))
        return FleetYield(replicas=replicas, tiers=tiers)
