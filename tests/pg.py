"""PostgreSQL for tests: a database of the test's own on the shared server, dropped afterwards.

YIELDGATE_TEST_POSTGRES names the server (default: 127.0.0.1:5432, user postgres, trust auth) and
YIELDGATE_TEST_PG_PREFIX the databases' name prefix, so two suites on one machine never share one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from needs import missing

SERVER = os.environ.get("YIELDGATE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432")
PREFIX = os.environ.get("YIELDGATE_TEST_PG_PREFIX", "yg_test")


def run_sql(url: str, *statements: str) -> None:
    """Statements outside a transaction (CREATE/DROP DATABASE), on a loop of their own (callers
    may be inside the test's event loop)."""
    import asyncpg

    async def go() -> None:
        conn = await asyncpg.connect(url, timeout=10)
        try:
            for s in statements:
                await conn.execute(s)
        finally:
            await conn.close()

    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, go()).result()


@contextlib.contextmanager
def temp_database(server: str = SERVER) -> Iterator[str]:
    """A new, empty database; yields its URL."""
    name = f"{PREFIX}_{secrets.token_hex(5)}"
    try:
        run_sql(server + "/postgres", f'CREATE DATABASE "{name}"')
    except OSError as exc:
        missing(f"PostgreSQL unreachable at {server}: {exc}")
    try:
        yield f"{server}/{name}"
    finally:
        run_sql(server + "/postgres", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
