"""Pure statistics for load-test results: percentiles, distributions, goodput, throughput windows.

No I/O and no third-party imports, so it is cheap to unit-test and to reuse from benchmarks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import msgspec

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


class Distribution(msgspec.Struct, frozen=True):
    """Summary of one metric over the measured requests (units are the caller's, e.g. ms)."""

    count: int
    mean: float
    min: float
    max: float
    stdev: float
    percentiles: dict[str, float]  # "p50" -> value

    def p(self, q: float) -> float:
        return self.percentiles[_label(q)]


def _label(q: float) -> str:
    return f"p{q:g}"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default "linear" method); q in [0, 100].

    Returns NaN for an empty sequence so an absent metric never masquerades as zero.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return float(ordered[low])
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Iterable[float], qs: Sequence[float] = DEFAULT_PERCENTILES) -> Distribution:
    data = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not data:
        nan = math.nan
        return Distribution(0, nan, nan, nan, nan, {_label(q): nan for q in qs})
    n = len(data)
    mean = math.fsum(data) / n
    var = math.fsum((v - mean) ** 2 for v in data) / n
    ordered = sorted(data)
    return Distribution(
        count=n,
        mean=mean,
        min=ordered[0],
        max=ordered[-1],
        stdev=math.sqrt(var),
        percentiles={_label(q): percentile(ordered, q) for q in qs},
    )


def meets_slo(metrics: Mapping[str, float | None], slo: Mapping[str, float]) -> bool:
    """True when every SLO bound holds for one request.

    A metric the request does not have (e.g. TPOT of a 1-token answer) does not fail the SLO,
    matching `vllm bench serve --goodput`; a failed request never meets it (callers filter).
    """
    for key, bound in slo.items():
        value = metrics.get(key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if value > bound:
            return False
    return True


def goodput(per_request: Sequence[Mapping[str, float | None]], slo: Mapping[str, float], duration_s: float) -> float:
    """Requests per second that met every SLO bound (successful requests only are passed in)."""
    if duration_s <= 0:
        return 0.0
    good = sum(1 for m in per_request if meets_slo(m, slo))
    return good / duration_s


def throughput(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0


def throughput_windows(
    events: Sequence[tuple[float, float]], window_s: float, start: float | None = None, end: float | None = None
) -> list[tuple[float, float]]:
    """Bucket (timestamp_s, amount) events into fixed windows; returns (window_start, amount/s) pairs.

    Used for "tokens/s over time" plots and to find the steady-state part of a run. Every window
    between start and end is present, empty ones as 0.
    """
    if window_s <= 0:
        raise ValueError("window_s must be positive")
    if not events and (start is None or end is None):
        return []
    t0 = start if start is not None else min(t for t, _ in events)
    t1 = end if end is not None else max(t for t, _ in events)
    n = max(1, math.ceil((t1 - t0) / window_s)) if t1 > t0 else 1
    sums = [0.0] * n
    for t, amount in events:
        if t < t0 or t > t1:
            continue
        i = min(int((t - t0) // window_s), n - 1)
        sums[i] += amount
    return [(t0 + i * window_s, s / window_s) for i, s in enumerate(sums)]


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan
