"""Admin API (/admin/*, admin bearer token only) and the public feedback endpoint.

Money in these JSON answers is encoded as JSON numbers printed from the exact Decimals; the CSV
exports carry the same Decimals as text.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from datetime import datetime, timezone
from decimal import Decimal
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from fastapi import APIRouter, Depends, Request
from msgspec import Meta
from starlette.responses import Response

from yieldgate.pricing import KeyNotFound, StoreUnavailable, UsageRow
from yieldgate.pricing.keys import BudgetKind, BudgetPeriod
from yieldgate.pricing.report import DIMENSIONS

from .accounting import usd
from .errors import InvalidRequest, NotFound, ServiceUnavailable
from .http import decode_body, json_response

if TYPE_CHECKING:
    from yieldgate.serving import Fleet
    from yieldgate.trainer_bridge.orchestrator import WeightOrchestrator

    from .accounting import Accounting

_Positive = Annotated[int, Meta(ge=1)]


class KeyCreate(msgspec.Struct, forbid_unknown_fields=True):
    team: Annotated[str, Meta(max_length=128)] = ""
    name: Annotated[str, Meta(max_length=128)] = ""
    budget_usd: Decimal | None = None     # >= 0, checked in __post_init__ (msgspec has no Decimal bounds)
    budget_kind: BudgetKind = "hard"
    budget_period: BudgetPeriod = "monthly"
    rpm: _Positive | None = None
    tpm: _Positive | None = None

    def __post_init__(self) -> None:
        if self.budget_usd is not None and (not self.budget_usd.is_finite() or self.budget_usd < 0):
            raise ValueError("budget_usd must be a finite amount >= 0")


class Feedback(msgspec.Struct, forbid_unknown_fields=True):
    request_id: str | None = None
    session_id: str | None = None
    passed: bool | None = None
    score: Annotated[float, Meta(ge=0, le=1)] | None = None
    note: Annotated[str, Meta(max_length=1024)] = ""


def plain(amount: Decimal) -> Decimal:
    """Same amount, printed without an exponent (0E-9 -> 0)."""
    return Decimal(usd(amount))


def parse_time(value: str | None, param: str) -> float | None:
    """Unix seconds or an ISO 8601 date/time (UTC unless it says otherwise)."""
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidRequest(f"{param} must be unix seconds or ISO 8601, got {value!r}.",
                             param=param) from None
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


def parse_group_by(value: str, default: str) -> tuple[str, ...]:
    groups = tuple(g.strip() for g in (value or default).split(",") if g.strip())
    unknown = [g for g in groups if g not in DIMENSIONS]
    if unknown:
        raise InvalidRequest(f"cannot group by {unknown}; choose from {sorted(DIMENSIONS)}",
                             param="group_by")
    return groups


def usage_csv(rows: list[UsageRow], group_by: tuple[str, ...]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    fields = [f for f in UsageRow.__struct_fields__ if f != "group"]
    writer.writerow([*group_by, *fields])
    for row in rows:
        values = (getattr(row, f) for f in fields)
        writer.writerow([*(row.group.get(g) or "" for g in group_by),
                         *(usd(v) if isinstance(v, Decimal) else v for v in values)])
    return out.getvalue()


def build_admin_router(admin: Callable[[Request], None], fleet: "Fleet",
                       engine_status: Callable[[], dict[str, dict]], accounting: "Accounting",
                       weights: "WeightOrchestrator") -> APIRouter:
    """/admin/*: every route needs the admin credential; each group reads only what it serves."""
    router = APIRouter(prefix="/admin", dependencies=[Depends(admin)])
    add_fleet_routes(router, fleet, engine_status)
    add_key_routes(router, accounting)
    add_report_routes(router, accounting)
    from .weights import build_weights_admin_routes  # weights imports this module's helpers
    build_weights_admin_routes(router, weights)
    return router


def add_fleet_routes(router: APIRouter, fleet: "Fleet", engine_status: Callable[[], dict[str, dict]]) -> None:
    @router.get("/fleet")
    async def fleet_state() -> dict:
        engines = engine_status()  # launched engines: supervisor state, restarts, why down
        return {name: {"tier": r.tier, "url": r.url, "source": r.source, "state": r.state,
                       "healthy": r.healthy, "admitted": r.admitted,
                       "restoring": r.restoring, "note": r.note,
                       "inflight": r.inflight, "weight_version": r.weight_version,
                       "kv_capacity_blocks": r.kv_capacity_blocks, "engine_metrics": r.engine_metrics,
                       **({"engine": engines[name]} if name in engines else {})}
                for name, r in fleet.replicas.items()}

    @router.get("/discovery")
    async def discovery() -> Response:
        """Per discovered tier: its source, the last lookup's outcome, and whether the fleet is
        running on the last good set because lookups fail."""
        return json_response({tier: dataclasses.asdict(status) for tier, status in fleet.discovery.status.items()})


def record_unavailable(exc: StoreUnavailable) -> ServiceUnavailable:
    # Keys change only in their record: a key whose only copy is a cache could vanish with it.
    return ServiceUnavailable(f"The key record (PostgreSQL) is unreachable; keys cannot be created, "
                              f"changed or listed until it is back ({exc}).", code="key_record_unavailable")


def add_key_routes(router: APIRouter, acc: "Accounting") -> None:
    @router.post("/keys")
    async def create_key(request: Request) -> Response:
        spec: KeyCreate = await decode_body(request, KeyCreate)
        assert acc.keys is not None
        try:
            created = await acc.keys.create(
                spec.team, name=spec.name, budget_usd=spec.budget_usd, budget_kind=spec.budget_kind,
                budget_period=spec.budget_period, rpm=spec.rpm, tpm=spec.tpm)
        except StoreUnavailable as exc:
            raise record_unavailable(exc) from None
        return json_response({"key": created.key, "secret": created.secret,
                              "note": "The secret is shown once; only its HMAC is stored."}, 201)

    @router.get("/keys")
    async def list_keys(team: str | None = None) -> Response:
        assert acc.keys is not None and acc.budget is not None
        out = []
        try:
            keys = await acc.keys.list(team)
        except StoreUnavailable as exc:
            raise record_unavailable(exc) from None
        for key in keys:
            entry: dict[str, Any] = {"key": key}
            if key.budget_usd is not None:
                status = await acc.budget.status(key)
                remaining = key.budget_usd - status.spent_usd - status.reserved_usd
                entry["budget"] = {"period": status.period, "spent_usd": plain(status.spent_usd),
                                   "reserved_usd": plain(status.reserved_usd),
                                   "remaining_usd": plain(remaining)}
            out.append(entry)
        return json_response({"data": out})

    @router.delete("/keys/{key_id}")
    async def revoke_key(key_id: str) -> Response:
        assert acc.keys is not None
        try:
            key = await acc.keys.revoke(key_id)
        except KeyNotFound:
            raise NotFound(f"No API key with id {key_id!r}.") from None
        except StoreUnavailable as exc:
            raise record_unavailable(exc) from None
        return json_response({"key": key, "revoked": True})


def add_report_routes(router: APIRouter, acc: "Accounting") -> None:
    async def usage(group_by: str, since: str | None, until: str | None) -> tuple[list[str], list]:
        groups = parse_group_by(group_by, "key_id,team")
        ledger = await acc.flushed_ledger()
        rows = await ledger.usage(groups, since=parse_time(since, "since"), until=parse_time(until, "until"))
        return groups, rows

    @router.get("/spend")
    async def spend(group_by: str = "key_id,team", since: str | None = None,
                    until: str | None = None) -> Response:
        groups, rows = await usage(group_by, since, until)
        return json_response({"group_by": groups, "rows": rows,
                              "total_usd": sum((r.cost_total for r in rows), Decimal(0)),
                              "requests": sum(r.requests for r in rows)})

    @router.get("/spend.csv")
    async def spend_csv(group_by: str = "key_id,team", since: str | None = None,
                        until: str | None = None) -> Response:
        groups, rows = await usage(group_by, since, until)
        return Response(usage_csv(rows, groups), media_type="text/csv")

    @router.get("/ledger.csv")
    async def ledger_csv(since: str | None = None, until: str | None = None) -> Response:
        ledger = await acc.flushed_ledger()
        out = io.StringIO()
        await ledger.export_csv(out, since=parse_time(since, "since"), until=parse_time(until, "until"))
        return Response(out.getvalue(), media_type="text/csv")

    @router.get("/billing/focus.csv")
    async def focus_csv(since: str | None = None, until: str | None = None) -> Response:
        """Charges per key, team, model, tier, weight version and day in the FinOps FOCUS shape."""
        ledger = await acc.flushed_ledger()
        out = io.StringIO()
        await ledger.export_focus_csv(out, since=parse_time(since, "since"), until=parse_time(until, "until"))
        return Response(out.getvalue(), media_type="text/csv")

    @router.get("/yield")
    async def fleet_yield() -> Response:
        return json_response(acc.fleet_cost.report())

    @router.get("/cache-advisor")
    async def cache_advisor(key_id: str | None = None) -> Response:
        reports = [acc.advisor.report(key_id)] if key_id else acc.advisor.reports()
        return json_response({"data": reports})

    @router.get("/success")
    async def success(group_by: str = "model,tier,weight_version", since: str | None = None,
                      until: str | None = None) -> Response:
        groups = parse_group_by(group_by, "model,tier,weight_version")
        ledger = await acc.flushed_ledger()
        rows = await ledger.success(groups, since=parse_time(since, "since"), until=parse_time(until, "until"))
        return json_response({"group_by": groups, "rows": rows})


def build_feedback_router(accounting: "Accounting", authenticated: Any) -> APIRouter:
    """POST /v1/feedback: attach an outcome (passed / score) to a request or a whole session."""
    router = APIRouter()

    @router.post("/v1/feedback", dependencies=[Depends(authenticated)])
    async def feedback(request: Request) -> Response:
        fb: Feedback = await decode_body(request, Feedback)
        if (fb.request_id is None) == (fb.session_id is None):
            raise InvalidRequest("Give exactly one of request_id or session_id.", param="request_id")
        if fb.passed is None and fb.score is None:
            raise InvalidRequest("Give passed, score or both.", param="passed")
        if fb.score is not None and not math.isfinite(fb.score):
            raise InvalidRequest("score must be finite.", param="score")
        outcome = await accounting.require_ledger().attach_outcome(
            request_id=fb.request_id, session_id=fb.session_id, passed=fb.passed, score=fb.score,
            note=fb.note)
        return json_response({"object": "feedback", "outcome": outcome})

    return router

