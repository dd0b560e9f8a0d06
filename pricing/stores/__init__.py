"""Ledger store backends: a tiny protocol, one small implementation per backend."""

from .base import LedgerStore
from .redis_store import RedisStore
from .sqlite_store import SQLiteStore

__all__ = ["LedgerStore", "RedisStore", "SQLiteStore"]
