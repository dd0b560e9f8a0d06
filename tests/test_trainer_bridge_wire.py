"""The trainer bridge's data plane without vLLM: sender and receiver over real loopback TCP."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from yieldgate.trainer_bridge import CheckpointStore, WeightSet, checkpoint_name
from yieldgate.trainer_bridge.errors import ChecksumMismatch, PushRefused
from yieldgate.trainer_bridge.receiver import (
    ParamLayout,
    StagingArea,
    StagingPool,
    receive_update,
    receive_update_async,
)
from yieldgate.trainer_bridge.sender import ChunkSender, StreamTarget


def _weights() -> WeightSet:
    g = torch.Generator().manual_seed(0)
    return WeightSet.from_model(
        {
            "model.embed_tokens.weight": torch.randn(300, 64, generator=g),
            "model.norm.weight": torch.randn(64, generator=g),
            "lm_head.weight": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        }
    )


@pytest.fixture(params=["thread", "event_loop"])
def receiver(request):
    """Both receivers: the engine's (a thread) and the gateway's (inside an event loop)."""
    return request.param


def _receive(kind: str, *args) -> None:
    if kind == "thread":
        receive_update(*args)
    else:
        asyncio.run(receive_update_async(*args))


def _transfer(weights: WeightSet, sender_token: str, receiver_token: str, corrupt: int | None = None,
              pool: StagingPool | None = None, kind: str = "thread", shared_memory: bool = True):
    """Run one stream; returns (staging, receiver exception, sender-side target)."""
    layout = [ParamLayout(e.name, e.dtype, e.shape) for e in weights.entries]
    staging = StagingArea(layout, pool)
    with ChunkSender(chunk_bytes=4096, connect_timeout_s=10, shared_memory=shared_memory) as sender:
        target = StreamTarget(token=sender_token, corrupt_chunk=corrupt)
        info = sender.update_info(weights, target, timeout_s=10)
        errors: list[BaseException] = []

        def receive() -> None:
            try:
                _receive(kind, info["sender"], bytes.fromhex(info["session"]), receiver_token,
                         staging, info["checksum"], 10)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        thread = threading.Thread(target=receive)
        thread.start()
        sender.stream(weights, [target])
        thread.join()
    return staging, (errors[0] if errors else None), target


def test_stream_lands_every_byte_in_the_preallocated_buffers(receiver):
    weights = _weights()
    staging, error, target = _transfer(weights, "t", "t", kind=receiver)
    assert error is None and target.error is None
    for entry, (name, tensor) in zip(weights.entries, staging.items()):
        assert name == entry.name and tensor.dtype == entry.dtype
        assert torch.equal(tensor, entry.tensor)
    assert target.bytes_sent == weights.total_bytes


def test_receivers_that_dial_before_the_stream_starts_get_it(receiver):
    """An announced push: the gateway starts the receivers (sessions of its choosing) before the
    trainer knows their sessions; their connections wait in the chunk server's backlog."""
    weights = _weights()
    layout = [ParamLayout(e.name, e.dtype, e.shape) for e in weights.entries]
    stagings = [StagingArea(layout) for _ in range(2)]
    sessions = [bytes([i]) * 16 for i in range(1, 3)]
    with ChunkSender(chunk_bytes=4096, connect_timeout_s=10) as sender:
        errors: list[BaseException] = []

        def receive(staging: StagingArea, session: bytes) -> None:
            try:
                _receive(receiver, sender.address, session, "t", staging, sender.checksum, 10)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=receive, args=(st, se)) for st, se in zip(stagings, sessions)]
        for thread in threads:
            thread.start()
        threading.Event().wait(0.3)  # both dialled and sent their hello; nobody accepted yet
        targets = [StreamTarget(token="t", session=se) for se in sessions]
        sender.stream(weights, targets)
        for thread in threads:
            thread.join()
    assert not errors and all(t.error is None for t in targets)
    for staging in stagings:
        assert all(torch.equal(t, e.tensor) for (_, t), e in zip(staging.items(), weights.entries))


def test_registered_pool_is_reused_across_updates():
    pool = StagingPool()
    first, error, _ = _transfer(_weights(), "t", "t", pool=pool)
    assert error is None
    arena = pool.reserve(0).data_ptr()
    # Every staged tensor is a view into the one arena, so an update writes no fresh pages.
    assert all(t.untyped_storage().data_ptr() == arena for t in first.tensors)
    weights = _weights()
    second, error, _ = _transfer(weights, "t", "t", pool=pool)
    assert error is None and pool.reserve(0).data_ptr() == arena
    for entry, (_, tensor) in zip(weights.entries, second.items()):
        assert torch.equal(tensor, entry.tensor)


