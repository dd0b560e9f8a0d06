"""The dashboard's per-route view, from a real SQLite ledger (the browser test needs Chromium)."""

from __future__ import annotations

import asyncio
import types
from decimal import Decimal

from yieldgate.gateway.dashboard import Dashboard
from yieldgate.pricing.record import LedgerRecord, record_docs
from yieldgate.pricing.report import usage_report
from yieldgate.pricing.stores import SQLiteStore


def test_dashboard_splits_requests_cost_and_cached_share_by_route(tmp_path):
    async def views() -> dict:
        store = SQLiteStore(tmp_path / "ledger.db")
        await store.open()
        await store.upsert(record_docs([LedgerRecord(request_id=f"r{i}", ts=1.0 + i, route=route, prompt_tokens=100,
                                         cached_tokens=cached, cost_total=Decimal("0.001"))
                            for i, (route, cached) in enumerate([("chat", 0), ("responses", 64),
                                                                 ("messages", 32), ("messages", 96)])]))

        class Ledger:
            async def usage(self, group_by):
                return await usage_report(store, tuple(group_by))

            async def success(self, group_by):
                return []

        async def flushed_ledger():
            return Ledger()

        dashboard = Dashboard.__new__(Dashboard)  # only the ledger views: no sampling task
        dashboard.accounting = types.SimpleNamespace(ledger=object(), flushed_ledger=flushed_ledger)
        dashboard._ledger_cache = None
        try:
            return await dashboard._ledger_views()
        finally:
            await store.close()

    routes = {r["route"]: r for r in asyncio.run(views())["routes"]}
    assert {k: r["requests"] for k, r in routes.items()} == {"chat": 1, "responses": 1, "messages": 2}
    assert routes["messages"]["cached_ratio"] == 0.64 and routes["chat"]["cached_ratio"] == 0.0
    assert routes["messages"]["cost_usd"] == 0.002
