"""The batch APIs' state in PostgreSQL, shared by every gateway and kept across their restarts:
uploaded files (in chunks, never whole in memory), batch jobs (OpenAI's Batch API and Anthropic's
Message Batches, `api`), and one row per input line that carries its claim (a lease), its result
line and its ledger record (docs/batch.md).

Exactly once: a line is claimed with FOR UPDATE SKIP LOCKED under a lease its gateway renews; its
result and its ledger record are written in one UPDATE that only the lease holder can make, so a
line re-claimed after its gateway died is answered once, by whoever finishes it. Output and error
files, and a message batch's results, are views over the lines: read from the rows, in line order.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import msgspec

from .errors import ServiceUnavailable

CHUNK_BYTES = 1024 * 1024        # a file's chunk row
LINES_PER_PAGE = 500             # output lines read per round trip
ACTIVE = ("in_progress", "cancelling", "finalizing")
TERMINAL = ("completed", "failed", "cancelled", "expired")
OPENAI, ANTHROPIC = "openai", "anthropic"   # the API a job was created through (yg_batch.api)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS yg_file (
    id text PRIMARY KEY, owner text NOT NULL, purpose text NOT NULL, filename text NOT NULL,
    bytes int8 NOT NULL DEFAULT 0, created_at float8 NOT NULL,
    kind text NOT NULL DEFAULT 'upload',     -- upload, or a batch's output / error lines
    batch_id text, deleted bool NOT NULL DEFAULT false
);
CREATE INDEX IF NOT EXISTS yg_file_owner ON yg_file (owner, created_at);
CREATE TABLE IF NOT EXISTS yg_file_chunk (
    file_id text NOT NULL, seq int4 NOT NULL, data bytea NOT NULL, PRIMARY KEY (file_id, seq)
);
CREATE TABLE IF NOT EXISTS yg_batch (
    id text PRIMARY KEY, owner text NOT NULL, key_id text NOT NULL DEFAULT '',
    input_file_id text NOT NULL, endpoint text NOT NULL, completion_window text NOT NULL,
    status text NOT NULL, created_at float8 NOT NULL, expires_at float8 NOT NULL,
    in_progress_at float8, finalizing_at float8, completed_at float8, failed_at float8,
    expired_at float8, cancelling_at float8, cancelled_at float8,
    output_file_id text, error_file_id text, metadata text, total int4 NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS yg_batch_owner ON yg_batch (owner, created_at);
CREATE INDEX IF NOT EXISTS yg_batch_active ON yg_batch (created_at)
    WHERE status IN ('in_progress', 'cancelling', 'finalizing');
CREATE TABLE IF NOT EXISTS yg_batch_line (
    batch_id text NOT NULL, line int4 NOT NULL, custom_id text, body bytea,
    prefix int8 NOT NULL DEFAULT 0,          -- lines sharing a prompt prefix are claimed together
    state text NOT NULL,                     -- pending, running, done (output file), failed (error file)
    lease_owner text, lease_until float8, attempts int4 NOT NULL DEFAULT 0,
    result bytea, record bytea,
    PRIMARY KEY (batch_id, line)
);
CREATE UNIQUE INDEX IF NOT EXISTS yg_batch_line_custom_id ON yg_batch_line (batch_id, custom_id);
CREATE INDEX IF NOT EXISTS yg_batch_line_todo ON yg_batch_line (batch_id, prefix, line)
    WHERE state IN ('pending', 'running');
-- Message Batches beside the Batch API; a line its job's cancel or expiry closed says which.
ALTER TABLE yg_batch ADD COLUMN IF NOT EXISTS api text NOT NULL DEFAULT 'openai';
ALTER TABLE yg_batch_line ADD COLUMN IF NOT EXISTS closed text;
"""
_ERRORS = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError)


class BatchStoreUnavailable(ServiceUnavailable):
    code = "batch_store_unavailable"


class DuplicateCustomId(ValueError):
    pass


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


class FileRow(msgspec.Struct, kw_only=True):
    id: str
    owner: str
    purpose: str
    filename: str
    bytes: int
    created_at: float
    kind: str = "upload"
    batch_id: str | None = None
    deleted: bool = False


class BatchRow(msgspec.Struct, kw_only=True):
    id: str
    owner: str
    key_id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    status: str
    created_at: float
    expires_at: float
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    metadata: str | None = None
    total: int = 0
    api: str = OPENAI


