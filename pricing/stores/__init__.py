"""Ledger store backends: a tiny protocol, one small implementation per backend."""

from .base import LedgerStore
from .postgres_store import PostgresStore
from .redis_store import RedisStore
from .sqlite_store import SQLiteStore

__all__ = ["LedgerStore", "PostgresStore", "RedisStore", "SQLiteStore"]
