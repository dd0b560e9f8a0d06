"""Journal: the local append-only file that makes Ledger.record() durable without a network wait.

One record = one JSON line written with a single os.write on an O_APPEND fd, so once record()
returns the bytes belong to the kernel and survive a SIGKILL of the gateway. A checkpoint file
holds the byte offset up to which the store has confirmed the records: one fixed-width pwrite per
commit on a file kept open (a torn or unreadable checkpoint reads as 0, and replaying from 0 is safe).
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

import msgspec

from .errors import LedgerError
from .record import RECORD_KEYS

log = logging.getLogger(__name__)


class Journal:
    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory).expanduser()
        self.path = self.dir / "journal.jsonl"
        self.checkpoint_path = self.dir / "journal.checkpoint"
        self.store_mark_path = self.dir / "journal.store"  # the mark of the store checkpointed against
        self._fd = -1
        self._rfd = -1
        self._cfd = -1
        self.size = 0        # bytes appended so far (file size)
        self.committed = 0   # bytes confirmed by the store
        self.bad_lines = 0

    def open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            # Two ledgers appending to one journal would checkpoint each other's records away.
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = -1
            raise LedgerError(f"journal {self.path} is in use by another process") from None
        self._rfd = os.open(self.path, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size
        if self.size and os.pread(self._rfd, 1, self.size - 1) != b"\n":
            # A torn tail (power loss mid-write): terminate it so it stays one bad line on its own.
            self.append(b"\n")
        self._cfd = os.open(self.checkpoint_path, os.O_RDWR | os.O_CREAT, 0o600)
        self.committed = self._read_checkpoint()

    def _read_checkpoint(self) -> int:
        try:
            value = int(os.pread(self._cfd, 64, 0).strip() or 0)
        except ValueError:
            return 0  # replaying from 0 is safe: store upserts are idempotent by request_id
        return value if 0 <= value <= self.size else 0

    def append(self, data: bytes) -> None:
        n = os.write(self._fd, data)
        if n != len(data):  # regular files only short-write on ENOSPC-like conditions
            os.write(self._fd, data[n:])
        self.size += len(data)

    @property
    def pending_bytes(self) -> int:
        return self.size - self.committed

    def read_batch(self, max_records: int, max_bytes: int = 4 << 20) -> tuple[list[bytes], int]:
        """Records after the checkpoint (at most max_records), each as its JSON line without the
        newline, and the offset just past them. Lines whose record keys do not decode are skipped."""
        start = self.committed
        chunk = os.pread(self._rfd, min(max_bytes, self.size - start), start)
        records: list[bytes] = []
        pos = 0
        while len(records) < max_records:
            nl = chunk.find(b"\n", pos)
            if nl < 0:
                break
            line = chunk[pos:nl]
            pos = nl + 1
            if not line:
                continue
            try:
                RECORD_KEYS.decode(line)  # a torn or foreign line is not valid JSON
            except msgspec.DecodeError:
                self.bad_lines += 1
                log.error("ledger journal %s: skipping undecodable line at byte %d", self.path, start + pos)
                continue
            records.append(line)
        return records, start + pos

    def commit(self, offset: int, compact_bytes: int) -> None:
        """Mark bytes up to offset as stored; truncate the journal when everything is stored."""
        if offset == self.size and self.size >= compact_bytes:
            # Runs synchronously on the event loop thread, so no record() can interleave.
            os.ftruncate(self._fd, 0)
            self.size = offset = 0
        # Fixed width, so a smaller offset overwrites every digit of a larger one. One syscall on the
        # event loop instead of a temp file, a write and a rename (which could block for milliseconds).
        os.pwrite(self._cfd, b"%020d\n" % offset, 0)
        self.committed = offset

    def rewind(self) -> None:
        """Forget the checkpoint: every record still in the journal is shipped again (the store
        lost what it had confirmed; its upserts are idempotent, so records it kept are not doubled)."""
        os.pwrite(self._cfd, b"%020d\n" % 0, 0)
        self.committed = 0

    def store_mark(self) -> str:
        try:
            return self.store_mark_path.read_text().strip()
        except FileNotFoundError:
            return ""

    def set_store_mark(self, mark: str) -> None:
        if mark != self.store_mark():
            tmp = self.store_mark_path.with_suffix(".tmp")
            tmp.write_text(mark + "\n")
            os.replace(tmp, self.store_mark_path)

    def close(self) -> None:
        for fd in (self._fd, self._rfd, self._cfd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._rfd = self._cfd = -1
