"""Trainer-bridge settings, one typed object (the lead composes it into the yieldgate TOML)."""

from __future__ import annotations

import msgspec

from .wire import DEFAULT_CHUNK_BYTES, default_checksum


class BridgeConfig(msgspec.Struct, kw_only=True):
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    checksum: str = msgspec.field(default_factory=default_checksum)  # "xxh3" | "crc32" | "xxh32"
    bind_host: str = "127.0.0.1"  # where the trainer's chunk server listens
    advertise_host: str | None = None  # address engines dial, if different from bind_host
    connect_timeout_s: float = 60.0  # engine must dial the chunk server within this
    stream_timeout_s: float = 120.0  # engine-side socket idle timeout
    http_timeout_s: float = 600.0  # control-plane calls (update_weights blocks for the transfer)
    checkpoint_root: str | None = None  # versions kept on disk for rollback; None = YIELDGATE_HOME
    keep_versions: int = 3
    drain_timeout_s: float = 60.0
    verify_timeout_s: float = 60.0
    # Load each tensor as soon as it is verified (True) or only once the whole stream is (False).
    # Overlap needs a free core: on 2 cores the stream alone keeps both busy (see the benchmark).
    pipeline_load: bool = True
    # Same host and user as the engine: write chunks straight into its staging memory (memfd)
    # and send only their signed headers; checksums are verified in place as over TCP.
    shared_memory: bool = True
