"""PostgresStore: the ledger as the fleet's system of record, written by many gateways at once.

One typed row per billed request (no JSON document: ~200-300 bytes a row with its indexes) in a
table partitioned by day of `ts`, so retention is dropping a partition, not a DELETE that bloats.
A batch is one INSERT ... SELECT FROM json_populate_recordset($1) ON CONFLICT DO NOTHING: the
journal lines go over as they are (the gateway decodes nothing but each line's ts), PostgreSQL
types them into the row's columns, one round trip per batch, and a replayed batch adds nothing (the
key is (ts, request_id), and a replay carries the very same journal line, so the same ts). The key
leads with ts: rows arrive in time order, so its index grows at its right edge (full pages, no
random splits) and serves the reports' time-ordered scans. Partitions are created on demand
under an advisory lock, so any number of gateways may write the first row of a new day together.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from decimal import Decimal
from typing import Any

import asyncpg
import msgspec

from ..errors import StoreUnavailable
from ..record import LedgerRecord, Outcome, OutcomeTarget, UsageRow

DAY_S = 86400
_REC = msgspec.json.Decoder(LedgerRecord)

# Column order = LedgerRecord's fields (the struct's own order), each with its PostgreSQL type.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("request_id", "text"), ("ts", "float8"), ("key_id", "text"), ("team", "text"),
    ("model", "text"), ("tier", "text"), ("requested_tier", "text"), ("replica", "text"),
    ("weight_version", "text"), ("adapter", "text"), ("gateway", "text"), ("session_id", "text"),
    ("route", "text"), ("prompt_tokens", "int4"), ("cached_tokens", "int4"),
    ("completion_tokens", "int4"), ("cost_uncached_input", "numeric"),
    ("cost_cached_input", "numeric"), ("cost_output", "numeric"), ("cost_total", "numeric"),
    ("ttft_ms", "float8"), ("latency_ms", "float8"), ("status", "text"), ("batch_id", "text"),
    ("target", "text"), ("requested_model", "text"), ("task", "text"),
)
_NAMES = [c for c, _ in COLUMNS]
assert tuple(_NAMES) == LedgerRecord.__struct_fields__, "ledger columns out of step with LedgerRecord"
_NOT_NULL = {"request_id", "ts"}

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS yg_ledger (
    {", ".join(f"{c} {t}{' NOT NULL' if c in _NOT_NULL else ''}" for c, t in COLUMNS)},
    PRIMARY KEY (ts, request_id)
) PARTITION BY RANGE (ts);
-- Columns added after the table was first made: ALTERs in order keep the column order = LedgerRecord's.
ALTER TABLE yg_ledger ADD COLUMN IF NOT EXISTS batch_id text;
ALTER TABLE yg_ledger ADD COLUMN IF NOT EXISTS target text;
ALTER TABLE yg_ledger ADD COLUMN IF NOT EXISTS requested_model text;
ALTER TABLE yg_ledger ADD COLUMN IF NOT EXISTS task text;
CREATE INDEX IF NOT EXISTS yg_ledger_key_ts ON yg_ledger (key_id, ts);
CREATE TABLE IF NOT EXISTS yg_outcome (
    target text NOT NULL, target_id text NOT NULL, passed bool NOT NULL, score float8,
    ts float8 NOT NULL, note text NOT NULL DEFAULT '',
    PRIMARY KEY (target, target_id)
);
CREATE TABLE IF NOT EXISTS yg_meta (name text PRIMARY KEY, value text NOT NULL);
"""
# The JSON keys are LedgerRecord's fields, which are the columns; money arrives as decimal strings.
_INSERT = "INSERT INTO yg_ledger SELECT * FROM json_populate_recordset(NULL::yg_ledger, $1::json) ON CONFLICT DO NOTHING"


class _Ts(msgspec.Struct):
    ts: float


