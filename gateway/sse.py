"""Server-sent-event framing for pass-through streaming.

The gateway forwards upstream bytes as they come; it only needs to know where events end so that it
can hold back and rewrite the one event that carries `usage`. Everything else is forwarded as-is.
"""

from __future__ import annotations

from typing import Iterator

EVENT_END = b"\n\n"
DONE = b"data: [DONE]\n\n"


class EventSplitter:
    """Feed raw bytes; get back complete events (each ending in a blank line)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> bytes:
        """Return the complete events contained in buf+data, keeping a partial tail."""
        buf = self._buf + data if self._buf else data
        end = buf.rfind(EVENT_END)
        if end < 0:
            self._buf = buf
            return b""
        self._buf = buf[end + 2:]
        return buf[: end + 2]

    def rest(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest


def events(block: bytes) -> Iterator[bytes]:
    """Split a block of complete events into single events (without the trailing blank line)."""
    for event in block.split(EVENT_END):
        if event:
            yield event


def data_event(payload: bytes) -> bytes:
    return b"data: " + payload + EVENT_END
