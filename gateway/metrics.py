"""Prometheus metrics (prefix `yieldgate_`), in a registry per app so tests can run several.

With several workers on one port (gateway/workers.py) prometheus_client runs in multiprocess mode
(PROMETHEUS_MULTIPROC_DIR, set by the parent before the workers start): each worker writes its
values to files there, and a scrape, whichever worker answers it, reads them all. Counters and
histograms are summed over every worker that ever ran; each gauge says how its workers' values
combine (MULTIPROCESS_MODE below), and gauges of workers that exited are dropped.
"""

from __future__ import annotations

import asyncio
import os
from bisect import bisect_left
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

# prometheus_client's own switch: set, every value lives in files under this directory.
MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
# How often a worker writes its batched counts and scrape-time gauges for the others' scrapes.
PUBLISH_INTERVAL_S = 1.0

# How each gauge's per-worker values combine in one scrape (multiprocess mode only).
MULTIPROCESS_MODE = {
    "yieldgate_gateway_info": "livesum",          # one series per live worker's instance id
    "yieldgate_gateway_draining": "livemax",      # draining once any worker is (they drain together)
    "yieldgate_inflight_requests": "livesum",     # requests in flight per replica, all workers
    "yieldgate_replica_up": "livemin",            # up only if every worker routes to it
    "yieldgate_tier_routable_replicas": "livemin",
    "yieldgate_discovery_stale": "livemax",
    "yieldgate_ledger_pending_bytes": "livesum",  # each worker has its own journal
    "yieldgate_budget_remaining_usd": "livemostrecent",  # read from the shared store: any worker's latest
    # Ratios since each worker's start over its own traffic: not summable, so one series per worker (pid).
    "yieldgate_cache_hit_ratio": "liveall",
    "yieldgate_list_revenue_per_mtok_usd": "liveall",
    "yieldgate_actual_cost_per_mtok_usd": "liveall",
    "yieldgate_margin_ratio": "liveall",
    "yieldgate_replica_utilization": "liveall",
}


def _gauge(name: str, documentation: str, labels: Any = (), **kwargs: Any) -> Gauge:
    return Gauge(name, documentation, labels, multiprocess_mode=MULTIPROCESS_MODE[name], **kwargs)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class CounterBatch:
    """Counter increments and histogram observations gathered on the request path and applied to
    Prometheus at scrape time: a dict update costs a fraction of prometheus_client's locked inc(),
    and a dozen counters move per request. Histogram observations are counted into buckets here
    (one bisect) and added bucket by bucket at the scrape, so a scrape costs the same however many
    requests came since (observing each one then would stall the event loop)."""

    __slots__ = ("_pending", "_observed")

    def __init__(self) -> None:
        self._pending: dict[Any, Any] = {}
        self._observed: dict[Any, list[float]] = {}  # histogram child -> [sum, count per bucket...]

    def inc(self, child: Any, amount: Any = 1) -> None:
        """Add `amount` (int, float or Decimal) to a labelled Counter child."""
        pending = self._pending
        pending[child] = pending.get(child, 0) + amount

    def observe(self, child: Any, amount: float) -> None:
        """Histogram.observe(amount) on a labelled Histogram child, applied at the next scrape."""
        counts = self._observed.get(child)
        if counts is None:
            counts = self._observed[child] = [0.0] * (len(child._upper_bounds) + 1)
        counts[0] += amount
        # prometheus_client puts a value in the first bucket whose upper bound is >= it.
        counts[bisect_left(child._upper_bounds, amount) + 1] += 1

    def apply(self) -> None:
        pending, self._pending = self._pending, {}
        for child, amount in pending.items():
            child.inc(float(amount))
        observed, self._observed = self._observed, {}
        for child, counts in observed.items():
            # What observe() does, summed: the sum, then one count per bucket (cumulated at export).
            child._sum.inc(counts[0])
            for bucket, n in zip(child._buckets, counts[1:]):
                if n:
                    bucket.inc(n)


