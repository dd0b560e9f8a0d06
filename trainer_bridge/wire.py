"""The data-plane framing shared by the sender (trainer) and the receiver (engine worker).

Shaped like an RDMA one-sided write: chunk headers name a parameter, an offset, a length, a
checksum and an authentication tag, and the receiver reads each payload straight into that
parameter's staging buffer. The messages, and the same-host memfd offer: docs/weights.md#wire-framing.
"""
from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import zlib
from collections.abc import Callable

import torch

from .errors import TransferError

HELLO_MAGIC = b"YGH1"
SHM_HELLO_MAGIC = b"YGH2"
CHUNK_MAGIC = b"YGC1"
SHM_CHUNK_MAGIC = b"YGS1"  # payload already written into the receiver's shared staging memory
COOKIE_BYTES = 16
STATUS_OK = b"YGOK"
STATUS_NO = b"YGNO"
SESSION_BYTES = 16
TAG_BYTES = 16
END_PARAM = 0xFFFFFFFF

# magic, param index, byte offset in param, payload length, checksum, tag
CHUNK_HEADER = struct.Struct(f"<4sIQII{TAG_BYTES}s")
_SIGNED = struct.Struct("<4sIQII")  # the part of the header the tag covers
HELLO = struct.Struct(f"<4s{SESSION_BYTES}s")

DEFAULT_CHUNK_BYTES = 8 << 20


def _crc32(data: memoryview) -> int:
    # zlib releases the GIL on large buffers, so verification overlaps the next recv.
    return zlib.crc32(data) & 0xFFFFFFFF


def _xxh32(data: memoryview) -> int:
    import xxhash  # optional dependency, only when the sender asked for it

    return xxhash.xxh32_intdigest(data)


def _xxh3(data: memoryview) -> int:
    import xxhash

    # The header has 32 bits for the checksum; xxh3 is ~7x faster than zlib's crc32 here.
    return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF


CHECKSUMS: dict[str, Callable[[memoryview], int]] = {"crc32": _crc32, "xxh32": _xxh32, "xxh3": _xxh3}


def default_checksum() -> str:
    """xxh3 when the xxhash package is installed (trainer and engines share the venv), else crc32."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "crc32"
    return "xxh3"


def chunk_tag(token: str, session: bytes, signed: bytes) -> bytes:
    """Keyed BLAKE2b over session + header fields: a chunk is only accepted from a sender that
    holds the push token, and a captured chunk cannot be replayed into another session."""
    key = hashlib.sha256(token.encode()).digest()
    return hashlib.blake2b(session + signed, key=key, digest_size=TAG_BYTES).digest()


def pack_chunk_header(
    token: str, session: bytes, param: int, offset: int, length: int, checksum: int,
    in_place: bool = False,
) -> bytes:
    signed = _SIGNED.pack(SHM_CHUNK_MAGIC if in_place else CHUNK_MAGIC, param, offset, length, checksum)
    return signed + chunk_tag(token, session, signed)


def unpack_chunk_header(
    token: str, session: bytes, header: bytes
) -> tuple[int, int, int, int, bool, bool]:
    """-> (param, offset, length, checksum, authentic, in_place)."""
    magic, param, offset, length, checksum, tag = CHUNK_HEADER.unpack(header)
    if magic not in (CHUNK_MAGIC, SHM_CHUNK_MAGIC):
        raise TransferError(f"bad chunk magic {magic!r}")
    signed = header[: _SIGNED.size]
    authentic = hmac.compare_digest(tag, chunk_tag(token, session, signed))
    return param, offset, length, checksum, authentic, magic == SHM_CHUNK_MAGIC


def pack_shm_offer(cookie: bytes, path: str, offsets: list[int]) -> bytes:
    raw = path.encode()
    return (cookie + struct.pack("<I", len(raw)) + raw + struct.pack("<I", len(offsets))
            + struct.pack(f"<{len(offsets)}Q", *offsets))


def recv_shm_offer(sock: socket.socket) -> tuple[bytes, str, list[int]]:
    cookie = recv_bytes(sock, COOKIE_BYTES)
    (n,) = struct.unpack("<I", recv_bytes(sock, 4))
    if n > 4096:
        raise TransferError("shared-memory path too long")
    path = recv_bytes(sock, n).decode()
    (count,) = struct.unpack("<I", recv_bytes(sock, 4))
    if count > 1 << 20:
        raise TransferError("too many parameters in the shared-memory offer")
    return cookie, path, list(struct.unpack(f"<{count}Q", recv_bytes(sock, 8 * count)))


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` completely from the socket (recv_into writes straight into the buffer)."""
    got = 0
    total = len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise TransferError("peer closed the connection mid-frame")
        got += n


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def send_status(sock: socket.socket, ok: bool, reason: str = "") -> None:
    if ok:
        sock.sendall(STATUS_OK)
    else:
        data = reason.encode()[:4000]
        sock.sendall(STATUS_NO + struct.pack("<I", len(data)) + data)


def recv_status(sock: socket.socket) -> tuple[bool, str]:
    magic = recv_bytes(sock, 4)
    if magic == STATUS_OK:
        return True, ""
    if magic == STATUS_NO:
        (n,) = struct.unpack("<I", recv_bytes(sock, 4))
        return False, recv_bytes(sock, n).decode(errors="replace")
    raise TransferError(f"bad status magic {magic!r}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, any dtype (bf16 has no numpy twin, uint8 does)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
