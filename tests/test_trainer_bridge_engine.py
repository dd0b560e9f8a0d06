"""The trainer bridge against a real vLLM engine running the `yieldgate` weight-transfer plugin.

Uses the session `stack`'s standard engine (it runs the yieldgate backend), borrowing the push
token from the gateway; only if that engine lacks the backend does it start one engine of its own
on port base + 300 and stop it afterwards. Every test leaves the engine on known weights.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from yieldgate.trainer_bridge import (
    BridgeConfig,
    ChecksumMismatch,
    EngineClient,
    PushFaults,
    PushRefused,
    RolloutFailed,
    WeightSet,
    apply_staged,
    arm_engine,
    discard_staged,
    engine_weight_version,
    push_to_engine,
    reload_from_checkpoint,
    stage,
)
from engines import start_engine, stop_engine, wait_healthy
from yieldgate.trainer_bridge.checkpoint import CheckpointStore
from yieldgate.trainer_bridge.rollout import EngineFleet, Rollout

pytestmark = pytest.mark.engine

OWN_PORT = int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000")) + 300
TOKEN = "tb-test-token-" + os.urandom(4).hex()
PROMPT = "Once upon a time"
# Long enough to fill several 32-token blocks, so a repeat would hit the prefix cache.
LONG_PROMPT = " ".join(f"The quick brown fox number {i} jumps over the lazy dog." for i in range(30))


def _stack_engine(request) -> tuple[str, Path, str] | None:
    """The session stack's standard engine, if it runs our backend.

    The gateway owns the engines' push token; the test borrows the engine by rotating to its own
    token with the gateway's as `current_token` (read from the admin API) and hands it back after.
    """
    stack = request.getfixturevalue("stack")
    url = stack.engines["standard"]
    if EngineClient(url).transfer_backend() != "yieldgate":
        return None
    resp = httpx.get(stack.gateway_url + "/admin/weight_targets", params={"direct": 1, "tier": "standard"},
                     headers={"Authorization": f"Bearer {stack.admin_token}"}, timeout=60)
    if resp.status_code != 200:
        return None
    gateway_token = resp.json()["push_token"]
    try:
        arm_engine(url, TOKEN, current_token=gateway_token)
    except PushRefused:
        return None  # armed by someone else: do not fight it
    return url, Path(stack.model_dir), gateway_token


@pytest.fixture(scope="module")
def engine(request, tmp_path_factory):
    from yieldgate.serving.demo_model import ensure_demo_model

    found = _stack_engine(request)
    proc = None
    if found is None:
        model_dir = ensure_demo_model()
        log_path = tmp_path_factory.mktemp("tb-engine") / "engine.log"
        proc = start_engine(model_dir, OWN_PORT, log_path, "--max-model-len", "4096",
                            "--enable-prefix-caching", "--enable-prompt-tokens-details")
        url = f"http://127.0.0.1:{OWN_PORT}"
        try:
            wait_healthy(url, proc, log_path)
            arm_engine(url, TOKEN)
        except BaseException:
            stop_engine(proc)
            raise
    else:
        url, model_dir, gateway_token = found
    try:
        yield url, model_dir
    finally:
        if proc is None:
            # Hand the shared engine back clean: base weights, and the gateway's push token.
            reload_from_checkpoint(url, model_dir, "default")
            arm_engine(url, gateway_token, current_token=TOKEN)
        else:
            stop_engine(proc)


@pytest.fixture(scope="module")
def base_weights(engine) -> dict[str, torch.Tensor]:
    return load_file(str(engine[1] / "model.safetensors"))


def perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}


def complete(url: str, prompt: str = PROMPT, max_tokens: int = 12) -> dict:
    resp = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
    })
    resp.raise_for_status()
    return resp.json()


def text(url: str) -> str:
    return complete(url)["choices"][0]["text"]


@pytest.fixture
def on_base(engine, base_weights):
    """Every test starts from the launch weights."""
    url = engine[0]
    push_to_engine(url, base_weights, "base", token=TOKEN)
    return url


def test_plugin_is_loaded_in_the_engine(on_base):
    assert EngineClient(on_base).transfer_backend() == "yieldgate"
    # The engine reports the version just pushed through the plugin, not merely some string.
    assert engine_weight_version(on_base) == "base"


@pytest.fixture(params=["shm", "tcp"])
def transport(request) -> str:
    """The trainer shares the engine's host here: shared memory unless turned off (then TCP)."""
    return request.param


