"""Waiting in tests for something another process or thread brings about, bounded in count."""

from __future__ import annotations

import time
from typing import Any, Callable


def until(predicate: Callable[[], Any], what: str, attempts: int = 600, pause_s: float = 0.1) -> Any:
    """Poll `predicate` until it is truthy (at most `attempts` times); returns its value."""
    for _ in range(attempts):
        value = predicate()
        if value:
            return value
        time.sleep(pause_s)
    raise AssertionError(f"never happened: {what}")
