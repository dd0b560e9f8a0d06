"""Ledger reports computed over a store scan, identical for every backend: spend and tokens by
any dimension, success rate / $ per success (intelligence per dollar), CSV export, and a billing
export in the FinOps FOCUS shape."""

from __future__ import annotations

import csv
import time
from collections.abc import Callable
from decimal import Decimal
from typing import TextIO

import msgspec

from .record import RECORD_FIELDS, LedgerRecord, UsageRow
from .stores.base import AggregatingStore, LedgerStore

ZERO = Decimal(0)


def _day(r: LedgerRecord) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(r.ts))


DIMENSIONS: dict[str, Callable[[LedgerRecord], str | None]] = {
    "key_id": lambda r: r.key_id, "key": lambda r: r.key_id, "team": lambda r: r.team,
    "model": lambda r: r.model, "tier": lambda r: r.tier,
    "requested_tier": lambda r: r.requested_tier or r.tier, "replica": lambda r: r.replica,
    "gateway": lambda r: r.gateway,
    "weight_version": lambda r: r.weight_version, "adapter": lambda r: r.adapter, "session_id": lambda r: r.session_id,
    "status": lambda r: r.status, "route": lambda r: r.route, "batch_id": lambda r: r.batch_id, "day": _day,
    "target": lambda r: r.target, "requested_model": lambda r: r.requested_model, "task": lambda r: r.task,
}


def _key_fn(group_by: tuple[str, ...]) -> Callable[[LedgerRecord], tuple]:
    unknown = [g for g in group_by if g not in DIMENSIONS]
    if unknown:
        raise ValueError(f"cannot group by {unknown}; choose from {sorted(DIMENSIONS)}")
    getters = [DIMENSIONS[g] for g in group_by]
    return lambda r: tuple(g(r) for g in getters)


async def usage_report(store: LedgerStore, group_by: tuple[str, ...], *, since: float | None = None,
                       until: float | None = None, where: dict[str, str] | None = None) -> list[UsageRow]:
    key = _key_fn(group_by)
    unknown = [k for k in (where or {}) if k not in DIMENSIONS]
    if unknown:
        raise ValueError(f"cannot filter by {unknown}; choose from {sorted(DIMENSIONS)}")
    if isinstance(store, AggregatingStore):
        found = await store.aggregate_usage(group_by, since, until, dict(where or {}))
        return sorted(found, key=lambda r: tuple("" if r.group[g] is None else r.group[g] for g in group_by))
    filters = [(DIMENSIONS[k], v) for k, v in (where or {}).items()]
    rows: dict[tuple, UsageRow] = {}
    async for batch in store.scan(since, until):
        for r in batch:
            if any(get(r) != v for get, v in filters):
                continue
            k = key(r)
            row = rows.get(k)
            if row is None:
                row = rows[k] = UsageRow(group=dict(zip(group_by, k)))
            row.requests += 1
            row.errors += r.status != "ok"
            row.prompt_tokens += r.prompt_tokens
            row.cached_tokens += r.cached_tokens
            row.completion_tokens += r.completion_tokens
            row.cost_uncached_input += r.cost_uncached_input
            row.cost_cached_input += r.cost_cached_input
            row.cost_output += r.cost_output
            row.cost_total += r.cost_total
    return [rows[k] for k in sorted(rows, key=lambda t: tuple("" if x is None else x for x in t))]


class SuccessRow(msgspec.Struct):
    group: dict[str, str | None]
    requests: int = 0
    spend_usd: Decimal = ZERO          # everything, graded or not
    tasks_graded: int = 0              # distinct sessions / requests with an outcome
    successes: int = 0
    success_rate: float | None = None
    graded_spend_usd: Decimal = ZERO
    graded_tokens: int = 0
    usd_per_success: Decimal | None = None    # spend on graded tasks / successes
    tokens_per_success: float | None = None
    mean_score: float | None = None


async def success_report(store: LedgerStore, group_by: tuple[str, ...], *,
                         since: float | None = None, until: float | None = None) -> list[SuccessRow]:
    """A task is a session when the request has a session_id, else the request itself. A session's
    outcome covers all its requests; otherwise a request-level outcome applies."""
    key = _key_fn(group_by)
    rows: dict[tuple, SuccessRow] = {}
    # (group, task kind, task id) -> [spend, tokens]
    tasks: dict[tuple[tuple, str, str], list] = {}
    session_of: dict[str, str | None] = {}
    async for batch in store.scan(since, until):
        for r in batch:
            k = key(r)
            row = rows.get(k)
            if row is None:
                row = rows[k] = SuccessRow(group=dict(zip(group_by, k)))
            row.requests += 1
            row.spend_usd += r.cost_total
            for kind, tid in (("session", r.session_id), ("request", r.request_id)):
                if tid:
                    t = tasks.setdefault((k, kind, tid), [ZERO, 0])
                    t[0] += r.cost_total
                    t[1] += r.total_tokens
            session_of[r.request_id] = r.session_id
    sessions = {s for s in session_of.values() if s}
    by_session = await store.get_outcomes("session", sessions) if sessions else {}
    by_request = await store.get_outcomes("request", session_of) if session_of else {}
    scores: dict[tuple, list[float]] = {}
    # Sessions with an outcome first; their requests are then not graded again individually.
    for (k, kind, tid), (spend, tokens) in tasks.items():
        if kind == "session" and tid in by_session:
            _grade(rows[k], by_session[tid], spend, tokens, scores.setdefault(k, []))
    for (k, kind, tid), (spend, tokens) in tasks.items():
        if kind == "request" and tid in by_request and session_of.get(tid) not in by_session:
            _grade(rows[k], by_request[tid], spend, tokens, scores.setdefault(k, []))
    for k, row in rows.items():
        if row.tasks_graded:
            row.success_rate = row.successes / row.tasks_graded
        if row.successes:
            row.usd_per_success = row.graded_spend_usd / row.successes
            row.tokens_per_success = row.graded_tokens / row.successes
        if scores.get(k):
            row.mean_score = sum(scores[k]) / len(scores[k])
    return [rows[k] for k in sorted(rows, key=lambda t: tuple("" if x is None else x for x in t))]