def bridge(transport: str) -> BridgeConfig:
    return BridgeConfig(shared_memory=transport == "shm")


def test_push_changes_greedy_output_and_advances_version(on_base, base_weights, transport):
    url = on_base
    before = text(url)
    report = push_to_engine(url, perturbed(base_weights, 1), "v1", token=TOKEN, config=bridge(transport))
    assert report.transports == {url: transport}
    assert report.bytes_per_engine > 0 and report.tensors == len(base_weights)
    assert engine_weight_version(url) == "v1"
    after = text(url)
    assert after != before
    # Pushing the original weights back reproduces the original output exactly.
    push_to_engine(url, base_weights, "v2", token=TOKEN)
    assert text(url) == before
    assert engine_weight_version(url) == "v2"


def test_flipped_byte_is_refused_and_old_weights_keep_serving(on_base, base_weights, transport):
    url = on_base
    before = text(url)
    with pytest.raises(ChecksumMismatch):
        push_to_engine(url, perturbed(base_weights, 2), "corrupt", token=TOKEN,
                       faults=PushFaults(corrupt_chunk=5), config=bridge(transport))
    assert engine_weight_version(url) == "base"
    assert text(url) == before


def served_state(url: str) -> tuple[list, dict[str, str]]:
    """What the engine computes (greedy tokens with their exact logprobs: every layer, including
    the oneDNN-packed linears) and the digests of the parameters vLLM itself can checksum."""
    resp = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 3,
    })
    resp.raise_for_status()
    logprobs = resp.json()["choices"][0]["logprobs"]
    checksums = httpx.post(url + "/weight_checker", json={"action": "checksum"}, timeout=60)
    checksums.raise_for_status()
    return [logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]], checksums.json()["checksums"]


def test_late_chunk_failure_restores_the_old_weights_exactly(on_base, base_weights, transport):
    """The engine loads tensors while later chunks still stream; a checksum failure on the last
    chunk, after all the others were loaded, must leave it serving exactly the old weights."""
    url = on_base
    before = served_state(url)
    chunks = sum(1 for e in WeightSet.from_model(base_weights).entries if e.nbytes)  # one per tensor here
    with pytest.raises(ChecksumMismatch) as failure:
        # Held back 1 s, so every earlier tensor has been loaded (and processed) by then.
        push_to_engine(url, perturbed(base_weights, 10), "late-corrupt", token=TOKEN,
                       faults=PushFaults(corrupt_chunk=chunks - 1, delay_s=1.0), config=bridge(transport))
    notes = " ".join(getattr(failure.value, "__notes__", []))
    loaded = re.search(r"after loading (\d+) of (\d+) tensors", notes)
    assert loaded is not None, notes
    assert int(loaded[1]) >= chunks - 2 > 0  # the late chunk really came after the loads
    assert engine_weight_version(url) == "base"
    assert served_state(url) == before
    # And the engine still takes the next push normally.
    push_to_engine(url, perturbed(base_weights, 10), "after-restore", token=TOKEN)
    assert served_state(url)[0] != before[0]


def test_staged_weights_serve_only_once_applied(on_base, base_weights):
    url = on_base
    before = text(url)
    dtype = EngineClient(url).model_dtype()
    sessions, _ = stage(WeightSet.from_model(perturbed(base_weights, 8), dtype=dtype), [url], TOKEN)
    # Streamed and verified into the engine's buffers while it kept serving the old weights.
    assert text(url) == before
    assert engine_weight_version(url) == "base"
    apply_staged(url, sessions[url], "staged-1")
    assert engine_weight_version(url) == "staged-1"
    applied = text(url)
    assert applied != before
    # Staged but discarded (an aborted rollout): never loaded, not even by a later session.
    stage(WeightSet.from_model(perturbed(base_weights, 9), dtype=dtype), [url], TOKEN)
    discard_staged(url)
    assert text(url) == applied
    assert engine_weight_version(url) == "staged-1"


