"""What one request measured, as written to requests.jsonl."""

from __future__ import annotations

import msgspec


class RequestRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Times are ms except *_s, which are seconds since the run (phase) started."""

    id: int
    target: str
    session: str
    turn: int = 0
    group: str = ""
    warmup: bool = False
    scheduled_s: float = 0.0  # when the load model wanted it sent
    start_s: float = 0.0
    end_s: float = 0.0
    ok: bool = False
    status: int = 0
    error: str | None = None  # "timeout", "http_429", "connection", "stream_error", ...
    error_detail: str | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = []
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    input_tokens_est: int = 0
    output_chars: int = 0
    cost: float | None = None
    cost_source: str | None = None  # "response" (usage.cost.total) or "price_table"
    request_id: str | None = None  # x-request-id (a yieldgate gateway's ledger key)
    replica: str | None = None  # x-yieldgate-replica (a yieldgate target says who served it)
    weight_version: str | None = None  # x-yieldgate-weight-version
    predicted_cached_tokens: int | None = None  # x-yieldgate-predicted-cached-tokens

    @property
    def send_lag_ms(self) -> float:
        return (self.start_s - self.scheduled_s) * 1000.0

    @property
    def output_tps(self) -> float | None:
        """Decode speed seen by this request's user (tokens/s after the first token)."""
        if self.tpot_ms and self.tpot_ms > 0:
            return 1000.0 / self.tpot_ms
        return None

    @property
    def e2e_output_tps(self) -> float | None:
        """Output tokens over the whole request time; robust when a server streams tokens in bursts."""
        if self.e2e_ms and self.completion_tokens:
            return self.completion_tokens * 1000.0 / self.e2e_ms
        return None

    def slo_metrics(self) -> dict[str, float | None]:
        itl_max = max(self.itl_ms) if self.itl_ms else None
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms, "itl_ms": itl_max}
