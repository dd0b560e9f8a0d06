"""Engine side of the data plane: stage an update into pre-allocated buffers, verify it.

Nothing here touches the live model. The staging area tells a waiting loader which leading
parameters have fully arrived and passed their checksums (`wait_ready`), so the engine can load
them while later chunks still stream; it restores the old weights if a later chunk fails.
"""

from __future__ import annotations

import asyncio
import math
import mmap
import os
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import wire
from .errors import ChecksumMismatch, PushRefused, TransferError


@dataclass(frozen=True)
class ParamLayout:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


_ALIGN = 64  # every staged tensor starts on a cache line
SHM_HEAD = 4096  # a shared arena's first page holds the cookie; staging starts after it


class StagingPool:
    """Registered receive memory, kept between updates (RDMA-style registration).

    The first touch of freshly allocated pages costs more than the transfer itself here
    (382 MB: ~1.2 s of page faults inside recv_into vs ~0.25 s for the bytes), so the engine
    keeps one pre-faulted arena sized to the largest update it has taken and carves every
    update's staging tensors out of it. Memory cost: one copy of the pushed weights per engine.
    """

    def __init__(self, shared: bool = True) -> None:
        # shared: the arena is a memfd a trainer on this host (same user) may write into directly.
        self.shared = shared and hasattr(os, "memfd_create")
        self._arena = torch.empty(0, dtype=torch.uint8)
        self._fd = -1
        self.cookie = b""

    @property
    def nbytes(self) -> int:
        return self._arena.numel()

    @property
    def shm_path(self) -> str | None:
        """Where a same-host trainer opens the arena (its byte 0 is file offset `SHM_HEAD`)."""
        return f"/proc/{os.getpid()}/fd/{self._fd}" if self._fd >= 0 else None

    def reserve(self, nbytes: int) -> torch.Tensor:
        """A byte arena of at least `nbytes`, every page already faulted in."""
        if self._arena.numel() < nbytes:
            self.release()  # free the old one first
            if self.shared:
                self._fd = os.memfd_create("yieldgate-staging")
                os.ftruncate(self._fd, SHM_HEAD + nbytes)
                region = mmap.mmap(self._fd, SHM_HEAD + nbytes)
                self.cookie = os.urandom(wire.COOKIE_BYTES)
                region[: wire.COOKIE_BYTES] = self.cookie
                # The tensor keeps `region` alive (and mapped) for as long as any view of it lives.
                self._arena = torch.frombuffer(region, dtype=torch.uint8, offset=SHM_HEAD, count=nbytes)
            else:
                self._arena = torch.empty(nbytes, dtype=torch.uint8)
            self._arena.zero_()  # fault every page now, not inside the receive loop
        return self._arena

    def release(self) -> None:
        self._arena = torch.empty(0, dtype=torch.uint8)
        if self._fd >= 0:
            os.close(self._fd)  # a trainer still holding it keeps only its own mapping
            self._fd = -1
        self.cookie = b""


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class StagingArea:
    """One pre-allocated buffer per parameter, sized from the metadata exchanged at update time.

    With a `pool`, the buffers are views into its registered arena (valid until the pool's next
    `reserve`); without one, they are freshly allocated."""

    def __init__(self, layout: list[ParamLayout], pool: StagingPool | None = None) -> None:
        self.layout = layout
        sizes = [math.prod(p.shape) * p.dtype.itemsize for p in layout]
        # Same-host trainers may write in place: (cookie, path, each parameter's file offset).
        self.shm_offer: tuple[bytes, str, list[int]] | None = None
        if pool is None:
            self.tensors = [torch.empty(p.shape, dtype=p.dtype) for p in layout]
        else:
            arena = pool.reserve(sum(_aligned(n) for n in sizes))
            self.tensors, offset, offsets = [], 0, []
            for p, n in zip(layout, sizes):
                self.tensors.append(arena[offset : offset + n].view(p.dtype).view(p.shape))
                offsets.append(SHM_HEAD + offset)
                offset += _aligned(n)
            if pool.shm_path is not None:
                self.shm_offer = (pool.cookie, pool.shm_path, offsets)
        self.views = [wire.byte_view(t) for t in self.tensors]
        self.filled = [0] * len(layout)
        # Parameters [0, ready) are complete and verified; empty ones never get a chunk.
        self._verified = [len(v) == 0 for v in self.views]
        self._ready = 0
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._advance()

    @property
    def total_bytes(self) -> int:
        return sum(len(v) for v in self.views)

    def slot(self, param: int, offset: int, length: int) -> memoryview:
        """The buffer slice a chunk writes into; chunks of one parameter must arrive in order,
        which makes "every byte covered exactly once" a counter check."""
        if param >= len(self.views):
            raise TransferError(f"chunk for unknown parameter index {param}")
        view = self.views[param]
        if offset != self.filled[param] or offset + length > len(view):
            raise TransferError(
                f"chunk {self.layout[param].name}@{offset}+{length} out of sequence "
                f"(have {self.filled[param]} of {len(view)} bytes)"
            )
        self.filled[param] += length
        return view[offset : offset + length]

    def missing(self) -> list[str]:
        return [p.name for p, v, f in zip(self.layout, self.views, self.filled) if f != len(v)]

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return [(p.name, t) for p, t in zip(self.layout, self.tensors)]

    def _advance(self) -> None:
        while self._ready < len(self._verified) and self._verified[self._ready]:
            self._ready += 1

    def mark_verified(self, param: int) -> None:
        """Every chunk of `param` arrived and matched its checksum."""
        with self._changed:
            self._verified[param] = True
            self._advance()
            self._changed.notify_all()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def fail(self, exc: BaseException) -> None:
        with self._changed:
            self._error = exc
            self._changed.notify_all()

    def wait_ready(self, have: int, timeout_s: float) -> int:
        """Block until more than `have` leading parameters are verified; -> how many are.
        Raises the receive error, or TransferError if nothing moves for `timeout_s`."""
        with self._changed:
            if not self._changed.wait_for(
                lambda: self._error is not None or self._ready > have, timeout_s
            ):
                raise TransferError(f"no parameter verified for {timeout_s:.0f}s")
            if self._error is not None:
                raise self._error
            return self._ready


