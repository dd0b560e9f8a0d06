"""Speculative decoding with a draft model on vLLM CPU, and pushing new draft weights into it.

Starts one engine of its own (the demo model drafting for itself, 3 tokens per step) with the
`yieldgate` backend. A draft push goes through vLLM's /start_draft_weight_update session: the
served text must not change (the target verifies every token), the acceptance rate must.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from engines import start_engine, stop_engine, wait_healthy
from yieldgate.trainer_bridge import EngineClient, arm_engine, engine_weight_version, push

pytestmark = pytest.mark.engine

PORT = int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000")) + 301
TOKEN = "tb-draft-" + os.urandom(4).hex()
PROMPTS = [f"Once upon a time {i}" for i in range(4)]


@pytest.fixture(scope="module")
def draft_engine(tmp_path_factory):
    from yieldgate.serving.demo_model import ensure_demo_model

    model_dir = ensure_demo_model()
    log_path = tmp_path_factory.mktemp("tb-draft") / "engine.log"
    spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}
    proc = start_engine(model_dir, PORT, log_path, "--max-model-len", "2048",
                        "--speculative-config", json.dumps(spec))
    url = f"http://127.0.0.1:{PORT}"
    try:
        wait_healthy(url, proc, log_path)
        arm_engine(url, TOKEN)
        yield url, Path(model_dir)
    finally:
        stop_engine(proc)


def _counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})?\s+([0-9.e+]+)", text, re.M))


def _serve(url: str) -> tuple[list[str], float]:
    """-> (greedy texts, acceptance rate of the drafts proposed meanwhile)."""
    accepted = _counter(url, "vllm:spec_decode_num_accepted_tokens_total")
    drafted = _counter(url, "vllm:spec_decode_num_draft_tokens_total")
    texts = []
    for prompt in PROMPTS:
        resp = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "demo", "prompt": prompt, "max_tokens": 24, "temperature": 0})
        resp.raise_for_status()
        texts.append(resp.json()["choices"][0]["text"])
    accepted = _counter(url, "vllm:spec_decode_num_accepted_tokens_total") - accepted
    drafted = _counter(url, "vllm:spec_decode_num_draft_tokens_total") - drafted
    assert drafted > 0, "the engine proposed no drafts"
    return texts, accepted / drafted


def test_draft_push_moves_acceptance_not_outputs(draft_engine):
    url, model_dir = draft_engine
    base = load_file(str(model_dir / "model.safetensors"))
    texts, acceptance = _serve(url)
    assert acceptance > 0.9  # the draft is the target itself

    g = torch.Generator().manual_seed(3)
    noisy = {k: v + torch.randn(v.shape, generator=g) for k, v in base.items()}
    dtype = EngineClient(url).model_dtype()
    push(noisy, "d-1", engines=[url], token=TOKEN, init=False, draft=True, dtype=dtype, progress=False)
    assert engine_weight_version(url) == "d-1"
    noisy_texts, noisy_acceptance = _serve(url)
    assert noisy_texts == texts  # the target still decides every token
    assert noisy_acceptance < 0.5

    push(base, "d-2", engines=[url], token=TOKEN, init=False, draft=True, dtype=dtype, progress=False)
    restored_texts, restored_acceptance = _serve(url)
    assert restored_texts == texts
    assert restored_acceptance > 0.9


def test_draft_push_refuses_the_gateway_route():
    with pytest.raises(ValueError, match="draft"):
        push({}, "x", gateway="http://127.0.0.1:1", draft=True)
