"""Concurrent-stream limits: how many streams one API key (or one anonymous client) may hold open.

A stream holds an engine slot for as long as the client keeps reading, so a single key must not be
able to occupy a whole tier. Counting is in-process: each gateway enforces its own share.
"""

from __future__ import annotations

from yieldgate.pricing import ApiKey

from .errors import TooManyRequests


def stream_owner(key: ApiKey | None, client_host: str | None) -> str:
    """Who a stream counts against: the API key if there is one, else the client address."""
    if key is not None:
        return f"key:{key.id}"
    return f"ip:{client_host or 'unknown'}"


class StreamLease:
    """One open stream; releasing it twice is harmless (error paths and the relay may both try)."""

    __slots__ = ("_limiter", "owner", "_held")

    def __init__(self, limiter: "StreamLimiter", owner: str):
        self._limiter = limiter
        self.owner = owner
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limiter._release(self.owner)


class StreamLimiter:
    def __init__(self, per_owner: int):
        self.per_owner = per_owner
        self._open: dict[str, int] = {}

    def open_streams(self, owner: str) -> int:
        return self._open.get(owner, 0)

    def acquire(self, owner: str) -> StreamLease:
        """Take a stream slot or raise TooManyRequests (429); per_owner <= 0 disables the limit."""
        held = self._open.get(owner, 0)
        if self.per_owner > 0 and held >= self.per_owner:
            raise TooManyRequests(
                f"Too many concurrent streams: at most {self.per_owner} per API key. "
                "Close a stream or retry later.",
                code="too_many_streams", headers={"retry-after": "1"})
        self._open[owner] = held + 1
        return StreamLease(self, owner)

    def _release(self, owner: str) -> None:
        left = self._open.get(owner, 0) - 1
        if left > 0:
            self._open[owner] = left
        else:
            self._open.pop(owner, None)