class _Verifier(threading.Thread):
    """Checksums chunk k while the socket receives chunk k+1 (both release the GIL)."""

    def __init__(self, algorithm: str, staging: StagingArea) -> None:
        super().__init__(name="yieldgate-verify", daemon=True)
        self.staging = staging
        self.checksum = wire.CHECKSUMS[algorithm]
        self.jobs: queue.SimpleQueue[tuple[int, memoryview, int, bool] | None] = queue.SimpleQueue()
        self.error: ChecksumMismatch | None = None

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            param, view, expected, last = job
            if self.error is not None:
                continue
            if self.checksum(view) != expected:
                self.error = ChecksumMismatch(
                    f"checksum mismatch in a chunk of {self.staging.layout[param].name}")
                self.staging.fail(self.error)  # a loader waiting on this parameter stops now
            elif last:
                self.staging.mark_verified(param)


def receive_update(
    sender: str,
    session: bytes,
    token: str,
    staging: StagingArea,
    checksum: str,
    timeout_s: float,
    on_socket: Callable[[socket.socket], None] | None = None,
) -> None:
    """Connect to the trainer's sender, stream every chunk into `staging`, verify all of it.

    Raises PushRefused / ChecksumMismatch / TransferError (and fails `staging` with it, waking a
    loader in `wait_ready`); on success `staging` is complete and every parameter is ready.
    `on_socket` receives the connected socket (shutting it down cancels the transfer).
    """
    if checksum not in wire.CHECKSUMS:
        raise TransferError(f"unsupported checksum {checksum!r}")
    host, _, port = sender.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if on_socket is not None:
        on_socket(sock)
    verifier = _Verifier(checksum, staging)
    verifier.start()
    try:
        offer = staging.shm_offer
        if offer is None:
            sock.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, session))
        else:
            sock.sendall(wire.HELLO.pack(wire.SHM_HELLO_MAGIC, session) + wire.pack_shm_offer(*offer))
        header = memoryview(bytearray(wire.CHUNK_HEADER.size))
        while True:
            wire.recv_exact(sock, header)
            chunk = _next_chunk(token, session, header, staging, in_place_ok=offer is not None)
            if chunk is None:
                break
            param, slot, expected, in_place = chunk
            if not in_place:
                wire.recv_exact(sock, slot)
            last = staging.filled[param] == len(staging.views[param])
            verifier.jobs.put((param, slot, expected, last))
            if verifier.error is not None:
                raise verifier.error
        verifier.jobs.put(None)
        verifier.join()
        if verifier.error is not None:
            raise verifier.error
        if missing := staging.missing():
            raise TransferError(f"{len(missing)} parameter(s) incomplete, e.g. {missing[0]}")
        wire.send_status(sock, True)
    except Exception as exc:
        staging.fail(exc)
        try:
            wire.send_status(sock, False, f"{type(exc).__name__}: {exc}")
        except OSError:
            pass
        raise
    finally:
        verifier.jobs.put(None)
        sock.close()