class GatewayMetrics:
    def __init__(self, instance_id: str = "", adapter_series: int = 32) -> None:
        self.batch = CounterBatch()
        # Adapters with series of their own (first come); the rest are counted as "other".
        self.adapter_series_cap = adapter_series
        self._adapters_seen: set[str] = set()
        self.registry = r = CollectorRegistry()
        # Which gateway these series come from, for joins when several share a dashboard:
        # yieldgate_requests_total * on(instance) group_left(instance_id) yieldgate_gateway_info.
        self.info = _gauge("yieldgate_gateway_info", "1, labelled with this gateway's instance id",
                          ["instance_id"], registry=r)
        self.info.labels(instance_id).set(1)
        self.draining = _gauge("yieldgate_gateway_draining", "1 once SIGTERM made the gateway drain",
                              registry=r)
        self.requests = Counter(
            "yieldgate_requests", "Requests by endpoint, tier and HTTP status",
            ["endpoint", "tier", "status"], registry=r)
        self.tokens = Counter(
            "yieldgate_tokens", "Tokens by kind (prompt, cached, uncached, completion), tier and model",
            ["kind", "tier", "model"], registry=r)
        self.ttft = Histogram(
            "yieldgate_ttft_seconds", "Time to first byte of the upstream answer",
            ["tier"], buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram(
            "yieldgate_request_duration_seconds", "End-to-end request duration at the gateway",
            ["tier"], buckets=_LATENCY_BUCKETS, registry=r)
        self.inflight = _gauge(
            "yieldgate_inflight_requests", "Requests in flight per replica", ["replica"], registry=r)
        self.replica_up = _gauge(
            "yieldgate_replica_up", "1 when the replica is healthy and admitted", ["replica", "tier"],
            registry=r)
        self.tier_routable = _gauge(
            "yieldgate_tier_routable_replicas", "Replicas of the tier that are healthy and admitted", ["tier"],
            registry=r)
        self.failovers = Counter(
            "yieldgate_tier_failovers", "Requests served by another tier while theirs had no routable replica",
            ["requested_tier", "served_tier"], registry=r)
        self.model_fallbacks = Counter(
            "yieldgate_model_fallbacks", "Requests served by another model while theirs had no routable "
            "replica (fleet.fallback_model)", ["requested_model", "served_model"], registry=r)
        self.engine_restarts = Counter(
            "yieldgate_engine_restarts", "Launched engines restarted by the supervisor", ["replica", "reason"],
            registry=r)
        self.retries = Counter(
            "yieldgate_upstream_retries", "Requests retried on another replica", ["tier"], registry=r)
        self.predicted_cached = Counter(
            "yieldgate_predicted_cached_tokens", "Cached tokens the router predicted", ["tier"],
            registry=r)
        self.prediction_error = Histogram(
            "yieldgate_cache_prediction_error_tokens",
            "Absolute difference between predicted and reported cached tokens", ["tier"],
            buckets=(0, 16, 32, 64, 128, 256, 512, 1024, 4096), registry=r)
        self.cost = Counter(
            "yieldgate_cost_usd", "List-price spend by kind (uncached_input, cached_input, output)",
            ["kind", "tier", "model"], registry=r)
        self.adapter_requests = Counter(
            "yieldgate_adapter_requests", "Requests answered by a LoRA adapter, by adapter and version (name@version); "
            "adapters beyond the series cap are counted as adapter=\"other\"",
            ["adapter", "weight_version"], registry=r)
        self.adapter_cost = Counter(
            "yieldgate_adapter_cost_usd", "List-price spend on LoRA adapters, by adapter and version",
            ["adapter", "weight_version"], registry=r)
        self.rejections = Counter(
            "yieldgate_rejections", "Requests refused before reaching an engine, by reason",
            ["reason"], registry=r)
        self.soft_budget_exceeded = Counter(
            "yieldgate_soft_budget_exceeded", "Requests served while their key is over its soft budget",
            ["key", "team"], registry=r)
        # Inference economics. Ratios and per-1M figures are gauges refreshed at scrape time from
        # the accounting state, so the request path only bumps counters.
        self.cache_hit_ratio = _gauge(
            "yieldgate_cache_hit_ratio", "Cached / prompt tokens since start", ["tier", "model"],
            registry=r)
        self.list_per_mtok = _gauge(
            "yieldgate_list_revenue_per_mtok_usd",
            "List-price revenue per 1M tokens served since start", ["tier", "model"], registry=r)
        self.actual_per_mtok = _gauge(
            "yieldgate_actual_cost_per_mtok_usd",
            "Replica cost (hourly, busy or idle) allocated per 1M tokens served since start",
            ["tier", "model"], registry=r)
        self.margin_ratio = _gauge(
            "yieldgate_margin_ratio", "(list revenue - allocated replica cost) / list revenue",
            ["tier", "model"], registry=r)
        self.replica_utilization = _gauge(
            "yieldgate_replica_utilization", "Request-busy time / elapsed time per replica",
            ["replica"], registry=r)
        self.budget_remaining = _gauge(
            "yieldgate_budget_remaining_usd",
            "Budget minus spent and reserved for the current period, per API key", ["key_id", "team"],
            registry=r)
        self.aborted_estimated_tokens = Counter(
            "yieldgate_aborted_estimated_tokens",
            "Tokens billed on an estimate because the client left a stream early", ["kind", "tier"],
            registry=r)
        self.ledger_pending_bytes = _gauge(
            "yieldgate_ledger_pending_bytes", "Journal bytes not yet confirmed by the ledger store",
            registry=r)
        self.discovery_failures = Counter(
            "yieldgate_discovery_failures",
            "Replica lookups that gave no usable answer (the tier kept its last good set), by reason",
            ["tier", "reason"], registry=r)
        self.discovery_stale = _gauge(
            "yieldgate_discovery_stale",
            "1 while the tier's last replica lookup failed and its last good set is kept", ["tier"],
            registry=r)
        self.membership = Counter(
            "yieldgate_replica_membership_changes",
            "Discovered replicas that joined (passed their probes) or left (drained) a tier",
            ["tier", "change"], registry=r)
        self._refresh: list[Callable[[], None]] = []

    def adapter_series(self, adapter: str, weight_version: str) -> tuple[str, str]:
        """The (adapter, weight_version) labels of a request's adapter: its own for the first
        `adapter_series` adapters seen, ("other", "other") for the rest (bounded cardinality)."""
        if adapter in self._adapters_seen:
            return adapter, weight_version
        if len(self._adapters_seen) < self.adapter_series_cap:
            self._adapters_seen.add(adapter)
            return adapter, weight_version
        return "other", "other"

    def on_render(self, refresh: Callable[[], None]) -> None:
        """Run `refresh` before every scrape (sets the gauges derived from accounting state)."""
        self._refresh.append(refresh)

    def publish(self) -> None:
        """Scrape-time gauges set and batched counts applied (in multiprocess mode: written where
        the other workers' scrapes read them)."""
        for refresh in self._refresh:
            refresh()
        self.batch.apply()

    def render(self) -> bytes:
        self.publish()
        if MULTIPROCESS:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)

    async def publish_every(self, interval_s: float = PUBLISH_INTERVAL_S) -> None:
        """Multiprocess mode: publish periodically, so that a scrape answered by another worker
        counts this one's requests (at most `interval_s` late)."""
        while True:
            await asyncio.sleep(interval_s)
            self.publish()
