"""Aggregate a run's request records into the figures a team compares: latency, throughput, goodput,
cache economics, cost and the harness's own overhead."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

import msgspec

from . import stats
from .engine_metrics import EngineDelta
from .record import RequestRecord


class Summary(msgspec.Struct, kw_only=True):
    target: str
    requests: int  # measured (warm-up excluded)
    completed: int
    failed: int
    warmup: int
    duration_s: float
    request_throughput: float  # completed req/s
    input_token_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    goodput: float | None  # req/s meeting every SLO; None when no SLO was given
    goodput_fraction: float | None
    slo: dict[str, float]
    ttft_ms: stats.Distribution
    tpot_ms: stats.Distribution
    itl_ms: stats.Distribution
    e2e_ms: stats.Distribution
    output_tps_per_request: stats.Distribution  # decode tokens/s each user saw (1000 / TPOT)
    e2e_output_tps_per_request: stats.Distribution  # completion tokens / e2e time, per request
    errors: dict[str, int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_ratio: float | None  # usage.prompt_tokens_details.cached_tokens / prompt_tokens
    cost_total: float | None
    cost_source: str | None
    cost_per_request: float | None
    cost_per_1m_tokens: float | None  # USD per 1M (prompt + completion) tokens
    cost_per_1m_output_tokens: float | None
    engine: dict | None = None  # EngineDelta.to_dict()
    client_cpu_us_per_request: float | None = None  # harness overhead: process CPU / measured request
    send_lag_ms: stats.Distribution | None = None  # open loop: actual - scheduled send time
    offered_rate: float | None = None
    sent_rate: float | None = None  # open loop: realized arrival rate (Poisson gaps vary around the offered)
    concurrency: int | None = None
    # Through a yieldgate gateway (x-yieldgate-replica): who served what, and how fast.
    per_replica: dict[str, "ReplicaShare"] | None = None


class ReplicaShare(msgspec.Struct, kw_only=True):
    requests: int
    cached_ratio: float | None
    ttft_ms: stats.Distribution


def _per_replica(ok: Sequence[RequestRecord]) -> dict[str, ReplicaShare] | None:
    by: dict[str, list[RequestRecord]] = {}
    for r in ok:
        if r.replica:
            by.setdefault(r.replica, []).append(r)
    if not by:
        return None
    out = {}
    for name, rs in sorted(by.items()):
        base = sum(r.prompt_tokens for r in rs if r.cached_tokens is not None)
        cached = sum(r.cached_tokens or 0 for r in rs)
        out[name] = ReplicaShare(requests=len(rs), cached_ratio=stats.ratio(cached, base) if base else None,
                                 ttft_ms=stats.distribution(r.ttft_ms for r in rs if r.ttft_ms is not None))
    return out


def _nan_to_none(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x


def summarize(
    target: str,
    records: Sequence[RequestRecord],
    *,
    duration_s: float | None = None,
    slo: Mapping[str, float] | None = None,
    engine: EngineDelta | None = None,
    client_cpu_s: float | None = None,
    offered_rate: float | None = None,
    concurrency: int | None = None,
) -> Summary:
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    if duration_s is None:
        duration_s = (max(r.end_s for r in measured) - min(r.start_s for r in measured)) if measured else 0.0
    prompt = sum(r.prompt_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    with_cache = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in with_cache)
    cache_base = sum(r.prompt_tokens for r in with_cache)
    costs = [r.cost for r in ok if r.cost is not None]
    cost_total = math.fsum(costs) if costs else None
    sources = {r.cost_source for r in ok if r.cost_source}
    slo = dict(slo or {})
    good = stats.goodput([r.slo_metrics() for r in ok], slo, duration_s) if slo else None
    itls = [x for r in ok for x in r.itl_ms]
    lag = [r.send_lag_ms for r in measured]
    total_tokens = prompt + completion
    sent_rate = None
    if offered_rate and measured and math.isfinite(offered_rate):
        span = max(r.scheduled_s for r in measured) - min(r.scheduled_s for r in measured)
        sent_rate = len(measured) / (span + 1.0 / offered_rate)
    return Summary(
        target=target,
        requests=len(measured),
        completed=len(ok),
        failed=len(measured) - len(ok),
        warmup=len(records) - len(measured),
        duration_s=duration_s,
        request_throughput=stats.throughput(len(ok), duration_s),
        input_token_throughput=stats.throughput(prompt, duration_s),
        output_token_throughput=stats.throughput(completion, duration_s),
        total_token_throughput=stats.throughput(total_tokens, duration_s),
        goodput=good,
        goodput_fraction=(good * duration_s / len(measured)) if good is not None and measured else None,
        slo=slo,
        ttft_ms=stats.distribution(r.ttft_ms for r in ok if r.ttft_ms is not None),
        tpot_ms=stats.distribution(r.tpot_ms for r in ok if r.tpot_ms is not None),
        itl_ms=stats.distribution(itls),
        e2e_ms=stats.distribution(r.e2e_ms for r in ok if r.e2e_ms is not None),
        output_tps_per_request=stats.distribution(r.output_tps for r in ok if r.output_tps is not None),
        e2e_output_tps_per_request=stats.distribution(r.e2e_output_tps for r in ok if r.e2e_output_tps is not None),
        errors=dict(Counter(r.error or "unknown" for r in measured if not r.ok)),
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        cached_ratio=stats.ratio(cached, cache_base) if cache_base else None,
        cost_total=cost_total,
        cost_source="+".join(sorted(sources)) if sources else None,
        cost_per_request=cost_total / len(ok) if cost_total is not None and ok else None,
        cost_per_1m_tokens=cost_total / total_tokens * 1e6 if cost_total is not None and total_tokens else None,
        cost_per_1m_output_tokens=cost_total / completion * 1e6 if cost_total is not None and completion else None,
        engine=engine.to_dict() if engine else None,
        client_cpu_us_per_request=(client_cpu_s / len(measured) * 1e6) if client_cpu_s is not None and measured else None,
        send_lag_ms=stats.distribution(lag) if lag else None,
        offered_rate=offered_rate,
        sent_rate=sent_rate,
        concurrency=concurrency,
        per_replica=_per_replica(ok),
    )
