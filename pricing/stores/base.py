"""The LedgerStore protocol every backend implements."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from decimal import Decimal
from typing import Protocol, runtime_checkable

from ..record import LedgerRecord, Outcome, OutcomeTarget, UsageRow


@runtime_checkable
class LedgerStore(Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def mark(self) -> str:
        """The store's identity, made once and kept with its data. A ledger remembers the mark its
        journal was checkpointed against: a different one (the store was emptied or replaced)
        makes it replay its whole journal. Raise StoreUnavailable when unreachable."""
        ...

    async def upsert(self, docs: Sequence[bytes]) -> int:
        """Store records, each given as its JSON document (a journal line, or `record_docs()`),
        idempotently by request_id (first write wins); return how many were new. The document is
        kept as given: the ledger's flusher hands its journal lines over without re-encoding them.
        Raise StoreUnavailable when the backend cannot be reached, StoreReset when the store's
        mark is no longer the one it had at open() (its data is gone)."""
        ...

    async def get(self, request_id: str) -> LedgerRecord | None: ...

    async def count(self) -> int: ...

    def scan(self, since: float | None = None, until: float | None = None,
             batch: int = 1000) -> AsyncIterator[list[LedgerRecord]]:
        """Records with since <= ts < until, in batches."""
        ...

    async def key_spend(self, key_id: str, since: float | None = None,
                        until: float | None = None) -> Decimal:
        """Sum of cost_total of one key's records with since <= ts < until (budget counters are
        rebuilt from it)."""
        ...

    async def put_outcome(self, outcome: Outcome) -> None:
        """Attach (or replace) the outcome of a request or session."""
        ...

    async def get_outcomes(self, target: OutcomeTarget, ids: Iterable[str]) -> dict[str, Outcome]: ...


@runtime_checkable
class AggregatingStore(Protocol):
    """A store that sums usage where the rows are (a database), instead of the report scanning
    every record through the gateway."""

    async def aggregate_usage(self, group_by: tuple[str, ...], since: float | None, until: float | None,
                              where: dict[str, str]) -> list[UsageRow]:
        """The rows usage_report() would compute by a scan, in any order."""
        ...
