"""Incremental Server-Sent Events decoder (bytes in, events out), tolerant of how servers split them."""

from __future__ import annotations

from typing import NamedTuple


class SSEEvent(NamedTuple):
    event: str  # "message" unless the server named it (e.g. "error")
    data: bytes


class SSEDecoder:
    """Feed raw chunks as they arrive; get complete events back.

    Handles CRLF/LF, events split across TCP reads, multi-line `data:` fields, comments
    (`: keep-alive`) and a final event without its blank line (call `flush`).
    """

    __slots__ = ("_buf", "_data", "_event")

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []
        self._event = b""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        buf = self._buf + chunk if self._buf else chunk
        events: list[SSEEvent] = []
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            self._line(line, events)
        self._buf = buf[start:]
        return events

    def flush(self) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        if self._buf:
            line, self._buf = self._buf.rstrip(b"\r"), b""
            self._line(line, events)
        self._line(b"", events)
        return events

    def _line(self, line: bytes, events: list[SSEEvent]) -> None:
        if not line:
            if self._data:
                events.append(SSEEvent((self._event or b"message").decode(), b"\n".join(self._data)))
            self._data = []
            self._event = b""
            return
        if line[0:1] == b":":
            return
        field, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if field == b"data":
            self._data.append(value)
        elif field == b"event":
            self._event = value
