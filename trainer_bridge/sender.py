"""Trainer side of the data plane: serialize each chunk once, stream it to every engine.

Three stages overlap: a producer thread materializes tensors (device/dtype conversion) and
checksums fixed-size chunks; one writer thread per engine sends them; the engines receive
straight into staging buffers and verify. Each writer's queue holds two chunks (double
buffering), so sender memory is bounded by the chunk size, not the model size.
"""

from __future__ import annotations

import mmap
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from . import wire
from .errors import ChecksumMismatch, PushRefused, TransferError
from .weights import WeightSet

_QUEUE_DEPTH = 2
_SOCK_BUF = 8 << 20


@dataclass
class StreamTarget:
    """One engine receiving the stream. `corrupt_chunk` flips a byte in that chunk, sent after
    `corrupt_delay_s` (tests)."""

    token: str
    session: bytes = field(default_factory=lambda: os.urandom(wire.SESSION_BYTES))
    corrupt_chunk: int | None = None
    corrupt_delay_s: float = 0.0
    bytes_sent: int = 0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    transport: str = ""  # "shm" (wrote into the engine's staging memory) | "tcp"
    _queue: queue.Queue = field(default_factory=lambda: queue.Queue(_QUEUE_DEPTH))
    _conn: socket.socket | None = None
    _connected: threading.Event = field(default_factory=threading.Event)
    _shm: tuple[memoryview, list[int]] | None = None  # the engine's staging memory, param offsets

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.done.set()
        self._connected.set()


def _classify(reason: str) -> Exception:
    if reason.startswith("PushRefused"):
        return PushRefused(reason)
    if reason.startswith("ChecksumMismatch"):
        return ChecksumMismatch(reason)
    return TransferError(reason)