_TS = msgspec.json.Decoder(_Ts)
_SELECT = f"SELECT {', '.join(_NAMES)} FROM yg_ledger"
# report dimension -> SQL expression (the same values as pricing/report.py DIMENSIONS)
_DIMENSIONS = {
    "key_id": "key_id", "key": "key_id", "team": "team", "model": "model", "tier": "tier",
    "requested_tier": "coalesce(nullif(requested_tier, ''), tier)", "replica": "replica",
    "gateway": "gateway", "weight_version": "weight_version", "adapter": "adapter",
    "session_id": "session_id", "status": "status", "route": "route",
    "batch_id": "coalesce(batch_id, '')", "target": "coalesce(target, '')",
    "requested_model": "coalesce(requested_model, '')", "task": "coalesce(task, '')",
    "day": "to_char(to_timestamp(ts) AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
}
_SUMS = ("count(*), count(*) FILTER (WHERE status <> 'ok'), coalesce(sum(prompt_tokens), 0), "
         "coalesce(sum(cached_tokens), 0), coalesce(sum(completion_tokens), 0), sum(cost_uncached_input), "
         "sum(cost_cached_input), sum(cost_output), sum(cost_total)")
_LOCK = 0x79676c6564676572  # "ygledger": serialises partition creation across gateways


def partition_name(day_start: int) -> str:
    return "yg_ledger_" + time.strftime("%Y%m%d", time.gmtime(day_start))


