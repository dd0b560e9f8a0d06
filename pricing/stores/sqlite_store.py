"""SQLiteStore: the embedded default — one file, durable, zero setup.

sqlite3 runs in one dedicated worker thread (a connection must stay on its thread), so the event
loop never blocks on disk. Each record is kept as its JSON document plus indexed columns.
"""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
from collections.abc import AsyncIterator, Iterable, Sequence
from decimal import Decimal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

import msgspec

from ..errors import StoreUnavailable
from ..record import RECORD_KEYS, LedgerRecord, Outcome, OutcomeTarget

T = TypeVar("T")
_ENC = msgspec.json.Encoder()
_REC = msgspec.json.Decoder(LedgerRecord)
_OUT = msgspec.json.Decoder(Outcome)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (
    request_id TEXT PRIMARY KEY,
    ts REAL NOT NULL,
    key_id TEXT, team TEXT, model TEXT, tier TEXT, replica TEXT, weight_version TEXT,
    session_id TEXT,
    doc BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_ts ON ledger(ts);
CREATE INDEX IF NOT EXISTS ledger_session ON ledger(session_id);
CREATE INDEX IF NOT EXISTS ledger_key ON ledger(key_id, ts);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS outcome (
    target TEXT NOT NULL, target_id TEXT NOT NULL, doc BLOB NOT NULL,
    PRIMARY KEY (target, target_id)
);
"""


class SQLiteStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self._pool: ThreadPoolExecutor | None = None
        self._db: sqlite3.Connection | None = None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        assert self._pool is not None, "SQLiteStore used before open()"
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except sqlite3.Error as e:
            raise StoreUnavailable(f"sqlite {self.path}: {e}") from e

    async def open(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="yg-ledger-sqlite")
        await self._run(self._open_sync)

    def _open_sync(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed batch survives power loss, after which the journal checkpoint advances.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    async def close(self) -> None:
        if self._pool is None:
            return
        if self._db is not None:
            await self._run(self._db.close)
        self._pool.shutdown(wait=True)
        self._pool = None

    async def mark(self) -> str:
        await self._run(self._exec, "INSERT OR IGNORE INTO meta VALUES ('epoch', ?)", (secrets.token_hex(8),))
        row = await self._run(self._one, "SELECT value FROM meta WHERE name = 'epoch'", ())
        assert row is not None
        return str(row[0])

    async def key_spend(self, key_id: str, since: float | None = None,
                        until: float | None = None) -> Decimal:
        rows = await self._run(self._many, "SELECT doc FROM ledger WHERE key_id = ? AND ts >= ? AND ts < ?",
                               (key_id, float("-inf") if since is None else since,
                                float("inf") if until is None else until))
        return sum((_REC.decode(doc).cost_total for (doc,) in rows), Decimal(0))

    async def upsert(self, docs: Sequence[bytes]) -> int:
        rows = []
        for doc in docs:
            k = RECORD_KEYS.decode(doc)
            rows.append((k.request_id, k.ts, k.key_id, k.team, k.model, k.tier, k.replica, k.weight_version,
                         k.session_id, doc))
        return await self._run(self._upsert_sync, rows)

    def _upsert_sync(self, rows: list[tuple]) -> int:
        assert self._db is not None
        before = self._db.total_changes
        with self._db:  # one transaction per batch
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR IGNORE INTO ledger VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
        return self._db.total_changes - before

    async def get(self, request_id: str) -> LedgerRecord | None:
        row = await self._run(self._one, "SELECT doc FROM ledger WHERE request_id=?", (request_id,))
        return _REC.decode(row[0]) if row else None

    async def count(self) -> int:
        row = await self._run(self._one, "SELECT count(*) FROM ledger", ())
        return int(row[0])

    def _one(self, sql: str, args: tuple) -> tuple | None:
        assert self._db is not None
        return self._db.execute(sql, args).fetchone()

    def _many(self, sql: str, args: tuple) -> list[tuple]:
        assert self._db is not None
        return self._db.execute(sql, args).fetchall()

    async def scan(self, since: float | None = None, until: float | None = None,
                   batch: int = 1000) -> AsyncIterator[list[LedgerRecord]]:
        lo = float("-inf") if since is None else since
        hi = float("inf") if until is None else until
        last_ts, last_id = lo, ""
        while True:
            # Keyset pagination on (ts, request_id): stable while new rows arrive.
            rows = await self._run(
                self._many,
                "SELECT ts, request_id, doc FROM ledger WHERE ts >= ? AND ts < ? AND "
                "(ts > ? OR (ts = ? AND request_id > ?)) ORDER BY ts, request_id LIMIT ?",
                (lo, hi, last_ts, last_ts, last_id, batch))
            if not rows:
                return
            yield [_REC.decode(doc) for _, _, doc in rows]
            last_ts, last_id = rows[-1][0], rows[-1][1]

    async def put_outcome(self, outcome: Outcome) -> None:
        await self._run(self._exec, "INSERT OR REPLACE INTO outcome VALUES (?,?,?)",
                        (outcome.target, outcome.target_id, _ENC.encode(outcome)))

    def _exec(self, sql: str, args: tuple) -> None:
        assert self._db is not None
        self._db.execute(sql, args)

    async def get_outcomes(self, target: OutcomeTarget, ids: Iterable[str]) -> dict[str, Outcome]:
        ids = list(ids)
        found: dict[str, Outcome] = {}
        for i in range(0, len(ids), 500):
            part = ids[i:i + 500]
            rows = await self._run(
                self._many,
                f"SELECT target_id, doc FROM outcome WHERE target=? AND target_id IN ({','.join('?' * len(part))})",
                (target, *part))
            found.update((tid, _OUT.decode(doc)) for tid, doc in rows)
        return found