def test_same_host_trainer_writes_into_shared_staging_memory():
    pool = StagingPool()  # the engine's: a memfd a same-host, same-user trainer can map
    weights = _weights()
    staging, error, target = _transfer(weights, "t", "t", pool=pool)
    assert error is None and target.error is None and target.transport == "shm"
    for entry, (_, tensor) in zip(weights.entries, staging.items()):
        assert torch.equal(tensor, entry.tensor)
    # A trainer that does not take the offer (or cannot map it) streams the bytes over TCP.
    staging, error, target = _transfer(_weights(), "t", "t", pool=pool, shared_memory=False)
    assert error is None and target.transport == "tcp"
    assert all(torch.equal(t, e.tensor) for (_, t), e in zip(staging.items(), weights.entries))
    staging, error, target = _transfer(_weights(), "t", "t", pool=StagingPool(shared=False))
    assert error is None and target.transport == "tcp"


def test_shared_memory_bytes_are_still_verified_and_signed():
    pool = StagingPool()
    _, error, target = _transfer(_weights(), "t", "t", corrupt=3, pool=pool)
    assert target.transport == "shm"
    assert isinstance(error, ChecksumMismatch) and isinstance(target.error, ChecksumMismatch)
    _, error, target = _transfer(_weights(), "wrong", "right", pool=pool)
    assert isinstance(error, PushRefused) and isinstance(target.error, PushRefused)


def test_flipped_byte_is_caught_on_both_ends(receiver):
    staging, error, target = _transfer(_weights(), "t", "t", corrupt=3, kind=receiver)
    assert isinstance(error, ChecksumMismatch)
    assert isinstance(target.error, ChecksumMismatch)


def test_chunks_without_the_token_are_refused(receiver):
    _, error, target = _transfer(_weights(), "wrong", "right", kind=receiver)
    assert isinstance(error, PushRefused)
    assert isinstance(target.error, PushRefused)


def test_names_are_mapped_to_checkpoint_names_and_buffers_skipped():
    assert checkpoint_name("module._orig_mod.model.norm.weight") == "model.norm.weight"
    ws = WeightSet.from_model(
        {
            "module.model.norm.weight": torch.ones(4),
            "module.model.rotary_emb.inv_freq": torch.ones(2),
            "module.step": torch.tensor(3),
        },
        dtype=torch.bfloat16,
    )
    assert [e.name for e in ws.entries] == ["model.norm.weight"]
    assert ws.entries[0].materialize().dtype == torch.bfloat16
    assert ws.total_bytes == 8


def test_checkpoint_store_keeps_n_versions_and_knows_the_previous(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    store = CheckpointStore(tmp_path / "versions", base, keep=2)
    for v in ("v1", "v2", "v3"):
        store.save(v, {"w": torch.full((2,), float(v[1]))})
    assert store.versions() == ["v2", "v3"]
    assert store.previous("v3") == "v2"
    assert not (tmp_path / "versions" / "v1").exists()
    assert (store.path("v3") / "config.json").exists()
    with pytest.raises(ValueError):
        store.path("../evil")


def test_checkpoint_store_never_evicts_a_version_still_served(tmp_path):
    """Saving N makes room by evicting the oldest versions, but not the ones still served (a
    failed rollout of N restores them); the launch weights stay reachable once evicted."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    store = CheckpointStore(tmp_path / "versions", base, keep=2)
    store.adopt("default", base)
    store.save("v1", {"w": torch.zeros(2)})
    store.save("v2", {"w": torch.ones(2)}, protect={"default"})  # v1 goes, default is served
    assert store.versions() == ["default", "v2"]
    store.save("v3", {"w": torch.ones(2)}, protect={"v2"})
    assert store.versions() == ["v2", "v3"]
    assert store.source("default") == base
    assert store.source("v3") == store.path("v3")
    assert store.source("v1") is None  # evicted, and only the launch weights have a fallback


def test_swap_waves_keep_every_tier_served():
    from yieldgate.trainer_bridge.rollout import swap_waves

    # The demo fleet: one replica per tier. A lone tier borrows the other while it is out, so
    # only one of them may be out at a time.
    tiers = {"standard-0": "standard", "fast-0": "fast"}
    assert swap_waves(list(tiers), tiers.get) == [["standard-0"], ["fast-0"]]
    # Two replicas per tier: half of each tier swaps together, the other half keeps serving.
    tiers = {"s0": "standard", "s1": "standard", "f0": "fast", "f1": "fast"}
    assert swap_waves(list(tiers), tiers.get) == [["s0", "f0"], ["s1", "f1"]]
    # A fleet of one still gets updated.
    assert swap_waves(["only"], lambda _r: "") == [["only"]]
