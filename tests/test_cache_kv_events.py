"""Gateway block hashes == the engine's, and the index mirrors the engine's KV events.

Against the real standard engine: its ZMQ KV-event publisher announces
BlockStored.block_hashes for a prompt; the gateway computes the same numbers from
its own tokenization, and a KVEventSubscriber-fed PrefixIndex holds them.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from yieldgate.cache import (
    BlockHashConfig, BlockHasher, BlockStored, KVEventSubscriber, PrefixIndex, RouteRequest, Router,
    Tokenizer, decode_batch,
)

# The dev/stack standard engine runs with --block-size 32 and PYTHONHASHSEED=0.
HASH_CONFIG = BlockHashConfig(block_size=32, hash_algo="sha256", hash_seed="0")


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest) -> tuple[str, str, Path]:
    """(engine URL, KV-events endpoint, model dir): `stack` if present, else env vars."""
    try:
        stack = request.getfixturevalue("stack")
    except pytest.FixtureLookupError:
        url = os.environ.get("YIELDGATE_TEST_ENGINE_URL")
        if not url:
            pytest.skip("no engine: no `stack` fixture and YIELDGATE_TEST_ENGINE_URL unset")
        from yieldgate.serving.demo_model import ensure_demo_model
        endpoint = os.environ.get("YIELDGATE_TEST_KV_EVENTS_ENDPOINT", "tcp://127.0.0.1:5557")
        return url.rstrip("/"), endpoint, Path(ensure_demo_model())
    return stack.engines["standard"].rstrip("/"), stack.kv_events_endpoint, Path(stack.model_dir)


def _unique_prompt(n_words: int = 120) -> str:
    # A fresh nonce first, so no earlier request has these blocks cached.
    words = "cache aware routing keeps every shared prefix where its blocks already live".split()
    return f"[{uuid.uuid4().hex}] " + " ".join(words[i % len(words)] for i in range(n_words))


async def _complete(engine_url: str, prompt: str) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{engine_url}/v1/completions",
                             json={"model": "demo", "prompt": prompt, "max_tokens": 1}) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


async def _collect_stored(endpoint: str, until: asyncio.Event, out: list[BlockStored]) -> None:
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sock.connect(endpoint)
    try:
        while not until.is_set():
            if await sock.poll(200):
                _, _, payload = await sock.recv_multipart()
                out.extend(e for e in decode_batch(payload).events if isinstance(e, BlockStored))
    finally:
        sock.close(linger=0)


async def _wait_for(predicate, timeout: float = 20.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _send_until(engine_url: str, n_words: int, seen) -> str:
    """PUB/SUB joins asynchronously, so a first request can go unseen: retry with fresh prompts."""
    for _ in range(5):
        prompt = _unique_prompt(n_words)
        await _complete(engine_url, prompt)
        if await _wait_for(lambda: seen(prompt), 8.0):
            return prompt
    raise AssertionError("engine's KV events never announced our blocks")


async def test_block_hashes_equal_engine_block_stored_events(engine) -> None:
    engine_url, endpoint, model_dir = engine
    tok = Tokenizer.from_model_dir(model_dir)
    hasher = BlockHasher(HASH_CONFIG)
    stored: list[BlockStored] = []
    done = asyncio.Event()
    collector = asyncio.create_task(_collect_stored(endpoint, done, stored))
    announced = lambda: [h for e in stored for h in e.block_hashes]  # noqa: E731
    try:
        prompt = await _send_until(
            engine_url, 120, lambda p: set(hasher.hashes(tok.encode(p))) <= set(announced()))
    finally:
        done.set()
        await collector
    token_ids = tok.encode(prompt)
    expected = hasher.hashes(token_ids)
    assert len(expected) >= 3

    ours = set(expected)
    # Same numbers, same order, and each announced block carries our tokens.
    assert [h for h in announced() if h in ours] == expected
    by_hash = {h: e for e in stored for h in e.block_hashes}
    first = by_hash[expected[0]]
    assert first.parent_block_hash is None
    assert first.token_ids[:32] == token_ids[:32]


async def test_index_fed_by_kv_events_holds_announced_blocks(engine) -> None:
    engine_url, endpoint, model_dir = engine
    tok = Tokenizer.from_model_dir(model_dir)
    index = PrefixIndex()
    sub = KVEventSubscriber("standard", endpoint, index)
    sub.start()
    stored: list[BlockStored] = []
    done = asyncio.Event()
    collector = asyncio.create_task(_collect_stored(endpoint, done, stored))
    try:
        await asyncio.wait_for(sub.connected.wait(), 5)
        router = Router("cache_aware", index, hasher=BlockHasher(HASH_CONFIG))
        hashes_of = lambda p: router.hasher.hashes(tok.encode(p))  # noqa: E731
        prompt = await _send_until(
            engine_url, 200, lambda p: index.match(hashes_of(p)).get("standard") == len(hashes_of(p)))
        req = RouteRequest(token_ids=tok.encode(prompt))
        hashes = hashes_of(prompt)
        announced_now = lambda: {h for e in stored for h in e.block_hashes}  # noqa: E731
        assert await _wait_for(lambda: set(hashes) <= announced_now(), 10)
        done.set()
        await collector
        announced = announced_now()
        # Every block the engine announced (and has not removed since) is in the index.
        assert set(hashes) <= announced
        assert all(index.holds("standard", h) for h in hashes)
        assert sub.batches > 0 and sub.events > 0

        class Replica(msgspec.Struct):
            name: str
            inflight: int = 0
            num_waiting: float = 0
            num_running: float = 0
            kv_capacity_blocks: int | None = None

        decision = router.pick(req, [Replica("other"), Replica("standard")])
        assert decision.replica.name == "standard"
        assert decision.predicted_cached_tokens == len(hashes) * 32
        stats = index.stats()
        assert stats.replicas["standard"] >= len(hashes) and stats.approx_bytes > 0
    finally:
        done.set()
        await sub.stop()
        if not collector.done():
            await collector