def _next_chunk(token: str, session: bytes, header: memoryview, staging: StagingArea,
                in_place_ok: bool = False) -> tuple[int, memoryview, int, bool] | None:
    """A received chunk header -> (param, the staging slot its bytes go to, expected checksum,
    bytes already in place), or None at the end marker. Refuses unsigned chunks, a short
    stream, and in-place chunks where no shared memory was offered."""
    param, offset, length, expected, authentic, in_place = wire.unpack_chunk_header(
        token, session, bytes(header))
    if not authentic:
        raise PushRefused("chunk without a valid push token")
    if param == wire.END_PARAM:
        if offset != staging.total_bytes:
            raise TransferError(f"sender sent {offset} bytes, expected {staging.total_bytes}")
        return None
    if in_place and not in_place_ok:
        raise TransferError("in-place chunk, but no shared memory was offered")
    return param, staging.slot(param, offset, length), expected, in_place


async def receive_update_async(
    sender: str, session: bytes, token: str, staging: StagingArea, checksum: str, timeout_s: float
) -> None:
    """`receive_update` for a process whose event loop is busy serving (the gateway).

    A receive thread there waits for the GIL at every chunk while the loop holds it: 1.1 MB of
    ~20 tensors took 0.8 s under load. In the loop, a chunk already sitting in the socket
    buffer is read without a wait, and checksummed inline (xxh3: ~1 ms per 8 MB chunk)."""
    if checksum not in wire.CHECKSUMS:
        raise TransferError(f"unsupported checksum {checksum!r}")
    verify = wire.CHECKSUMS[checksum]
    loop = asyncio.get_running_loop()
    host, _, port = sender.rpartition(":")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)

    async def fill(view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = await loop.sock_recv_into(sock, view[got:])
            if n == 0:
                raise TransferError("peer closed the connection mid-frame")
            got += n

    try:
        async with asyncio.timeout(timeout_s):
            await loop.sock_connect(sock, (host.strip("[]"), int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_sendall(sock, wire.HELLO.pack(wire.HELLO_MAGIC, session))
        header = memoryview(bytearray(wire.CHUNK_HEADER.size))
        try:
            while True:
                async with asyncio.timeout(timeout_s):  # an idle timeout, as the socket one
                    await fill(header)
                chunk = _next_chunk(token, session, header, staging)
                if chunk is None:
                    break
                param, slot, expected, _ = chunk  # nothing offered: never in place
                async with asyncio.timeout(timeout_s):
                    await fill(slot)
                if verify(slot) != expected:
                    raise ChecksumMismatch(f"checksum mismatch in a chunk of {staging.layout[param].name}")
            if missing := staging.missing():
                raise TransferError(f"{len(missing)} parameter(s) incomplete, e.g. {missing[0]}")
            await loop.sock_sendall(sock, wire.STATUS_OK)
        except TimeoutError:
            raise TransferError(f"stream idle for {timeout_s:.0f}s") from None
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}".encode()[:4000]
            try:
                await loop.sock_sendall(sock, wire.STATUS_NO + len(reason).to_bytes(4, "little") + reason)
            except OSError:
                pass
            raise
    finally:
        sock.close()
