"""Admin API (/admin/*): every route needs the admin credential."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Request

if TYPE_CHECKING:
    from .app import Gateway


def build_admin_router(gw: "Gateway") -> APIRouter:
    def admin(request: Request) -> None:
        gw.require_admin(request)

    router = APIRouter(prefix="/admin", dependencies=[Depends(admin)])

    @router.get("/fleet")
    async def fleet() -> dict:
        return {name: {"tier": r.tier, "url": r.url, "healthy": r.healthy, "admitted": r.admitted,
                       "inflight": r.inflight, "weight_version": r.weight_version,
                       "kv_capacity_blocks": r.kv_capacity_blocks, "engine_metrics": r.engine_metrics}
                for name, r in gw.fleet.replicas.items()}

    return router
