"""One request as it travels through the gateway: what routing, the proxy and accounting read
and write about it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from yieldgate.pricing import ApiKey, Reservation
from yieldgate.serving import AdapterRoute, Replica


@dataclass(slots=True)
class RequestContext:
    request_id: str
    kind: str
    model: str
    tier: str                               # the tier that serves (and prices) the request
    started: float
    requested_tier: str = ""                # the tier asked for, when another one serves it
    # The tier whose price is billed when it is not the serving tier's: a fast request of a class
    # whose measured speed-up is below the floor (pricing.fast_min_speedup) pays the standard price.
    priced_tier: str = ""
    router_tier: str = ""                   # the tier whose router picked the current try
    stream: bool = False
    session_id: str = ""
    key: ApiKey | None = None
    max_tokens: int | None = None
    typed: Any = None                       # the validated request (prompt size estimates)
    prompt_tokens: list[int] | None = None  # set by routing when it tokenized the prompt
    prompt_packed: bytes | None = None      # the same ids as little-endian int32s (cache.blocks.pack_tokens)
    route: Any = None  # cache.RouteRequest, prepared once per request by gateway.routing
    decision: Any = None  # cache.RouteDecision of the current try (released by gateway.routing)
    replica: Replica | None = None
    pinned: Replica | None = None           # the only replica that can serve it (a stored response's)
    predicted_cached_tokens: int = 0
    ttft: float | None = None
    relayed_tokens: int = 0                 # output tokens a stream cut short relayed (gateway/relay.py)
    finished: bool = False
    status: str = ""
    cost_header: str = ""
    reservation: Reservation | None = None
    rate_tokens: int = 0                    # tokens already counted against the key's TPM
    extra: dict[str, Any] = field(default_factory=dict)
    adapter: AdapterRoute | None = None     # the LoRA adapter version the request was bound to
    adapter_held: bool = False              # counted in flight on that version (gateway/exchange.py)
    adapter_sent_to: str = ""               # ... and on the replica it was sent to (Adapters.touch)
    # The lane (gateway/lanes.py): "" interactive, "flex" or "batch"; its engine priority
    # (vLLM's per-request `priority`, lower first; 0 = interactive, never sent).
    lane: str = ""
    priority: int = 0
    batch_id: str = ""                      # a batch line's job (recorded in its ledger record)
    # The name the client sent when it was an alias or `auto` (or a model that fell back to this
    # one); `auto`'s task class and why it chose this target (gateway/registry.py).
    requested_model: str = ""
    task: str = ""
    auto_reason: str = ""
    # Where the ledger record goes instead of the ledger: a batch line's record is stored with its
    # output line in one transaction, then recorded (gateway/batch_worker.py).
    record_sink: Any = None

    @property
    def replica_name(self) -> str:
        return self.replica.name if self.replica else ""

    @property
    def weight_version(self) -> str:
        """What produced the answer: `adapter@version` for an adapter, else the replica's weights."""
        if self.adapter is not None:
            return self.adapter.label
        return self.replica.weight_version if self.replica else ""

    def bind(self, replica: Replica, predicted_cached_tokens: int) -> None:
        self.replica = replica
        self.predicted_cached_tokens = predicted_cached_tokens

    def first_byte(self) -> None:
        self.ttft = time.perf_counter() - self.started

    def serve_from(self, tier: str) -> None:
        """Failover: `tier` serves this request, prices it and labels the response."""
        if tier != self.tier:
            self.requested_tier = self.requested_tier or self.tier
            self.tier = tier
