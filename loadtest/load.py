"""How load is applied: closed loop, open-loop Poisson/gamma, trace replay, rate sweep; run bounds."""

from __future__ import annotations

import msgspec


class Bounds(msgspec.Struct, kw_only=True):
    """When a run (or one sweep step) stops. Whichever of requests/duration comes first wins."""

    requests: int | None = 100  # measured requests, warm-up not included
    duration_s: float | None = None
    warmup_requests: int = 0  # sent first under the same load, finished before measuring starts
    timeout_s: float = 120.0  # per request, end to end
    drain_timeout_s: float = 60.0  # how long to wait for in-flight requests after the last send

    def __post_init__(self) -> None:
        if self.requests is None and self.duration_s is None:
            raise ValueError("Bounds needs requests or duration_s")


class ConcurrencyLoad(msgspec.Struct, tag="concurrency", tag_field="kind", kw_only=True):
    """Closed loop: `concurrency` workers each send their next request as soon as one finishes.

    With multi-turn workloads a worker runs a whole session (think times included), so this is
    the number of concurrent users.
    """

    concurrency: int = 8


class PoissonLoad(msgspec.Struct, tag="poisson", tag_field="kind", kw_only=True):
    """Open loop at `rate` req/s (sessions/s for multi-turn workloads).

    Inter-arrival gaps are gamma(shape=burstiness, mean=1/rate), as `vllm bench serve --burstiness`:
    1.0 is Poisson, <1 burstier, >1 more regular. rate=inf sends everything at once.
    """

    rate: float = 10.0
    burstiness: float = 1.0
    max_concurrency: int | None = None


class ReplayLoad(msgspec.Struct, tag="replay", tag_field="kind", kw_only=True):
    """Send each session at its trace timestamp, divided by `speedup`."""

    speedup: float = 1.0
    max_concurrency: int | None = None


class SweepLoad(msgspec.Struct, tag="sweep", tag_field="kind", kw_only=True):
    """Step the open-loop rate up until the target saturates.

    Rates come from `rates`, else start_rate * factor**k up to max_rate. A sweep stops early when
    a step's error rate exceeds max_error_rate, when achieved throughput falls below
    min_achieved_ratio of the offered rate, or when p50 TTFT grows past max_ttft_growth times the
    first step's (queueing blow-up).
    """

    rates: list[float] | None = None
    start_rate: float = 1.0
    factor: float = 2.0
    max_rate: float = 256.0
    burstiness: float = 1.0
    max_concurrency: int | None = None
    max_error_rate: float = 0.05
    min_achieved_ratio: float = 0.8
    max_ttft_growth: float = 10.0

    def schedule(self) -> list[float]:
        if self.rates:
            return list(self.rates)
        if self.start_rate <= 0 or self.factor <= 1:
            raise ValueError("sweep needs start_rate > 0 and factor > 1")
        out, r = [], self.start_rate
        while r <= self.max_rate * (1 + 1e-9):
            out.append(r)
            r *= self.factor
        return out


Load = ConcurrencyLoad | PoissonLoad | ReplayLoad | SweepLoad
