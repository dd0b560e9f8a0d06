"""Where API keys are kept for good: the KeyRecord protocol and its PostgreSQL implementation.

Redis holds keys as a cache (KeyStore reads it first and fills it from the record on a miss), so
a Redis that lost its data loses no key. A key's secret is stored only as its HMAC; its budget
(amount, kind, period) and limits live on the key's row, the spend against it in the ledger.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import asyncpg

from .errors import StoreUnavailable
from .keys import ApiKey, KeyRecord  # noqa: F401 (KeyRecord: the protocol this implements)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS yg_team (name text PRIMARY KEY, created_at float8 NOT NULL);
CREATE TABLE IF NOT EXISTS yg_api_key (
    id text PRIMARY KEY,
    team text NOT NULL DEFAULT '',
    name text NOT NULL DEFAULT '',
    secret_hmac text NOT NULL,
    budget_usd numeric,
    budget_kind text NOT NULL DEFAULT 'hard',
    budget_period text NOT NULL DEFAULT 'monthly',
    rpm int4, tpm int4,
    created_at float8 NOT NULL,
    revoked bool NOT NULL DEFAULT false
);
CREATE INDEX IF NOT EXISTS yg_api_key_team ON yg_api_key (team);
"""
_FIELDS = ("id", "team", "name", "budget_usd", "budget_kind", "budget_period", "rpm", "tpm",
           "created_at", "revoked")
_ERRORS = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError)


def _key(row: Any) -> tuple[ApiKey, str]:
    fields = {f: row[f] for f in _FIELDS}
    if fields["budget_usd"] is not None:
        fields["budget_usd"] = Decimal(fields["budget_usd"])
    return ApiKey(**fields), row["secret_hmac"]


class PostgresKeyRecord:
    def __init__(self, url: str, *, max_connections: int = 2, timeout_s: float = 5.0) -> None:
        self.url = url
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self._pool: asyncpg.Pool | None = None

    async def _connect(self) -> asyncpg.Pool:
        if self._pool is None:
            try:
                pool = await asyncpg.create_pool(self.url, min_size=1, max_size=self.max_connections,
                                                 timeout=self.timeout_s, command_timeout=10)
                async with pool.acquire() as conn:
                    await conn.execute(_SCHEMA)
            except _ERRORS as e:
                raise StoreUnavailable(f"postgres key record: {e}") from e
            self._pool = pool
        return self._pool

    async def _run(self, method: str, *args: Any) -> Any:
        pool = await self._connect()
        try:
            return await getattr(pool, method)(*args)
        except _ERRORS as e:
            raise StoreUnavailable(f"postgres key record: {e}") from e

    async def open(self) -> None:
        try:
            await self._connect()
        except StoreUnavailable:
            pass  # keys cached in Redis keep being served; writes wait for the record

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def put(self, key: ApiKey, secret_hmac: str | None = None) -> None:
        pool = await self._connect()
        try:
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("INSERT INTO yg_team VALUES ($1, $2) ON CONFLICT DO NOTHING",
                                   key.team, key.created_at)
                await conn.execute(
                    "INSERT INTO yg_api_key (id, team, name, secret_hmac, budget_usd, budget_kind, "
                    "budget_period, rpm, tpm, created_at, revoked) VALUES "
                    "($1, $2, $3, coalesce($4, ''), $5, $6, $7, $8, $9, $10, $11) ON CONFLICT (id) DO UPDATE SET "
                    "team = excluded.team, name = excluded.name, budget_usd = excluded.budget_usd, "
                    "budget_kind = excluded.budget_kind, budget_period = excluded.budget_period, "
                    "rpm = excluded.rpm, tpm = excluded.tpm, revoked = excluded.revoked, "
                    "secret_hmac = coalesce($4, yg_api_key.secret_hmac)",
                    key.id, key.team, key.name, secret_hmac, key.budget_usd, key.budget_kind,
                    key.budget_period, key.rpm, key.tpm, key.created_at, key.revoked)
        except _ERRORS as e:
            raise StoreUnavailable(f"postgres key record: {e}") from e

    async def get(self, key_id: str) -> tuple[ApiKey, str] | None:
        row = await self._run("fetchrow", "SELECT * FROM yg_api_key WHERE id = $1", key_id)
        return None if row is None else _key(row)

    async def all(self, team: str | None = None) -> list[tuple[ApiKey, str]]:
        if team is None:
            rows = await self._run("fetch", "SELECT * FROM yg_api_key ORDER BY id")
        else:
            rows = await self._run("fetch", "SELECT * FROM yg_api_key WHERE team = $1 ORDER BY id", team)
        return [_key(r) for r in rows]