@dataclass(slots=True)
class LineCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0     # answered with an error, or closed unanswered by the job's cancel or expiry
    open: int = 0       # pending or running
    cancelled: int = 0  # of `failed`: closed by the job's cancel
    expired: int = 0    # of `failed`: closed by the job's expiry


@dataclass(slots=True)
class NewLine:
    line: int
    custom_id: str | None
    body: bytes | None
    prefix: int
    state: str          # pending, or failed with `result` already written
    result: bytes | None = None


@dataclass(slots=True)
class Claimed:
    batch_id: str
    line: int
    custom_id: str
    body: bytes
    attempts: int = 1


class BatchStore:
    def __init__(self, url: str, *, max_connections: int = 4, timeout_s: float = 5.0):
        self.url = url
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self._pool: asyncpg.Pool | None = None

    async def open(self) -> None:
        try:
            pool = await asyncpg.create_pool(self.url, min_size=1, max_size=self.max_connections,
                                             timeout=self.timeout_s, command_timeout=60)
            async with pool.acquire() as conn:
                # Several gateways may start at once: one creates the schema at a time.
                async with conn.transaction():
                    await conn.execute("SELECT pg_advisory_xact_lock(hashtext('yg_batch_schema'))")
                    await conn.execute(_SCHEMA)
        except _ERRORS as e:
            raise BatchStoreUnavailable(f"batch store (PostgreSQL): {e}") from e
        self._pool = pool

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise BatchStoreUnavailable("batch store (PostgreSQL) is not open")
        return self._pool

    async def _run(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.pool, method)(*args)
        except _ERRORS as e:
            raise BatchStoreUnavailable(f"batch store (PostgreSQL): {e}") from e

    # -- files -------------------------------------------------------------------------------------

    async def create_file(self, owner: str, purpose: str, filename: str,
                          chunks: AsyncIterator[bytes], max_bytes: int) -> FileRow:
        """Store an upload chunk by chunk in one transaction; ValueError past `max_bytes`."""
        row = FileRow(id=new_id("file-"), owner=owner, purpose=purpose, filename=filename, bytes=0,
                      created_at=time.time())
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                seq = 0
                async for chunk in chunks:
                    row.bytes += len(chunk)
                    if row.bytes > max_bytes:
                        raise ValueError(f"File exceeds {max_bytes} bytes.")
                    await conn.execute("INSERT INTO yg_file_chunk VALUES ($1, $2, $3)", row.id, seq, chunk)
                    seq += 1
                await conn.execute("INSERT INTO yg_file (id, owner, purpose, filename, bytes, created_at) "
                                   "VALUES ($1, $2, $3, $4, $5, $6)", row.id, owner, purpose, filename,
                                   row.bytes, row.created_at)
        except _ERRORS as e:
            raise BatchStoreUnavailable(f"batch store (PostgreSQL): {e}") from e
        return row

    async def get_file(self, file_id: str) -> FileRow | None:
        r = await self._run("fetchrow", "SELECT id, owner, purpose, filename, bytes, created_at, kind, batch_id, "
                                        "deleted FROM yg_file WHERE id = $1 AND NOT deleted", file_id)
        return None if r is None else FileRow(**dict(r))

    async def list_files(self, owner: str | None, purpose: str | None, after: str | None, limit: int,
                         ascending: bool) -> list[FileRow]:
        args: list[Any] = [owner, purpose, limit + 1]
        cursor = ""
        if after:
            args.append(after)
            cursor = (f" AND (created_at, id) {'>' if ascending else '<'} "
                      "(SELECT created_at, id FROM yg_file WHERE id = $4)")
        order = "ASC" if ascending else "DESC"
        rows = await self._run(
            "fetch", "SELECT id, owner, purpose, filename, bytes, created_at, kind, batch_id, deleted FROM yg_file "
            "WHERE NOT deleted AND ($1::text IS NULL OR owner = $1) AND ($2::text IS NULL OR purpose = $2)"
            f"{cursor} ORDER BY created_at {order}, id {order} LIMIT $3", *args)
        return [FileRow(**dict(r)) for r in rows]

    async def delete_file(self, file_id: str) -> None:
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                await conn.execute("UPDATE yg_file SET deleted = true WHERE id = $1", file_id)
                await conn.execute("DELETE FROM yg_file_chunk WHERE file_id = $1", file_id)
        except _ERRORS as e:
            raise BatchStoreUnavailable(f"batch store (PostgreSQL): {e}") from e

    async def file_content(self, file: FileRow) -> AsyncIterator[bytes]:
        """An uploaded file's chunks, or a batch output's lines, a page per round trip."""
        if file.kind == "upload":
            seq = 0
            while True:
                rows = await self._run("fetch", "SELECT data FROM yg_file_chunk WHERE file_id = $1 AND seq >= $2 "
                                                "ORDER BY seq LIMIT 4", file.id, seq)
                if not rows:
                    return
                for r in rows:
                    yield bytes(r["data"])
                seq += len(rows)
        else:
            assert file.batch_id is not None
            async for page in self.results(file.batch_id, ["done" if file.kind == "batch_output" else "failed"]):
                yield page

    async def results(self, batch_id: str, states: Sequence[str] = ("done", "failed")) -> AsyncIterator[bytes]:
        """The result lines of a job's lines in `states`, in line order, a page per round trip."""
        last = -1
        while True:
            rows = await self._run(
                "fetch", "SELECT line, result FROM yg_batch_line WHERE batch_id = $1 AND state = ANY($2::text[]) "
                "AND line > $3 ORDER BY line LIMIT $4", batch_id, list(states), last, LINES_PER_PAGE)
            if not rows:
                return
            yield b"".join(bytes(r["result"]) + b"\n" for r in rows)
            last = rows[-1]["line"]

    # -- batches -----------------------------------------------------------------------------------

    async def create_batch(self, batch: BatchRow, lines: AsyncIterator[Sequence[NewLine]]) -> BatchRow:
        """The job and its lines in one transaction (nothing is left of a refused one);
        DuplicateCustomId when two lines share a custom_id."""
        columns = ("batch_id", "line", "custom_id", "body", "prefix", "state", "result")
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                async for group in lines:
                    batch.total += len(group)
                    await conn.copy_records_to_table(
                        "yg_batch_line", columns=columns,
                        records=[(batch.id, n.line, n.custom_id, n.body, n.prefix, n.state, n.result) for n in group])
                if batch.total:
                    await conn.execute(
                        "INSERT INTO yg_batch (id, owner, key_id, input_file_id, endpoint, completion_window, "
                        "status, created_at, expires_at, in_progress_at, metadata, total, api) "
                        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
                        batch.id, batch.owner, batch.key_id, batch.input_file_id, batch.endpoint,
                        batch.completion_window, batch.status, batch.created_at, batch.expires_at,
                        batch.in_progress_at, batch.metadata, batch.total, batch.api)
        except asyncpg.UniqueViolationError as e:
            raise DuplicateCustomId(str(e)) from None
        except _ERRORS as e:
            raise BatchStoreUnavailable(f"batch store (PostgreSQL): {e}") from e
        return batch

    async def get_batch(self, batch_id: str, api: str = OPENAI) -> BatchRow | None:
        """A job created through `api` (each API sees only its own)."""
        r = await self._run("fetchrow", "SELECT * FROM yg_batch WHERE id = $1 AND api = $2", batch_id, api)
        return None if r is None else BatchRow(**dict(r))

    async def list_batches(self, owner: str | None, limit: int, *, api: str = OPENAI, after: str | None = None,
                           before: str | None = None) -> list[BatchRow]:
        """Up to `limit` + 1 jobs, newest first: those older than `after`, or the newest ones just
        newer than `before` (the extra one tells there are more)."""
        args: list[Any] = [owner, api, limit + 1]
        cursor, order = "", "DESC"
        if after or before:
            args.append(after or before)
            cursor = (f" AND (created_at, id) {'<' if after else '>'} "
                      "(SELECT created_at, id FROM yg_batch WHERE id = $4)")
            order = "DESC" if after else "ASC"
        rows = await self._run("fetch", "SELECT * FROM yg_batch WHERE ($1::text IS NULL OR owner = $1) AND api = $2"
                                        f"{cursor} ORDER BY created_at {order}, id {order} LIMIT $3", *args)
        batches = [BatchRow(**dict(r)) for r in rows]
        if order == "ASC":  # the page nearest the cursor, shown newest first; its extra one is the newest
            batches = batches[:limit][::-1] + batches[limit:]
        return batches

    async def delete_batch(self, batch_id: str) -> bool:
        """A closed job and its lines (their ledger records are in the ledger); False if it is open."""
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                status = await conn.fetchval("DELETE FROM yg_batch WHERE id = $1 AND status = ANY($2::text[]) "
                                             "RETURNING status", batch_id, list(TERMINAL))
                if status is None:
                    return False
                await conn.execute("DELETE FROM yg_batch_line WHERE batch_id = $1", batch_id)
                await conn.execute("UPDATE yg_file SET deleted = true WHERE batch_id = $1", batch_id)
        except _ERRORS as e:
            raise BatchStoreUnavailable(f"batch store (PostgreSQL): {e}") from e
        return True

    async def counts(self, batch_id: str) -> LineCounts:
        r = await self._run(
            "fetchrow", "SELECT count(*) AS total, count(*) FILTER (WHERE state = 'done') AS completed, "
            "count(*) FILTER (WHERE state = 'failed') AS failed, "
            "count(*) FILTER (WHERE state IN ('pending', 'running')) AS open, "
            "count(*) FILTER (WHERE closed = 'cancelled') AS cancelled, "
            "count(*) FILTER (WHERE closed = 'expired') AS expired FROM yg_batch_line WHERE batch_id = $1",
            batch_id)
        return LineCounts(r["total"], r["completed"], r["failed"], r["open"], r["cancelled"], r["expired"])

    async def cancel(self, batch_id: str) -> BatchRow | None:
        """in_progress -> cancelling (the workers stop claiming and close it); others unchanged."""
        await self._run("execute", "UPDATE yg_batch SET status = 'cancelling', cancelling_at = $2 "
                                   "WHERE id = $1 AND status IN ('validating', 'in_progress')", batch_id, time.time())
        r = await self._run("fetchrow", "SELECT * FROM yg_batch WHERE id = $1", batch_id)
        return None if r is None else BatchRow(**dict(r))

    async def active(self) -> list[BatchRow]:
        rows = await self._run("fetch", "SELECT * FROM yg_batch WHERE status IN ('in_progress', 'cancelling', "
                                        "'finalizing') ORDER BY created_at")
        return [BatchRow(**dict(r)) for r in rows]

    # -- lines: claims, results, the end of a job --------------------------------------------------

    async def claim(self, batch_id: str, owner: str, n: int, lease_s: float) -> list[Claimed]:
        """Up to `n` lines nobody holds (pending, or running under an expired lease), in prefix order."""
        now = time.time()
        rows = await self._run(
            "fetch", "UPDATE yg_batch_line l SET state = 'running', lease_owner = $2, lease_until = $3, "
            "attempts = attempts + 1 FROM (SELECT line FROM yg_batch_line WHERE batch_id = $1 AND "
            "(state = 'pending' OR (state = 'running' AND lease_until < $4)) ORDER BY prefix, line "
            "LIMIT $5 FOR UPDATE SKIP LOCKED) c WHERE l.batch_id = $1 AND l.line = c.line "
            "RETURNING l.line, l.custom_id, l.body, l.attempts", batch_id, owner, now + lease_s, now, n)
        return [Claimed(batch_id, r["line"], r["custom_id"], bytes(r["body"]), r["attempts"]) for r in rows]

    async def renew(self, owner: str, lines: Sequence[tuple[str, int]], lease_s: float) -> None:
        if not lines:
            return
        await self._run("execute", "UPDATE yg_batch_line SET lease_until = $2 FROM unnest($3::text[], $4::int4[]) "
                                   "AS c(b, l) WHERE batch_id = c.b AND line = c.l AND state = 'running' "
                                   "AND lease_owner = $1", owner, time.time() + lease_s,
                        [b for b, _ in lines], [line for _, line in lines])

    async def finish_line(self, batch_id: str, line: int, owner: str, ok: bool, result: bytes,
                          record: bytes | None, closed: str | None = None) -> bool:
        """Write a line's result (and ledger record) once: False if its lease was lost meanwhile
        (another gateway re-claimed it; its answer is the one kept). `closed`: cut off by the
        job's cancel or expiry ("cancelled", "expired")."""
        status = await self._run(
            "execute", "UPDATE yg_batch_line SET state = $4, result = $5, record = $6, closed = $7, "
            "lease_owner = NULL WHERE batch_id = $1 AND line = $2 AND state = 'running' AND lease_owner = $3",
            batch_id, line, owner, "done" if ok else "failed", result, record, closed)
        return status.endswith(" 1")

    async def release(self, batch_id: str, line: int, owner: str, counts: bool = False) -> None:
        """Give a claimed line back unanswered; `counts`: the try counts against its attempts."""
        await self._run("execute", "UPDATE yg_batch_line SET state = 'pending', lease_owner = NULL, "
                                   "attempts = attempts - $4 WHERE batch_id = $1 AND line = $2 AND "
                                   "state = 'running' AND lease_owner = $3", batch_id, line, owner, 0 if counts else 1)

    async def close_open_lines(self, batch_id: str, closed: str, results: Any) -> int:
        """Cancelled or expired (`closed`): every line nobody holds fails with `results(custom_id, line)`."""
        now = time.time()
        rows = await self._run("fetch", "SELECT line, custom_id FROM yg_batch_line WHERE batch_id = $1 AND "
                                        "(state = 'pending' OR (state = 'running' AND lease_until < $2))",
                               batch_id, now)
        if not rows:
            return 0
        await self._run("executemany", "UPDATE yg_batch_line SET state = 'failed', result = $3, closed = $5, "
                                       "lease_owner = NULL WHERE batch_id = $1 AND line = $2 AND (state = 'pending' "
                                       "OR (state = 'running' AND lease_until < $4))",
                        [(batch_id, r["line"], results(r["custom_id"], r["line"]), now, closed) for r in rows])
        return len(rows)

    async def records(self, batch_id: str) -> AsyncIterator[list[bytes]]:
        """The ledger records of a job's answered lines, a page at a time."""
        last = -1
        while True:
            rows = await self._run("fetch", "SELECT line, record FROM yg_batch_line WHERE batch_id = $1 AND "
                                            "record IS NOT NULL AND line > $2 ORDER BY line LIMIT $3",
                                   batch_id, last, LINES_PER_PAGE)
            if not rows:
                return
            yield [bytes(r["record"]) for r in rows]
            last = rows[-1]["line"]

    async def finalize(self, batch_id: str, status: str) -> bool:
        """Close a job whose lines are all answered: its final status, and for a Batch API job its
        output and error files. False when another gateway closed it first or a line is still open."""
        now = time.time()
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                row = await conn.fetchrow("SELECT * FROM yg_batch WHERE id = $1 AND status IN ('in_progress', "
                                          "'cancelling', 'finalizing') FOR UPDATE", batch_id)
                if row is None:
                    return False
                still_open = await conn.fetchval("SELECT count(*) FROM yg_batch_line WHERE batch_id = $1 AND "
                                                 "state IN ('pending', 'running')", batch_id)
                if still_open:
                    return False
                files: dict[str, str | None] = {}
                for kind, state in (("batch_output", "done"), ("batch_error", "failed")):
                    if row["api"] != OPENAI:  # a message batch's results are read from its lines
                        files[kind] = None
                        continue
                    size, n = await conn.fetchrow(
                        "SELECT coalesce(sum(octet_length(result) + 1), 0), count(*) FROM yg_batch_line "
                        "WHERE batch_id = $1 AND state = $2", batch_id, state)
                    if not n:
                        files[kind] = None
                        continue
                    files[kind] = file_id = new_id("file-")
                    await conn.execute("INSERT INTO yg_file (id, owner, purpose, filename, bytes, created_at, kind, "
                                       "batch_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)", file_id, row["owner"],
                                       kind, f"{batch_id}_{'output' if state == 'done' else 'error'}.jsonl",
                                       size, now, kind, batch_id)
                at = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at",
                      "failed": "failed_at"}[status]
                await conn.execute(f"UPDATE yg_batch SET status = $2, finalizing_at = coalesce(finalizing_at, $3), "
                                   f"{at} = $3, output_file_id = $4, error_file_id = $5 WHERE id = $1",
                                   batch_id, status, now, files["batch_output"], files["batch_error"])
        except _ERRORS as e:
            raise BatchStoreUnavailable(f"batch store (PostgreSQL): {e}") from e
        return True
