"""LedgerRecord (one billed request), Outcome (feedback attached to a request or session) and
UsageRow (records summed by a report's dimensions)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from decimal import Decimal
from typing import Literal

import msgspec

from .cost import Cost, Usage

ZERO = Decimal(0)
Status = str  # "ok", "error", "aborted", ... kept open so the gateway can add statuses


class LedgerRecord(msgspec.Struct, kw_only=True):
    request_id: str
    ts: float                         # unix seconds, wall clock of request completion
    key_id: str = ""
    team: str = ""
    model: str = ""
    tier: str = "standard"            # the tier that served (and priced) the request
    requested_tier: str = ""          # set when another tier served it (failover); "" = tier
    replica: str = ""
    weight_version: str = ""          # what produced the answer; `adapter@version` for a LoRA adapter
    adapter: str = ""                 # the LoRA adapter asked for ("" = the base model)
    gateway: str = ""                 # the gateway instance that served it (server.instance_id)
    session_id: str | None = None
    route: str = ""                   # the API: chat, completions, responses, messages ("" = not recorded)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_uncached_input: Decimal = ZERO
    cost_cached_input: Decimal = ZERO
    cost_output: Decimal = ZERO
    cost_total: Decimal = ZERO
    ttft_ms: float | None = None
    latency_ms: float | None = None
    status: Status = "ok"
    batch_id: str = ""                # the batch job a line of which this request was ("" = none)
    # What served it as a client names it: the model (":fast" for its fast tier) or the adapter;
    # the alias or `auto` the client sent instead, and auto's task class (docs/models.md).
    target: str = ""
    requested_model: str = ""
    task: str = ""

    @classmethod
    def priced(cls, *, request_id: str, usage: Usage, cost: Cost, ts: float | None = None,
               **fields: object) -> LedgerRecord:
        """Build a record from the Usage and Cost the price book produced."""
        return cls(request_id=request_id, ts=time.time() if ts is None else ts,
                   prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                   completion_tokens=usage.completion_tokens,
                   cost_uncached_input=cost.uncached_input, cost_cached_input=cost.cached_input,
                   cost_output=cost.output, cost_total=cost.total, **fields)  # type: ignore[arg-type]

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class RecordKeys(msgspec.Struct, kw_only=True):
    """The fields a store indexes a record by, read from the record's JSON (the journal line)
    without decoding the rest: stores keep that JSON as it is."""

    request_id: str
    ts: float
    key_id: str = ""
    team: str = ""
    model: str = ""
    tier: str = "standard"
    replica: str = ""
    weight_version: str = ""
    session_id: str | None = None


RECORD_KEYS = msgspec.json.Decoder(RecordKeys)
_RECORD_JSON = msgspec.json.Encoder()


def record_docs(records: Sequence[LedgerRecord]) -> list[bytes]:
    """Records as the JSON documents stores keep (what the ledger's journal holds)."""
    return [_RECORD_JSON.encode(r) for r in records]


OutcomeTarget = Literal["request", "session"]


class Outcome(msgspec.Struct, kw_only=True):
    """Whether the task a request (or a whole session) served succeeded."""

    target: OutcomeTarget
    target_id: str
    passed: bool
    score: float | None = None
    ts: float = 0.0
    note: str = ""


RECORD_FIELDS: tuple[str, ...] = LedgerRecord.__struct_fields__


class UsageRow(msgspec.Struct):
    group: dict[str, str | None]
    requests: int = 0
    errors: int = 0               # status != "ok"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_uncached_input: Decimal = ZERO
    cost_cached_input: Decimal = ZERO
    cost_output: Decimal = ZERO
    cost_total: Decimal = ZERO
