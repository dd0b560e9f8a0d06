"""Per-request accounting: one context per request, finished exactly once (metrics, cost, ledger)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from serving.fleet import Replica

from .metrics import GatewayMetrics


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def from_wire(cls, usage: Any) -> "Usage":
        if not isinstance(usage, dict):
            return cls()
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else 0
        return cls(int(usage.get("prompt_tokens") or 0), int(cached or 0),
                   int(usage.get("completion_tokens") or 0))


@dataclass(slots=True)
class RequestContext:
    request_id: str
    kind: str
    model: str
    tier: str
    started: float
    stream: bool = False
    session_id: str = ""
    key: Any = None
    max_tokens: int | None = None
    replica: Replica | None = None
    predicted_cached_tokens: int = 0
    ttft: float | None = None
    chunks: int = 0
    finished: bool = False
    status: str = ""
    cost_header: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def replica_name(self) -> str:
        return self.replica.name if self.replica else ""

    @property
    def weight_version(self) -> str:
        return self.replica.weight_version if self.replica else ""

    def bind(self, replica: Replica, predicted_cached_tokens: int) -> None:
        self.replica = replica
        self.predicted_cached_tokens = predicted_cached_tokens

    def first_byte(self) -> None:
        self.ttft = time.perf_counter() - self.started


class Accounting:
    """Where a finished request is counted. Pricing and the ledger plug in here."""

    def __init__(self, metrics: GatewayMetrics):
        self.metrics = metrics

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def admit(self, ctx: RequestContext) -> None:
        """Budget and rate-limit checks before the request reaches an engine."""

    def finish(self, ctx: RequestContext, usage: Usage | None, status: str) -> dict[str, Any]:
        """Record the request once; return fields to add to the response's `usage`."""
        if ctx.finished:
            return {}
        ctx.finished = True
        ctx.status = status
        m = self.metrics
        endpoint = ctx.kind
        m.requests.labels(endpoint, ctx.tier, status).inc()
        m.latency.labels(ctx.tier).observe(time.perf_counter() - ctx.started)
        if ctx.ttft is not None:
            m.ttft.labels(ctx.tier).observe(ctx.ttft)
        if usage is None:
            return {}
        labels = (ctx.tier, ctx.model)
        m.tokens.labels("prompt", *labels).inc(usage.prompt_tokens)
        m.tokens.labels("cached", *labels).inc(usage.cached_tokens)
        m.tokens.labels("uncached", *labels).inc(usage.prompt_tokens - usage.cached_tokens)
        m.tokens.labels("completion", *labels).inc(usage.completion_tokens)
        m.predicted_cached.labels(ctx.tier).inc(ctx.predicted_cached_tokens)
        m.prediction_error.labels(ctx.tier).observe(abs(ctx.predicted_cached_tokens - usage.cached_tokens))
        return {}
