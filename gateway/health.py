"""Health endpoints: liveness (/healthz), readiness (/readyz) and Prometheus (/metrics)."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter
from starlette.responses import Response

from yieldgate.serving import Fleet

from .drain import Drain
from .http import json_response
from .metrics import GatewayMetrics


def tier_health(fleet: Fleet) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Per tier: routable replicas, and which tier serves its requests now (its own, its
    fallback's, or none); and the tiers without a routable replica of their own."""
    tiers: dict[str, dict[str, Any]] = {}
    for t in fleet.tiers():
        own = fleet.in_tier(t)
        routable = sum(r.routable for r in own)
        fallback, spare = fleet.fallback(t)
        tiers[t] = {"routable": routable, "replicas": len(own),
                    "served_by": t if routable else fallback if spare else None}
    return tiers, [t for t, h in tiers.items() if not h["routable"]]


def build_health_router(fleet: Fleet, metrics: GatewayMetrics,
                        engine_status: Callable[[], dict[str, dict[str, Any]]], drain: Drain) -> APIRouter:
    router = APIRouter()

    @router.get("/healthz")
    async def healthz() -> Response:
        """Liveness: 200 while the process serves HTTP. The body says which tiers can serve:
        "degraded" names each tier without a routable replica, "unavailable" when no tier can
        serve at all (own replicas or fallback)."""
        engines = engine_status()
        replicas = {r.name: {"tier": r.tier, "healthy": r.healthy, "admitted": r.admitted,
                             "restoring": r.restoring, "inflight": r.inflight,
                             "weight_version": r.weight_version, "note": r.note,
                             **({"engine": engines[r.name]} if r.name in engines else {})}
                    for r in fleet.replicas.values()}
        tiers, down = tier_health(fleet)
        stranded = [t for t in down if tiers[t]["served_by"] is None]
        status = "ok" if not down else "unavailable" if len(stranded) == len(tiers) else "degraded"
        return json_response({"status": status, "degraded_tiers": down, "tiers": tiers, "replicas": replicas})

    @router.get("/readyz")
    async def readyz() -> Response:
        """Readiness (what a load balancer routes by): 200 when every tier's requests can be
        served, by its own replicas or its fallback tier's, and the gateway is not draining (SIGTERM);
        the body names degraded tiers."""
        tiers, down = tier_health(fleet)
        ready = bool(tiers) and all(h["served_by"] is not None for h in tiers.values()) and not drain.draining
        return json_response({"ready": ready, "draining": drain.draining, "degraded_tiers": down, "tiers": tiers},
                             200 if ready else 503)

    def fleet_gauges() -> None:
        for r in fleet.replicas.values():
            metrics.replica_up.labels(r.name, r.tier).set(1 if r.routable else 0)
            metrics.inflight.labels(r.name).set(r.inflight)
        for tier in fleet.tiers():
            metrics.tier_routable.labels(tier).set(sum(r.routable for r in fleet.in_tier(tier)))
        metrics.draining.set(1 if drain.draining else 0)
        for tier, status in fleet.discovery.status.items():
            metrics.discovery_stale.labels(tier).set(1 if status.stale else 0)

    metrics.on_render(fleet_gauges)  # also run by a worker's periodic publish (gateway/metrics.py)

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return router