def _grade(row: SuccessRow, outcome, spend: Decimal, tokens: int, scores: list[float]) -> None:
    row.tasks_graded += 1
    row.successes += outcome.passed
    row.graded_spend_usd += spend
    row.graded_tokens += tokens
    if outcome.score is not None:
        scores.append(outcome.score)


async def export_csv(store: LedgerStore, out: TextIO, *, since: float | None = None,
                     until: float | None = None) -> int:
    """Write every record in [since, until) as CSV (header = LedgerRecord fields); Decimals exact."""
    writer = csv.writer(out)
    writer.writerow(RECORD_FIELDS)
    n = 0
    async for batch in store.scan(since, until):
        for r in batch:
            writer.writerow(["" if (v := getattr(r, f)) is None else v for f in RECORD_FIELDS])
            n += 1
    return n


# FinOps FOCUS (Open Cost and Usage Specification) columns, the ones a usage-billed service fills,
# then x_-prefixed columns of its own (FOCUS's rule for provider extensions).
FOCUS_COLUMNS = (
    "BilledCost", "EffectiveCost", "ListCost", "ContractedCost", "BillingCurrency",
    "BillingPeriodStart", "BillingPeriodEnd", "ChargePeriodStart", "ChargePeriodEnd",
    "ChargeCategory", "ChargeFrequency", "ChargeDescription", "ConsumedQuantity", "ConsumedUnit",
    "PricingQuantity", "PricingUnit", "ProviderName", "PublisherName", "InvoiceIssuerName",
    "ServiceName", "ServiceCategory", "ResourceId", "ResourceName", "ResourceType", "SkuId",
    "SubAccountId", "SubAccountName", "Tags",
    "x_KeyId", "x_Team", "x_Model", "x_Tier", "x_WeightVersion", "x_Requests",
)
FOCUS_GROUP = ("day", "key_id", "team", "model", "tier", "weight_version")
# One charge row per token kind: each is its own SKU with its own unit price.
_COMPONENTS = (("input", "uncached input tokens", "cost_uncached_input"),
               ("cached_input", "cached input tokens", "cost_cached_input"),
               ("output", "output tokens", "cost_output"))


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


async def export_focus_csv(store: LedgerStore, out: TextIO, *, since: float | None = None,
                           until: float | None = None, provider: str = "yieldgate") -> int:
    """Charges per key, team, model, tier, weight version and UTC day as FOCUS rows (one per token
    kind), written to `out`; returns the number of rows. BilledCost sums to the ledger, exactly."""
    import calendar
    import json

    writer = csv.writer(out)
    writer.writerow(FOCUS_COLUMNS)
    n = 0
    for row in await usage_report(store, FOCUS_GROUP, since=since, until=until):
        g = row.group
        day = calendar.timegm(time.strptime(g["day"] or "1970-01-01", "%Y-%m-%d"))
        t = time.gmtime(day)
        month = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))
        next_month = calendar.timegm((t.tm_year + t.tm_mon // 12, t.tm_mon % 12 + 1, 1, 0, 0, 0))
        resource = f"{g['model']}:{g['tier']}@{g['weight_version']}" if g["weight_version"] else f"{g['model']}:{g['tier']}"
        tags = json.dumps({"key_id": g["key_id"], "team": g["team"], "tier": g["tier"],
                           "weight_version": g["weight_version"]}, separators=(",", ":"))
        quantities = {"input": row.prompt_tokens - row.cached_tokens, "cached_input": row.cached_tokens,
                      "output": row.completion_tokens}
        for sku, what, cost_field in _COMPONENTS:
            cost = getattr(row, cost_field)
            if not quantities[sku] and not cost:
                continue
            amount = format(cost.normalize(), "f")
            writer.writerow([
                amount, amount, amount, amount, "USD",
                _iso(month), _iso(next_month), _iso(day), _iso(day + 86400),
                "Usage", "Usage-Based", f"{g['model']} {g['tier']} tier, {what}",
                quantities[sku], "Tokens", quantities[sku], "Tokens", provider, provider, provider,
                g["model"], "AI and Machine Learning", resource, resource, "Model",
                f"{g['model']}:{g['tier']}:{sku}", g["team"], g["team"], tags,
                g["key_id"], g["team"], g["model"], g["tier"], g["weight_version"], row.requests])
            n += 1
    return n
