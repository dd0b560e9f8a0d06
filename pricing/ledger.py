"""Ledger: durable, exactly-once billing records with a cheap hot path.

record() encodes the record and appends it to the local journal (one os.write) before returning;
a background task ships journal batches to the store and advances the checkpoint only after the
store confirmed them. Start-up replays whatever the checkpoint does not cover. Replays are safe
because stores insert idempotently by request_id. A checkpoint is only as good as the store behind
it: the journal remembers the store's mark (LedgerStore.mark()), and a store that comes back with
another one (a Redis restarted empty, a database recreated) gets the whole journal again, on start
and whenever it answers StoreReset. Memory stays bounded: the flusher reads the
journal in batches, so a long store outage grows the journal file, not the process.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TextIO

import msgspec

from .config import LedgerConfig
from .errors import LedgerError, StoreReset, StoreUnavailable
from .journal import Journal
from .record import LedgerRecord, Outcome
from .report import SuccessRow, UsageRow, export_csv, export_focus_csv, success_report, usage_report
from .stores.base import LedgerStore

log = logging.getLogger(__name__)


class Ledger:
    def __init__(self, store: LedgerStore, journal_dir: str | Path, *, flush_interval_s: float = 0.2,
                 batch_size: int = 500, compact_bytes: int = 64 << 20,
                 retry_backoff_s: float = 1.0) -> None:
        self.store = store
        self.journal = Journal(journal_dir)
        self.flush_interval_s = flush_interval_s
        self.batch_size = batch_size
        self.compact_bytes = compact_bytes
        self.retry_backoff_s = retry_backoff_s
        self._encoder = msgspec.json.Encoder()
        self._buf = bytearray()
        self._wake: asyncio.Event | None = None
        self._progress: asyncio.Condition | None = None
        self._task: asyncio.Task[None] | None = None
        self._urgent = False
        self.stored = 0          # records newly inserted by this process
        self.duplicates = 0      # replayed records the store already had
        self.store_errors = 0
        self.store_resets = 0    # times the store had lost what the checkpoint said it held
        self.last_error: str | None = None
        self._marked = False     # the store's mark was checked against the journal's

    @classmethod
    def from_config(cls, config: LedgerConfig, postgres_url: str = "") -> Ledger:
        from .stores import PostgresStore, RedisStore, SQLiteStore
        journal_dir = Path(config.journal_dir).expanduser()
        store: LedgerStore
        if config.store == "redis":
            store = RedisStore(config.redis_url, config.redis_prefix)
        elif config.store == "postgres":
            store = PostgresStore(config.postgres_url or postgres_url, retention_days=config.retention_days)
        else:
            store = SQLiteStore(config.sqlite_path or journal_dir / "ledger.sqlite3")
        return cls(store, journal_dir, flush_interval_s=config.flush_interval_s,
                   batch_size=config.batch_size, compact_bytes=config.compact_bytes,
                   retry_backoff_s=config.retry_backoff_s)

    async def start(self) -> None:
        await self.store.open()
        self.journal.open()
        self._wake = asyncio.Event()
        self._progress = asyncio.Condition()
        self._shipping = asyncio.Lock()  # one of: a batch to the store, a check of its mark
        try:
            await self._check_mark()
        except StoreUnavailable as e:  # checked by the flusher once the store answers
            log.warning("ledger store unavailable at start, records stay journaled: %s", e)
            self._wake.set()
        if self.journal.pending_bytes:
            log.info("ledger: replaying %d journal bytes not confirmed by the store",
                     self.journal.pending_bytes)
            self._wake.set()
        self._task = asyncio.create_task(self._flush_loop(), name="yieldgate-ledger-flusher")

    def record(self, rec: LedgerRecord) -> None:
        """Durably enqueue one record (hot path: one encode, one write syscall, no await)."""
        if self._wake is None:
            raise LedgerError("Ledger.record() called before start() or after close()")
        buf = self._buf
        self._encoder.encode_into(rec, buf)
        buf.append(10)  # "\n"
        self.journal.append(bytes(buf))
        buf.clear()
        self._wake.set()

    @property
    def pending_bytes(self) -> int:
        return self.journal.pending_bytes

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until everything recorded so far is in the store; StoreUnavailable on timeout."""
        assert self._wake is not None and self._progress is not None, "flush() before start()"
        target = self.journal.size
        self._urgent = True
        self._wake.set()

        async def wait() -> None:
            async with self._progress:  # type: ignore[union-attr]
                await self._progress.wait_for(  # type: ignore[union-attr]
                    lambda: self.journal.committed >= target or self.journal.size < target)

        try:
            await asyncio.wait_for(wait(), timeout)
        except TimeoutError:
            raise StoreUnavailable(
                f"ledger: {self.journal.pending_bytes} journal bytes not stored yet "
                f"(last error: {self.last_error})") from None

    async def close(self, timeout: float = 5.0) -> None:
        """Flush what the store accepts within timeout; the rest stays journaled for next start."""
        if self._task is None:
            return
        try:
            await self.flush(timeout)
        except StoreUnavailable as e:
            log.warning("ledger closing with unflushed records kept in the journal: %s", e)
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None
        self._wake = None
        self.journal.close()
        await self.store.close()

    async def _flush_loop(self) -> None:
        assert self._wake is not None and self._progress is not None
        while True:
            await self._wake.wait()
            if not self._urgent and self.flush_interval_s:
                await asyncio.sleep(self.flush_interval_s)  # let a batch accumulate
            self._wake.clear()
            self._urgent = False
            try:
                async with self._shipping:
                    await self._drain()
            except StoreReset as e:  # the store is up, only empty: replay at once, no backoff
                log.warning("%s", e)
                self._wake.set()
            except StoreUnavailable as e:
                self.store_errors += 1
                self.last_error = str(e)
                log.warning("ledger store unavailable, records stay journaled: %s", e)
                await asyncio.sleep(self.retry_backoff_s)
                self._wake.set()
            except Exception as e:  # never let the flusher die: records would pile up silently
                self.store_errors += 1
                self.last_error = repr(e)
                log.exception("ledger flusher error")
                await asyncio.sleep(self.retry_backoff_s)
                self._wake.set()

    def verify_store(self) -> None:
        """Check the store's mark again before the next batch (a cache that held it came back
        empty): the flusher replays the journal if it changed."""
        self._marked = False
        if self._wake is not None:
            self._wake.set()

    async def flush_verified(self, timeout: float | None = None) -> None:
        """flush(), after checking that the store still holds what the checkpoint says: what
        a reader summing the store (a budget counter being rebuilt) must wait for."""
        try:
            async with self._shipping:
                await self._check_mark()
        except StoreReset:
            pass
        await self.flush(timeout)

    async def _check_mark(self) -> None:
        mark = await self.store.mark()
        known = self.journal.store_mark()
        if known and known != mark and self.journal.committed:
            self.store_resets += 1
            log.warning("ledger store lost its data (mark %s, journal checkpointed against %s): "
                        "replaying all %d journal bytes", mark, known, self.journal.size)
            self.journal.rewind()
        self.journal.set_store_mark(mark)
        self._marked = True

    async def _drain(self) -> None:
        assert self._progress is not None
        if not self._marked:
            await self._check_mark()
        while self.journal.pending_bytes:
            records, offset = self.journal.read_batch(self.batch_size)
            if records:
                try:
                    added = await self.store.upsert(records)
                except StoreReset:
                    self._marked = False
                    raise
                self.stored += added
                self.duplicates += len(records) - added
            self.journal.commit(offset, self.compact_bytes)
            async with self._progress:
                self._progress.notify_all()

    # -- feedback and queries (not on the hot path) --------------------------------------------

    async def attach_outcome(self, *, request_id: str | None = None, session_id: str | None = None,
                             passed: bool | None = None, score: float | None = None,
                             pass_threshold: float = 0.5, note: str = "") -> Outcome:
        """Attach feedback to one request or a whole session: pass/fail, a score, or both
        (a score alone passes when >= pass_threshold)."""
        import time
        if (request_id is None) == (session_id is None):
            raise ValueError("give exactly one of request_id or session_id")
        if passed is None:
            if score is None:
                raise ValueError("give passed, score or both")
            passed = score >= pass_threshold
        outcome = Outcome(target="request" if request_id else "session",
                          target_id=request_id or session_id or "", passed=passed, score=score,
                          ts=time.time(), note=note)
        await self.store.put_outcome(outcome)
        return outcome

    async def usage(self, group_by: tuple[str, ...] | list[str] = ("key_id",), *,
                    since: float | None = None, until: float | None = None,
                    where: dict[str, str] | None = None) -> list[UsageRow]:
        return await usage_report(self.store, tuple(group_by), since=since, until=until, where=where)

    async def success(self, group_by: tuple[str, ...] | list[str] = ("model", "tier", "weight_version"),
                      *, since: float | None = None, until: float | None = None) -> list[SuccessRow]:
        return await success_report(self.store, tuple(group_by), since=since, until=until)

    async def export_csv(self, out: TextIO, *, since: float | None = None,
                         until: float | None = None) -> int:
        return await export_csv(self.store, out, since=since, until=until)

    async def export_focus_csv(self, out: TextIO, *, since: float | None = None,
                               until: float | None = None) -> int:
        return await export_focus_csv(self.store, out, since=since, until=until)