def day_start(ts: float) -> int:
    return int(ts // DAY_S) * DAY_S


class PostgresStore:
    def __init__(self, url: str, *, min_connections: int = 1, max_connections: int = 4,
                 timeout_s: float = 5.0, retention_days: int = 0) -> None:
        self.url = url
        self.min_connections = min_connections
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.retention_days = retention_days
        self._pool: asyncpg.Pool | None = None
        self._partitions: set[int] = set()   # day starts known to exist

    async def _connect(self) -> asyncpg.Pool:
        if self._pool is None:
            try:
                pool = await asyncpg.create_pool(
                    self.url, min_size=self.min_connections, max_size=self.max_connections,
                    timeout=self.timeout_s, command_timeout=30)
                async with pool.acquire() as conn:
                    await conn.execute(_SCHEMA)
            except (OSError, asyncpg.PostgresError, TimeoutError) as e:
                raise StoreUnavailable(f"postgres ledger store: {e}") from e
            self._pool = pool
        return self._pool

    async def open(self) -> None:
        """Create the schema; an unreachable server is not fatal (the journal keeps the records)."""
        try:
            await self._connect()
            if self.retention_days:
                await self.drop_before(time.time() - self.retention_days * DAY_S)
        except StoreUnavailable:
            pass

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def _run(self, method: str, *args: Any) -> Any:
        pool = await self._connect()
        try:
            return await getattr(pool, method)(*args)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as e:
            raise StoreUnavailable(f"postgres ledger store: {e}") from e

    async def mark(self) -> str:
        """This store's identity, made once: a ledger journal replays everything when it changes."""
        await self._run("execute", "INSERT INTO yg_meta VALUES ('epoch', md5(random()::text)) "
                                   "ON CONFLICT DO NOTHING")
        return str(await self._run("fetchval", "SELECT value FROM yg_meta WHERE name = 'epoch'"))

    async def _ensure_partitions(self, days: set[int]) -> None:
        missing = days - self._partitions
        if not missing:
            return
        pool = await self._connect()
        try:
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK)
                for d in sorted(missing):
                    await conn.execute(
                        f"CREATE TABLE IF NOT EXISTS {partition_name(d)} PARTITION OF yg_ledger "
                        f"FOR VALUES FROM ({d}) TO ({d + DAY_S})")
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as e:
            raise StoreUnavailable(f"postgres ledger store: {e}") from e
        self._partitions |= missing

    async def upsert(self, docs: Sequence[bytes]) -> int:
        if not docs:
            return 0
        await self._ensure_partitions({day_start(_TS.decode(d).ts) for d in docs})
        status = await self._run("execute", _INSERT, (b"[" + b",".join(docs) + b"]").decode())
        return int(status.rsplit(" ", 1)[1])  # "INSERT 0 <rows>"

    async def get(self, request_id: str) -> LedgerRecord | None:
        row = await self._run("fetchrow", _SELECT + " WHERE request_id = $1", request_id)
        return None if row is None else LedgerRecord(**dict(row))

    async def count(self) -> int:
        return int(await self._run("fetchval", "SELECT count(*) FROM yg_ledger"))

    async def scan(self, since: float | None = None, until: float | None = None,
                   batch: int = 1000) -> AsyncIterator[list[LedgerRecord]]:
        lo = float("-inf") if since is None else since
        hi = float("inf") if until is None else until
        last_ts, last_id = lo, ""
        while True:
            # Keyset pagination on (ts, request_id): stable while other gateways keep writing.
            rows = await self._run(
                "fetch", _SELECT + " WHERE ts >= $1 AND ts < $2 AND (ts, request_id) > ($3, $4) "
                "ORDER BY ts, request_id LIMIT $5", lo, hi, last_ts, last_id, batch)
            if not rows:
                return
            yield [LedgerRecord(**dict(r)) for r in rows]
            last_ts, last_id = rows[-1]["ts"], rows[-1]["request_id"]

    async def key_spend(self, key_id: str, since: float | None = None,
                        until: float | None = None) -> Decimal:
        total = await self._run(
            "fetchval", "SELECT coalesce(sum(cost_total), 0) FROM yg_ledger "
            "WHERE key_id = $1 AND ts >= $2 AND ts < $3", key_id,
            float("-inf") if since is None else since, float("inf") if until is None else until)
        return Decimal(total)

    async def aggregate_usage(self, group_by: tuple[str, ...], since: float | None, until: float | None,
                              where: dict[str, str]) -> list[UsageRow]:
        """Spend and tokens summed by PostgreSQL (partitions outside [since, until) are not read)."""
        args: list[Any] = [float("-inf") if since is None else since, float("inf") if until is None else until]
        conditions = ["ts >= $1", "ts < $2"]
        for dim, value in where.items():
            args.append(value)
            conditions.append(f"{_DIMENSIONS[dim]} = ${len(args)}")
        dims = [_DIMENSIONS[g] for g in group_by]
        sql = (f"SELECT {', '.join([*dims, _SUMS])} FROM yg_ledger WHERE {' AND '.join(conditions)}"
               + (f" GROUP BY {', '.join(str(i) for i in range(1, len(dims) + 1))}" if dims else ""))
        rows = await self._run("fetch", sql, *args)
        n = len(dims)
        return [UsageRow(group=dict(zip(group_by, r[:n])), requests=r[n], errors=r[n + 1],
                         prompt_tokens=r[n + 2], cached_tokens=r[n + 3], completion_tokens=r[n + 4],
                         cost_uncached_input=Decimal(r[n + 5]), cost_cached_input=Decimal(r[n + 6]),
                         cost_output=Decimal(r[n + 7]), cost_total=Decimal(r[n + 8]))
                for r in rows if r[n]]

    async def put_outcome(self, outcome: Outcome) -> None:
        await self._run(
            "execute", "INSERT INTO yg_outcome VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT "
            "(target, target_id) DO UPDATE SET passed = excluded.passed, score = excluded.score, "
            "ts = excluded.ts, note = excluded.note",
            outcome.target, outcome.target_id, outcome.passed, outcome.score, outcome.ts, outcome.note)

    async def get_outcomes(self, target: OutcomeTarget, ids: Iterable[str]) -> dict[str, Outcome]:
        rows = await self._run(
            "fetch", "SELECT target, target_id, passed, score, ts, note FROM yg_outcome "
            "WHERE target = $1 AND target_id = ANY($2::text[])", target, list(ids))
        return {r["target_id"]: Outcome(**dict(r)) for r in rows}

    # -- retention and size (operators, benchmarks) ---------------------------------------------

    async def partitions(self) -> list[str]:
        rows = await self._run(
            "fetch", "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'yg_ledger'::regclass AND c.relkind = 'r' ORDER BY 1")
        return [r["relname"] for r in rows]

    async def drop_before(self, ts: float) -> list[str]:
        """Drop every partition whose whole day is before ts (retention: no DELETE, no bloat)."""
        cutoff = time.strftime("%Y%m%d", time.gmtime(day_start(ts)))
        dropped = []
        for name in await self.partitions():
            if name.rsplit("_", 1)[1] < cutoff:
                await self._run("execute", f"DROP TABLE IF EXISTS {name}")
                dropped.append(name)
                self._partitions.discard(calendar.timegm(time.strptime(name.rsplit("_", 1)[1], "%Y%m%d")))
        return dropped

    async def bytes_on_disk(self) -> int:
        """Heap, TOAST and indexes of every partition."""
        return int(await self._run(
            "fetchval", "SELECT coalesce(sum(pg_total_relation_size(i.inhrelid)), 0) FROM pg_inherits i "
            "WHERE i.inhparent = 'yg_ledger'::regclass"))