class ChunkSender:
    """A listening chunk server; engines dial `address` and identify by their session nonce."""

    def __init__(
        self,
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES,
        checksum: str = "crc32",
        connect_timeout_s: float = 60.0,
        shared_memory: bool = True,
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.shared_memory = shared_memory
        self.checksum = checksum
        self.connect_timeout_s = connect_timeout_s
        self._listener = socket.create_server((bind_host, 0))
        self._listener.settimeout(0.2)
        self.address = f"{advertise_host or bind_host}:{self._listener.getsockname()[1]}"

    def close(self) -> None:
        self._listener.close()

    def __enter__(self) -> ChunkSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update_info(self, weights: WeightSet, target: StreamTarget, timeout_s: float) -> dict:
        return {
            **weights.metadata(),
            "sender": self.address,
            "session": target.session.hex(),
            "checksum": self.checksum,
            "timeout_s": timeout_s,
        }

    def stream(
        self,
        weights: WeightSet,
        targets: list[StreamTarget],
        on_progress: Callable[[int], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """Send `weights` to every target; per-target failures land in `target.error`.

        Returns when every target finished (status received) or failed. `stop` is set by the
        caller when the control plane gave up on every engine (e.g. all HTTP calls failed).
        """
        stop = stop or threading.Event()
        by_session = {t.session: t for t in targets}
        acceptor = threading.Thread(target=self._accept, args=(by_session, stop), daemon=True)
        writers = [
            threading.Thread(target=self._write, args=(t, on_progress), daemon=True) for t in targets
        ]
        acceptor.start()
        for w in writers:
            w.start()
        try:
            self._produce(weights, targets)
        finally:
            for w in writers:
                w.join()
            stop.set()
            acceptor.join()

    def _accept(self, by_session: dict[bytes, StreamTarget], stop: threading.Event) -> None:
        import time

        deadline = time.monotonic() + self.connect_timeout_s
        pending = dict(by_session)
        while pending and not stop.is_set():
            for s, t in list(pending.items()):
                if t.done.is_set():
                    pending.pop(s)
            if time.monotonic() > deadline:
                for t in pending.values():
                    t.fail(TransferError("engine never connected to the chunk server"))
                return
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            try:
                conn.settimeout(self.connect_timeout_s)
                magic, session = wire.HELLO.unpack(wire.recv_bytes(conn, wire.HELLO.size))
                offer = wire.recv_shm_offer(conn) if magic == wire.SHM_HELLO_MAGIC else None
            except (OSError, TransferError, ValueError, struct.error):
                conn.close()
                continue
            target = pending.pop(session, None)
            if magic not in (wire.HELLO_MAGIC, wire.SHM_HELLO_MAGIC) or target is None:
                conn.close()  # a stranger, or a replayed session: not ours to feed
                continue
            target._shm = _map_offer(offer) if offer is not None and self.shared_memory else None
            target.transport = "shm" if target._shm is not None else "tcp"
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
            target._conn = conn
            target._connected.set()

    def _produce(self, weights: WeightSet, targets: list[StreamTarget]) -> None:
        checksum = wire.CHECKSUMS[self.checksum]
        seq = 0
        total = 0
        for index, entry in enumerate(weights.entries):
            if all(t.done.is_set() for t in targets):
                return
            tensor = entry.materialize()
            view = wire.byte_view(tensor)
            for offset in range(0, max(len(view), 1), self.chunk_bytes):
                payload = view[offset : offset + self.chunk_bytes]
                if len(payload) == 0:
                    continue
                item = (index, offset, payload, checksum(payload), seq)
                for t in targets:
                    self._put(t, item)
                seq += 1
            total += len(view)
            del tensor
        for t in targets:
            self._put(t, (wire.END_PARAM, total, memoryview(b""), 0, seq))
            self._put(t, None)

    @staticmethod
    def _put(target: StreamTarget, item: object) -> None:
        while not target.done.is_set():
            try:
                target._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _write(self, target: StreamTarget, on_progress: Callable[[int], None] | None) -> None:
        try:
            target._connected.wait()
            if target.done.is_set() or target._conn is None:
                return
            conn = target._conn
            shm = target._shm
            while (item := target._queue.get()) is not None:
                param, offset, payload, crc, seq = item
                in_place = shm is not None and param != wire.END_PARAM
                header = wire.pack_chunk_header(
                    target.token, target.session, param, offset, len(payload), crc, in_place
                )
                if seq == target.corrupt_chunk and len(payload):
                    time.sleep(target.corrupt_delay_s)
                    bad = bytearray(payload)
                    bad[len(bad) // 2] ^= 0xFF  # flipped after the checksum was taken
                    payload = memoryview(bad)
                if in_place:
                    _write_in_place(shm, param, offset, payload)
                    conn.sendall(header)  # the engine reads the bytes where they now are
                else:
                    _send_frame(conn, header, payload)
                if len(payload):
                    target.bytes_sent += len(payload)
                    if on_progress is not None:
                        on_progress(len(payload))
            ok, reason = wire.recv_status(conn)
            if not ok:
                target.fail(_classify(reason))
        except OSError as exc:
            # The engine hung up mid-stream; it usually left a status saying why.
            reason = _try_status(target._conn)
            target.fail(_classify(reason) if reason else TransferError(f"stream broke: {exc}"))
        except Exception as exc:  # noqa: BLE001 - recorded for the caller, never lost
            target.fail(exc)
        finally:
            target.done.set()
            target._shm = None  # unmapped once the last view is gone
            if target._conn is not None:
                target._conn.close()
            while True:  # unblock the producer if it is waiting on this queue
                try:
                    target._queue.get_nowait()
                except queue.Empty:
                    break


# Engine staging memory this process has mapped, by path: kept between pushes like a registered
# RDMA region (a fresh mapping costs a page-table fault per 4 KB page on the first write: ~0.1 s
# for 386 MB). One entry per path; dropped once its engine is gone or re-registered its arena.
_MAPPED: dict[str, memoryview] = {}
_MAPPED_LOCK = threading.Lock()


def _map_offer(offer: tuple[bytes, str, list[int]]) -> tuple[memoryview, list[int]] | None:
    """Map the engine's staging memory if it is reachable from here: same host, same user, and
    the cookie the engine wrote at its start is there (so the path is not another host's
    namesake). -> (its bytes, parameter offsets), or None (stream over the socket instead)."""
    cookie, path, offsets = offer
    with _MAPPED_LOCK:
        for known in [p for p in _MAPPED if not os.path.exists(p)]:
            del _MAPPED[known]  # its engine exited: let its memory go
        region = _MAPPED.get(path)
        if region is not None and bytes(region[: len(cookie)]) == cookie:
            return region, offsets
        _MAPPED.pop(path, None)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            mapped = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        if mapped[: len(cookie)] != cookie:
            mapped.close()
            return None
        _MAPPED[path] = memoryview(mapped)
        return _MAPPED[path], offsets


def _write_in_place(shm: tuple[memoryview, list[int]], param: int, offset: int,
                    payload: memoryview) -> None:
    region, offsets = shm
    if param >= len(offsets):
        raise TransferError(f"no staging offset for parameter index {param}")
    start = offsets[param] + offset
    if start + len(payload) > len(region):
        raise TransferError("chunk beyond the engine's staging memory")
    region[start : start + len(payload)] = payload


def _send_frame(conn: socket.socket, header: bytes, payload: memoryview) -> None:
    """Header and payload in one gathered syscall (no header-sized segment of its own)."""
    sent = conn.sendmsg([header, payload]) if len(payload) else conn.send(header)
    if sent < len(header):
        conn.sendall(header[sent:])
        conn.sendall(payload)
    elif sent < len(header) + len(payload):
        conn.sendall(payload[sent - len(header) :])


def _try_status(conn: socket.socket | None) -> str:
    if conn is None:
        return ""
    try:
        conn.settimeout(2.0)
        ok, reason = wire.recv_status(conn)
        return "" if ok else reason
    except (OSError, TransferError):
        return ""
