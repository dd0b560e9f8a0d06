"""vLLM's KV-cache events (``--kv-events-config`` zmq publisher): the gateway's subscriber, and a
publisher of the same wire format for emulated engines (serving/emulator.py).

Wire format (vllm/distributed/kv_events.py): ZMQ PUB multipart
``[topic, seq (8-byte big-endian), payload]``; payload is msgpack of
``EventBatch`` = ``[ts, [event, ...], dp_rank]``; each event is a map tagged
``{"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared", ...}``.
The structs below decode only the fields routing needs (others are ignored).

Resync rules: a sequence number going *backwards* means the engine restarted
(its cache is empty), so the replica's blocks are cleared. A *gap* means we
missed events (PUB drops when we lag or reconnect); the publisher's optional
ROUTER replay endpoint is asked for the missing batches, and if it has none the
replica is cleared, because a missed BlockRemoved would otherwise leave the index
claiming blocks the engine has evicted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from .blocks import BlockHash

log = logging.getLogger(__name__)


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[int | bytes]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _batch_decoder.decode(payload)


class _PublishedBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """vLLM's EventBatch as its publisher encodes it: no data-parallel rank when there is none."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_batch_encoder = msgspec.msgpack.Encoder()


class KVEventPublisher:
    """Publishes KV events as vLLM's ZmqEventPublisher does: a PUB socket bound at `endpoint`,
    multipart ``[topic, seq, payload]``; the events of one event-loop turn go out as one batch
    (vLLM sends one batch per engine step). For emulated engines; the gateway only subscribes.

    >>> pub = KVEventPublisher("tcp://127.0.14.1:5557")
    >>> pub.add(BlockStored(block_hashes=[h1, h2], parent_block_hash=None, token_ids=ids, block_size=32))
    """

    def __init__(self, endpoint: str, topic: str = "kv-events", context: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self.topic = topic.encode()
        self._sock = (context or zmq.Context.instance()).socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.bind(endpoint)
        self.seq = -1
        self._pending: list[KVEvent] = []

    def add(self, event: KVEvent) -> None:
        """Queue `event`; the batch is sent when the running event loop next gets a turn."""
        if not self._pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self._pending.append(event)

    def flush(self) -> None:
        if not self._pending:
            return
        events, self._pending = self._pending, []
        self.seq += 1
        payload = _batch_encoder.encode(_PublishedBatch(ts=time.time(), events=events))
        try:  # PUB never blocks: a subscriber that lags loses batches (and sees the gap)
            self._sock.send_multipart((self.topic, self.seq.to_bytes(8, "big", signed=True), payload), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        self._sock.close(linger=0)


class BlockSink(Protocol):
    """What the subscriber writes to (PrefixIndex and SharedPrefixIndex)."""

    def store(self, replica: str, block_hashes: list[BlockHash]) -> None: ...
    def remove(self, replica: str, block_hashes: list[BlockHash]) -> None: ...
    def clear(self, replica: str) -> None: ...


class KVEventSubscriberConfig(msgspec.Struct, frozen=True):
    topic: str = "kv-events"
    # vLLM's replay ROUTER ("replay_endpoint" in --kv-events-config), if enabled.
    replay_endpoint: str | None = None
    # Only GPU-tier (device) blocks serve prefix hits; CPU offload tiers are skipped.
    media: tuple[str, ...] = ("GPU",)
    reconnect_delay_s: float = 1.0
    replay_timeout_s: float = 2.0


class KVEventSubscriber:
    """Feeds one engine's KV events into an index under the replica's name.

    >>> sub = KVEventSubscriber("standard-0", "tcp://127.0.0.1:5557", index)
    >>> sub.start()            # asyncio task; `await sub.stop()` at shutdown
    """

    def __init__(self, replica: str, endpoint: str, index: BlockSink,
                 config: KVEventSubscriberConfig = KVEventSubscriberConfig(),
                 context: zmq.asyncio.Context | None = None) -> None:
        self.replica = replica
        self.endpoint = endpoint
        self.index = index
        self.config = config
        self._ctx = context or zmq.asyncio.Context.instance()
        self._task: asyncio.Task | None = None
        self.last_seq: int | None = None
        self.batches = 0
        self.events = 0
        self.gaps = 0
        self.restarts = 0
        self.replayed = 0
        self.connected = asyncio.Event()

    def start(self) -> asyncio.Task:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name=f"kv-events-{self.replica}")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def run(self) -> None:
        topic = self.config.topic.encode()
        while True:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, topic)
            # ZMQ reconnects by itself; heartbeats notice a dead peer on a silent link.
            sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
            try:
                sock.connect(self.endpoint)
                self.connected.set()
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) != 3:
                        continue
                    await self._on_message(int.from_bytes(frames[1], "big", signed=True), frames[2])
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("kv events %s: subscriber error; reconnecting", self.replica)
                await asyncio.sleep(self.config.reconnect_delay_s)
            finally:
                self.connected.clear()
                sock.close(linger=0)

    async def _on_message(self, seq: int, payload: bytes) -> None:
        last = self.last_seq
        if last is not None and seq <= last:
            # Sequence restarted: a new engine process with an empty cache.
            self.restarts += 1
            self.index.clear(self.replica)
        elif last is not None and seq > last + 1:
            self.gaps += 1
            if not await self._replay(last + 1, seq):
                self.index.clear(self.replica)
        self.apply(decode_batch(payload))
        self.last_seq = seq

    def apply(self, batch: KVEventBatch) -> None:
        media = self.config.media
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.medium is None or event.medium in media:
                    self.index.store(self.replica, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                if event.medium is None or event.medium in media:
                    self.index.remove(self.replica, event.block_hashes)
            else:
                self.index.clear(self.replica)
            self.events += 1
        self.batches += 1

    async def _replay(self, start: int, stop: int) -> bool:
        """Fetch batches [start, stop) from the publisher's replay buffer."""
        if not self.config.replay_endpoint:
            return False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.config.replay_endpoint)
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            got: set[int] = set()
            while True:
                frames: Any = await asyncio.wait_for(sock.recv_multipart(), self.config.replay_timeout_s)
                if len(frames) < 4:
                    break
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq < 0:  # END_SEQ
                    break
                if start <= seq < stop:
                    self.apply(decode_batch(frames[3]))
                    got.add(seq)
            self.replayed += len(got)
            return len(got) == stop - start
        except (asyncio.TimeoutError, zmq.ZMQError):
            return False
        finally:
            sock.close(linger=0)