def test_unauthenticated_push_is_refused(on_base, base_weights):
    url = on_base
    before = text(url)
    # Arming with another token is refused: the engine holds this rollout's token.
    with pytest.raises(PushRefused):
        push_to_engine(url, perturbed(base_weights, 3), "evil", token="not-the-token")
    # Skipping the arming and streaming chunks signed with the wrong token: refused too.
    with pytest.raises(PushRefused):
        push_to_engine(url, perturbed(base_weights, 3), "evil", token="not-the-token", init=False)
    assert engine_weight_version(url) == "base"
    assert text(url) == before


def test_update_resets_the_prefix_cache(on_base, base_weights):
    url = on_base
    complete(url, LONG_PROMPT, 1)
    warm = complete(url, LONG_PROMPT, 1)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert warm > 0
    push_to_engine(url, base_weights, "same-weights-new-version", token=TOKEN)
    cold = complete(url, LONG_PROMPT, 1)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cold == 0


def test_checkpoint_reload_fallback(engine, on_base, base_weights, tmp_path):
    from yieldgate.trainer_bridge import write_checkpoint

    url, model_dir = engine
    before = text(url)
    ckpt = write_checkpoint(perturbed(base_weights, 4), model_dir, tmp_path / "v4")
    reload_from_checkpoint(url, ckpt, "v4")
    assert engine_weight_version(url) == "v4"
    assert text(url) != before


async def test_rolling_rollout_advances_then_rolls_back_on_failed_eval(engine, on_base, base_weights, tmp_path):
    url, model_dir = engine
    before = text(url)
    store = CheckpointStore(tmp_path / "versions", model_dir, keep=3)
    store.adopt("base", model_dir)  # what on_base pushed
    fleet = EngineFleet([url])
    rollout = Rollout(fleet, store, current_token=TOKEN)
    try:
        await rolling_rollout_story(url, fleet, store, rollout, before, base_weights)
    finally:
        # Each rollout rotated the push token; hand the module's token back to the other tests.
        if rollout.token != TOKEN:
            arm_engine(url, TOKEN, current_token=rollout.token)


async def rolling_rollout_story(url, fleet, store, rollout, before, base_weights) -> None:
    report = await rollout.run(perturbed(base_weights, 5), "r1")
    assert report.methods == {url: "push"} and report.previous == {url: "base"}
    assert engine_weight_version(url) == "r1"
    r1_text = text(url)
    assert r1_text != before and url in fleet.routable

    async def reject(_replica: str) -> bool:
        return False

    rollout.evaluate = reject
    with pytest.raises(RolloutFailed) as failure:
        await rollout.run(perturbed(base_weights, 6), "r2")
    assert "evaluation" in failure.value.reason
    # Restored from the r1 checkpoint on disk and re-admitted.
    assert engine_weight_version(url) == "r1"
    assert text(url) == r1_text
    assert url in fleet.routable

    rollout.evaluate = None
    rollout.mode = "all_at_once"
    await rollout.run(perturbed(base_weights, 7), "r3")
    assert engine_weight_version(url) == "r3"
    assert store.versions() == ["base", "r1", "r3"]  # the rejected r2 was not kept
    # Rollback is one call, back to what the engine served before (the history, not the store's
    # order: r2 failed its evaluation).
    assert await rollout.rollback() == {url: "r1"}
    assert engine_weight_version(url) == "r1"
    assert text(url) == r1_text
    assert url in fleet.routable
    # Again: r3 was rolled back and r2 failed, so the way back from r1 is the launch weights
    # (the store's second-newest, r1, is what the engine serves already).
    assert store.versions()[-2] == "r1"
    assert await rollout.rollback() == {url: "base"}
    assert engine_weight_version(url) == "base"
    assert text(url) == before
    assert rollout.token != TOKEN  # each rollout rotated the push token


def test_vllm_trainer_factory_drives_the_yieldgate_backend(engine, on_base):
    """Code written against vLLM's own trainer-side API reaches the engine through our plugin."""
    from transformers import LlamaForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import yieldgate.trainer_bridge.plugin
    from yieldgate import trainer_bridge
    from yieldgate.trainer_bridge.trainer_engine import YieldgateTrainerInitInfo

    trainer_bridge.plugin.register()
    url, model_dir = engine
    before = text(url)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # flips every logit's sign: greedy output must change
    client = EngineClient(url)
    trainer = WeightTransferTrainerFactory.trainer_init(
        YieldgateTrainerInitInfo(rank=0, token=TOKEN), client=client, source=ModuleSource(model)
    )
    trainer.send_weights()
    assert text(url) != before
