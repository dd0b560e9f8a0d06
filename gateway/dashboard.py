"""The economics dashboard: GET /dashboard (one self-contained HTML page, hand-drawn canvas
charts, no CDN) polling GET /dashboard/data (JSON).

Credentials: with server.require_keys the dashboard is admin-only. The page accepts the admin
token as a bearer header or as ?token=...; the page's script keeps the token in memory and sends
it as a bearer header to /dashboard/data. Nothing is persisted (no cookie, no localStorage) and the
page sets no-referrer, so the token never leaves in a Referer. Without require_keys (the demo) the
dashboard is open like the inference endpoints.
"""

from __future__ import annotations

import time
from collections import deque
from decimal import Decimal
from importlib import resources
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from .accounting import Accounting
from .errors import AuthenticationError
from .http import json_response
from .ticker import Ticker
from .tiers import FAST, STANDARD

SAMPLE_INTERVAL_S = 5.0
HISTORY_POINTS = 720          # one hour at 5 s
LEDGER_CACHE_S = 5.0          # ledger scans (spend, success) are reused this long
MILLION = Decimal(1_000_000)


class Dashboard:
    """Samples the accounting totals into a bounded time series and serves the page's data."""

    def __init__(self, accounting: Accounting):
        self.accounting = accounting
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_POINTS)
        self._last: dict[str, tuple[int, int]] = {}     # tier -> (prompt, cached) at last sample
        self._ledger_cache: tuple[float, dict[str, Any]] | None = None
        self.ticker = Ticker("yieldgate-dashboard-sampler", SAMPLE_INTERVAL_S, self._sample)

    async def start(self) -> None:
        self.sample()
        self.ticker.start()

    async def close(self) -> None:
        await self.ticker.close()

    async def _sample(self) -> None:
        self.sample()

    def sample(self) -> None:
        """One point per tier: list revenue and actual replica cost per 1M tokens (since start),
        and the cache hit rate of the prompts seen since the previous point."""
        acc = self.accounting
        by_tier: dict[str, list] = {}
        for (tier, _model), t in acc.totals.items():
            agg = by_tier.setdefault(tier, [0, 0, 0, Decimal(0)])
            agg[0] += t.prompt_tokens
            agg[1] += t.cached_tokens
            agg[2] += t.prompt_tokens + t.completion_tokens
            agg[3] += t.revenue
        actual: dict[str, list] = {}
        for ty in acc.fleet_cost.report().tiers:
            a = actual.setdefault(ty.tier, [0, Decimal(0)])
            a[0] += ty.tokens
            a[1] += ty.allocated_cost_usd
        point: dict[str, Any] = {"t": time.time(), "tiers": {}}
        for tier, (prompt, cached, tokens, revenue) in by_tier.items():
            p0, c0 = self._last.get(tier, (0, 0))
            self._last[tier] = (prompt, cached)
            a_tokens, a_cost = actual.get(tier, (0, Decimal(0)))
            point["tiers"][tier] = {
                "list_per_mtok": float(revenue * MILLION / tokens) if tokens else None,
                "actual_per_mtok": float(a_cost * MILLION / a_tokens) if a_tokens else None,
                "hit_rate": (cached - c0) / (prompt - p0) if prompt > p0 else None,
            }
        self.history.append(point)

    async def _ledger_views(self) -> dict[str, Any]:
        now = time.monotonic()
        if self._ledger_cache and now - self._ledger_cache[0] < LEDGER_CACHE_S:
            return self._ledger_cache[1]
        if self.accounting.ledger is None:  # switched off: the panels stay empty
            return {"spend": [], "success": [], "routes": [], "targets": []}
        ledger = await self.accounting.flushed_ledger()
        spend = await ledger.usage(("key_id", "team"))
        success = await ledger.success(("weight_version",))
        routes = await ledger.usage(("route",))
        targets = await ledger.success(("task", "target"))
        views = {
            "spend": [{"key_id": r.group["key_id"] or "anonymous", "team": r.group["team"] or "",
                       "requests": r.requests, "cost_usd": float(r.cost_total),
                       "tokens": r.prompt_tokens + r.completion_tokens} for r in spend],
            "success": [{"weight_version": r.group["weight_version"] or "?", "requests": r.requests,
                         "tasks_graded": r.tasks_graded, "successes": r.successes,
                         "success_rate": r.success_rate,
                         "usd_per_success": None if r.usd_per_success is None else float(r.usd_per_success),
                         "tokens_per_success": r.tokens_per_success} for r in success],
            # Per API (chat, completions, responses, messages): agent clients' share and cache reuse.
            "routes": [{"route": r.group["route"] or "?", "requests": r.requests, "cost_usd": float(r.cost_total),
                        "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                        "cached_ratio": r.cached_tokens / r.prompt_tokens if r.prompt_tokens else None}
                       for r in routes],
            # What `auto` chooses on (docs/models.md#auto): $ per solved task per task class and target.
            "targets": [{"task": r.group["task"] or "", "target": r.group["target"] or "?", "requests": r.requests,
                         "tasks_graded": r.tasks_graded, "successes": r.successes,
                         "usd_per_success": None if r.usd_per_success is None else float(r.usd_per_success)}
                        for r in targets if r.tasks_graded],
        }
        self._ledger_cache = (now, views)
        return views

    async def data(self) -> dict[str, Any]:
        if not self.history or time.time() - self.history[-1]["t"] > 1.0:
            self.sample()
        acc = self.accounting
        mix: dict[str, dict[str, Any]] = {}
        for (tier, _model), t in acc.totals.items():
            m = mix.setdefault(tier, {"requests": 0, "tokens": 0, "revenue_usd": 0.0})
            m["requests"] += t.requests
            m["tokens"] += t.prompt_tokens + t.completion_tokens
            m["revenue_usd"] += float(t.revenue)
        models: dict[str, dict[str, Any]] = {}
        for (_tier, model), t in acc.totals.items():
            m = models.setdefault(model, {"requests": 0, "tokens": 0, "revenue_usd": 0.0, "prompt_tokens": 0,
                                          "cached_tokens": 0})
            m["requests"] += t.requests
            m["tokens"] += t.prompt_tokens + t.completion_tokens
            m["revenue_usd"] += float(t.revenue)
            m["prompt_tokens"] += t.prompt_tokens
            m["cached_tokens"] += t.cached_tokens
        breakers = [{"key_id": r.key_id, "breaks": r.breaks, "requests": r.requests,
                     "lost_tokens": r.lost_tokens, "median_break_position": r.median_break_position,
                     "advice": r.advice} for r in acc.advisor.reports()[:10]]
        return {"now": time.time(), "series": list(self.history), "tier_mix": mix, "model_mix": models,
                "cache_breakers": breakers, "fast_speedup": self.fast_speedup(),
                **(await self._ledger_views())}

    def fast_speedup(self) -> list[dict[str, Any]]:
        """Per workload class: the fast tier's output tokens per request-second over the standard
        tier's, next to what fast requests were billed over the standard price of the same tokens
        (1.0 when the gateway served them on a plain replica)."""
        speeds = self.accounting.speeds
        rows = []
        for (tier, cls), s in sorted(speeds.items()):
            if tier != FAST:
                continue
            std = speeds.get((STANDARD, cls))
            fast_tps = s.completion_tokens / s.seconds
            std_tps = std.completion_tokens / std.seconds if std is not None else None
            rows.append({"class": cls, "requests": s.requests, "standard_requests": std.requests if std else 0,
                         "fast_tps": fast_tps, "standard_tps": std_tps,
                         "speedup": fast_tps / std_tps if std_tps else None,
                         "price_multiple": float(s.billed / s.at_standard) if s.at_standard else None,
                         "served_fast": s.served_as_asked / s.requests})
        return rows


def build_dashboard_router(dashboard: Dashboard, require_keys: bool, admin: Callable[[Request], None]) -> APIRouter:
    page = resources.files("yieldgate.gateway").joinpath("static/dashboard.html").read_bytes()

    def credential(request: Request) -> None:
        if not require_keys:
            return
        token = request.query_params.get("token")
        if token is not None:
            if not dashboard.accounting.is_admin_token(token):
                raise AuthenticationError("Admin credential required.", code="invalid_admin_token")
            return
        admin(request)

    router = APIRouter(dependencies=[Depends(credential)])

    @router.get("/dashboard")
    async def dashboard_page() -> Response:
        return Response(page, media_type="text/html; charset=utf-8",
                        headers={"cache-control": "no-store", "referrer-policy": "no-referrer"})

    @router.get("/dashboard/data")
    async def dashboard_data() -> Response:
        return json_response(await dashboard.data())

    return router
