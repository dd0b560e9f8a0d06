"""Health endpoints: liveness (/healthz), readiness (/readyz) and Prometheus (/metrics)."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter
from starlette.responses import Response

from yieldgate.serving import Fleet

from .drain import Drain
from .http import json_response
from .metrics import GatewayMetrics


def tier_health(fleet: Fleet, others: list[Fleet] = []) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Per tier: routable replicas, and which tier serves its requests now (its own, its
    fallback's, its fallback model's as "model/tier", or none); and the tiers without a routable
    replica of their own. `others`: the gateway's other models (fleet.fallback_model)."""
    tiers: dict[str, dict[str, Any]] = {}
    standby = next((f for f in others if f.config.model == fleet.config.fallback_model), None)
    for t in fleet.tiers():
        own = fleet.in_tier(t)
        routable = sum(r.routable for r in own)
        fallback, spare = fleet.fallback(t)
        served_by = t if routable else fallback if spare else None
        if served_by is None and standby is not None:
            there = next((u for u in (t, "standard") if standby.candidates(u) or standby.fallback(u)[1]), None)
            served_by = f"{standby.config.model}/{there}" if there else None
        tiers[t] = {"routable": routable, "replicas": len(own), "served_by": served_by}
    return tiers, [t for t, h in tiers.items() if not h["routable"]]


def model_health(fleets: list[Fleet]) -> tuple[dict[str, dict[str, Any]], list[str], dict[str, Any]]:
    """The first model's tiers and degraded tiers (as tier_health), and with several models each
    one's: degraded tiers of the others are named "model/tier"."""
    tiers, first_down = tier_health(fleets[0], fleets)
    down, models = list(first_down), {}
    for fleet in fleets[1:]:
        own, own_down = tier_health(fleet, fleets)
        models[fleet.config.model] = {"tiers": own, "degraded_tiers": own_down}
        down += [f"{fleet.config.model}/{t}" for t in own_down]
    if models:
        models = {fleets[0].config.model: {"tiers": tiers, "degraded_tiers": first_down}} | models
    return tiers, down, models


def build_health_router(fleets: list[Fleet], metrics: GatewayMetrics,
                        engine_status: Callable[[], dict[str, dict[str, Any]]], drain: Drain) -> APIRouter:
    """`fleets`: each model's (gateway/registry.py), the first model's first."""
    router = APIRouter()

    def every_tier() -> list[dict[str, Any]]:
        return [h for f in fleets for h in tier_health(f, fleets)[0].values()]

    @router.get("/healthz")
    async def healthz() -> Response:
        """Liveness: 200 while the process serves HTTP. The body says which tiers can serve:
        "degraded" names each tier without a routable replica, "unavailable" when no tier can
        serve at all (own replicas or fallback); with several models, each model's under "models"."""
        engines = engine_status()
        replicas = {r.name: {"tier": r.tier, "model": f.config.model, "healthy": r.healthy, "admitted": r.admitted,
                             "restoring": r.restoring, "inflight": r.inflight,
                             "weight_version": r.weight_version, "note": r.note,
                             **({"engine": engines[r.name]} if r.name in engines else {})}
                    for f in fleets for r in f.replicas.values()}
        tiers, down, models = model_health(fleets)
        everything = every_tier()
        stranded = [h for h in everything if h["served_by"] is None]
        status = "ok" if not down else "unavailable" if len(stranded) == len(everything) else "degraded"
        return json_response({"status": status, "degraded_tiers": down, "tiers": tiers, "replicas": replicas}
                             | ({"models": models} if models else {}))

    @router.get("/readyz")
    async def readyz() -> Response:
        """Readiness (what a load balancer routes by): 200 when every tier's requests of every model
        can be served, by its own replicas or its fallback tier's, and the gateway is not draining
        (SIGTERM); the body names degraded tiers."""
        tiers, down, models = model_health(fleets)
        everything = every_tier()
        ready = bool(everything) and all(h["served_by"] is not None for h in everything) and not drain.draining
        return json_response({"ready": ready, "draining": drain.draining, "degraded_tiers": down, "tiers": tiers}
                             | ({"models": models} if models else {}), 200 if ready else 503)

    def fleet_gauges() -> None:
        routable: dict[str, int] = {}
        for fleet in fleets:
            for r in fleet.replicas.values():
                metrics.replica_up.labels(r.name, r.tier).set(1 if r.routable else 0)
                metrics.inflight.labels(r.name).set(r.inflight)
            for tier in fleet.tiers():
                routable[tier] = routable.get(tier, 0) + sum(r.routable for r in fleet.in_tier(tier))
            for tier, status in fleet.discovery.status.items():
                metrics.discovery_stale.labels(tier).set(1 if status.stale else 0)
        for tier, count in routable.items():  # summed over models
            metrics.tier_routable.labels(tier).set(count)
        metrics.draining.set(1 if drain.draining else 0)

    metrics.on_render(fleet_gauges)  # also run by a worker's periodic publish (gateway/metrics.py)

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return router
