"""The batch worker: every gateway runs one. It claims lines of the open batch jobs in
PostgreSQL (gateway/batch_store.py), as many as the engines have headroom for (gateway/lanes.py),
sends each through the one request pipeline (gateway/exchange.py) at batch priority and price,
and writes each line's answer (in the shape of the API its job came through: OpenAI's Batch API,
Anthropic's Message Batches) and ledger record once. docs/batch.md.

Exactly once, through a gateway's death: a line's ledger record is built by the pipeline's end as
for any request, but handed here instead of to the ledger (`ctx.record_sink`); it is stored with
the output line in one UPDATE guarded by the line's lease, and recorded in the ledger only after.
The job's close records every stored record again before it completes: records are keyed by
(ts, request_id) and replays add nothing, so a record lost with a killed gateway is recorded
then, and one recorded twice is stored once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec

from yieldgate.pricing import ApiKey, KeyNotFound, LedgerError, LedgerRecord, StoreUnavailable

from .apis import APIS, ROUTES
from .batch_api import BatchResultLines, ResultLines
from .batch_store import ANTHROPIC, OPENAI, BatchRow, BatchStore, BatchStoreUnavailable, Claimed, new_id
from .config import LaneConfig
from .errors import APIError, InternalError, QuotaExceeded, ServiceUnavailable, TooManyRequests, UpstreamError
from .exchange import Pipeline
from .message_batches import MessageBatchResultLines
from .proxy import Proxy
from .tiers import BATCH, STANDARD

log = logging.getLogger("yieldgate.batch")
_encode = msgspec.json.Encoder(decimal_format="number").encode
_RECORD = msgspec.json.Decoder(LedgerRecord)
# Failures that say "not now" rather than "this line is wrong": the line goes back to the queue.
_LATER = (ServiceUnavailable, UpstreamError)
MAX_ATTEMPTS = 5
# A job's result lines in the shape of the API it was created through.
RESULT_LINES: dict[str, ResultLines] = {OPENAI: BatchResultLines(), ANTHROPIC: MessageBatchResultLines()}


class _Later(Exception):
    """Put the line back: it may run later (a rate limit, no replica, an engine down)."""

    def __init__(self, counts: bool):
        self.counts = counts  # an attempt (an engine or store failure), or only a wait (a rate limit)


class BatchWorker:
    def __init__(self, store: BatchStore, pipeline: Pipeline, proxy: Proxy, config: LaneConfig, owner: str):
        self.store = store
        self.pipeline = pipeline
        self.proxy = proxy
        self.config = config
        self.owner = owner                     # the lease holder's name: this gateway instance
        self.running: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._backoff_until = 0.0
        self._stopping: set[str] = set()       # jobs cancelled or expired: their lines in flight are cut off

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="yieldgate-batch-worker")
        self._heartbeat = asyncio.create_task(self._renew(), name="yieldgate-batch-leases")

    async def close(self) -> None:
        """Stop claiming; lines in flight are cut off and go back to the queue for another gateway."""
        for task in (self._task, self._heartbeat):
            if task is not None:
                task.cancel()
        lines = list(self.running.items())
        for _, task in lines:
            task.cancel()
        if lines:
            await asyncio.wait([t for _, t in lines], timeout=5)
        for (batch_id, line), _ in lines:
            with contextlib.suppress(BatchStoreUnavailable):
                await self.store.release(batch_id, line, self.owner)

    # -- the loop ----------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await self._round()
            except BatchStoreUnavailable as exc:
                log.warning("batch store unreachable, trying again: %s", exc)
            except Exception:  # the worker must outlive any one failure
                log.exception("batch worker round failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.batch_poll_s)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.config.batch_lease_s / 3)
            try:
                await self.store.renew(self.owner, list(self.running), self.config.batch_lease_s)
            except BatchStoreUnavailable as exc:
                log.warning("batch leases not renewed: %s", exc)

    async def _round(self) -> None:
        active = await self.store.active()
        self._stopping &= {b.id for b in active}  # closed meanwhile, perhaps by another gateway
        for batch in active:
            if batch.status == "cancelling":
                await self._close(batch, "cancelled")
            elif time.time() >= batch.expires_at:
                await self._close(batch, "expired")
            else:
                await self._dispatch(batch)

    async def _dispatch(self, batch: BatchRow) -> None:
        room = 0 if time.monotonic() < self._backoff_until else \
            self.pipeline.registry.primary.lanes.batch_room(STANDARD, len(self.running))
        claimed = await self.store.claim(batch.id, self.owner, room, self.config.batch_lease_s) if room else []
        for line in claimed:
            task = asyncio.create_task(self._line(batch, line))
            self.running[(batch.id, line.line)] = task
            task.add_done_callback(lambda _, k=(batch.id, line.line): self._done(k))
        if not claimed and not any(b == batch.id for b, _ in self.running):
            if (await self.store.counts(batch.id)).open == 0:
                await self._finish(batch, "completed")

    def _done(self, key: tuple[str, int]) -> None:
        self.running.pop(key, None)
        self._wake.set()  # room for another line

    async def _close(self, batch: BatchRow, why: str) -> None:
        """Cancelled or expired (`why`): lines nobody runs fail with the reason; in-flight ones are
        cut off (not billed); once none is open, the job closes."""
        if batch.id not in self._stopping:  # stop within seconds, whatever the lines' max_tokens
            self._stopping.add(batch.id)
            for (batch_id, _), task in list(self.running.items()):
                if batch_id == batch.id:
                    task.cancel()
        lines = RESULT_LINES[batch.api]
        await self.store.close_open_lines(batch.id, why, lambda custom_id, _line: lines.closed(custom_id, why, False))
        if (await self.store.counts(batch.id)).open == 0:
            await self._finish(batch, why)
            self._stopping.discard(batch.id)

    async def _finish(self, batch: BatchRow, status: str) -> None:
        """Every stored record into the ledger (again: replays add nothing), then the job's files."""
        ledger = self.pipeline.accounting.ledger
        if ledger is not None:
            async for docs in self.store.records(batch.id):
                for doc in docs:
                    ledger.record(_RECORD.decode(doc))
            try:
                await ledger.flush(timeout=10.0)
            except LedgerError as exc:  # the records are in the journal: stored once the store is back
                log.warning("batch %s closed with its ledger records still in the journal: %s", batch.id, exc)
        if await self.store.finalize(batch.id, status):
            log.info("batch %s %s", batch.id, status)

    # -- one line ----------------------------------------------------------------------------------

    async def _line(self, batch: BatchRow, claimed: Claimed) -> None:
        request_id = new_id("batch_req_")
        records: list[LedgerRecord] = []
        lines = RESULT_LINES[batch.api]
        try:
            status, body = await self._send(batch, claimed, request_id, records)
        except _Later as later:
            await self.store.release(batch.id, claimed.line, self.owner, counts=later.counts)
            return
        except asyncio.CancelledError:
            if batch.id not in self._stopping:
                raise  # the gateway stops: close() gives the line back
            # Cut off by the job's cancel or expiry: nothing of it is delivered, nothing billed.
            why = "cancelled" if time.time() < batch.expires_at else "expired"
            await self.store.finish_line(batch.id, claimed.line, self.owner, False,
                                         lines.closed(claimed.custom_id, why, True), None, closed=why)
            return
        except Exception:
            log.exception("batch %s line %d failed", batch.id, claimed.line)
            status, body = self._error(batch, InternalError("Internal gateway error."))
        line = lines.answered(claimed.custom_id, request_id, status, body)
        record = records[0] if records else None
        kept = await self.store.finish_line(batch.id, claimed.line, self.owner, status == 200, line,
                                            _encode(record) if record is not None else None)
        ledger = self.pipeline.accounting.ledger
        if kept and record is not None and ledger is not None:
            ledger.record(record)
        elif not kept:
            log.warning("batch %s line %d: lease lost to another gateway; its answer is kept", batch.id, claimed.line)

    async def _send(self, batch: BatchRow, claimed: Claimed, request_id: str,
                    records: list[LedgerRecord]) -> tuple[int, bytes]:
        """The line through the pipeline, as its key would send it: (HTTP status, answer body)."""
        try:
            key = await self._key(batch.key_id)
            exchange = self.pipeline.open(ROUTES[batch.endpoint], {b"x-request-id": request_id.encode()},
                                          claimed.body, key, lane=BATCH)
        except _LATER as exc:
            return self._later(batch, claimed, exc)
        except APIError as exc:
            return self._error(batch, exc)
        ctx = exchange.ctx
        ctx.batch_id = batch.id
        ctx.record_sink = records.append
        try:
            await exchange.admit(None)
            response = await self.proxy.unary(exchange)
            return response.status_code, bytes(response.body)
        except QuotaExceeded as exc:  # over budget: this line fails, the job goes on
            return self._error(batch, exc)
        except TooManyRequests as exc:  # the key's RPM/TPM: every line waits, none fails
            self._backoff_until = time.monotonic() + float(exc.headers.get("retry-after", "1"))
            raise _Later(counts=False) from None
        except _LATER as exc:
            return self._later(batch, claimed, exc)
        except APIError as exc:
            return self._error(batch, exc)
        except asyncio.CancelledError:
            exchange.end("cancelled")  # not an estimated status: a line cut off is not billed
            raise
        finally:
            exchange.end("error")  # a no-op once the answer ended it

    @classmethod
    def _later(cls, batch: BatchRow, claimed: Claimed, exc: APIError) -> tuple[int, bytes]:
        """Back to the queue while it has tries left, else its error is the line's answer."""
        if claimed.attempts < MAX_ATTEMPTS:
            raise _Later(counts=True) from None
        return cls._error(batch, exc)

    @staticmethod
    def _error(batch: BatchRow, exc: APIError) -> tuple[int, bytes]:
        """The error as the line's route answers it (status, body in its API's shape)."""
        response = APIS[ROUTES[batch.endpoint]].error(exc)
        return response.status_code, bytes(response.body)

    async def _key(self, key_id: str) -> ApiKey | None:
        """The batch's API key as it is now (budget, limits; a revoked key runs nothing more)."""
        if not key_id:
            return None  # created with the admin credential
        keys = self.pipeline.accounting.keys
        assert keys is not None
        try:
            key = await keys.get(key_id)
        except KeyNotFound:
            key = None
        except StoreUnavailable as exc:
            raise ServiceUnavailable(f"Key store unreachable: {exc}") from None
        if key is None or key.revoked:
            raise APIError(f"API key {key_id} was revoked.", status=401, code="invalid_api_key")
        return key

