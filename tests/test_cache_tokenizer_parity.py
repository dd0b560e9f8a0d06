"""The gateway's tokenizer gives the engine's token ids, prompt for prompt.

Every prompt is sent to the real engine's ``POST /tokenize`` (completions prompts
with {"prompt"}, chat with {"messages"}) and compared with ``Tokenizer``.
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import aiohttp
import pytest

from conftest import record_counts
from yieldgate.cache import Tokenizer, pack_tokens

CORPUS = (Path(__file__).resolve().parents[1] / "serving" / "data" / "corpus.txt").read_text()
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
UNICODE_POOL = (
    "éèêëàâäôöûüçñßøåæœ"  # Latin-1 / extended
    "αβγδεζηθλμπσωΩ"  # Greek
    "абвгдежзийклмнопрстуфхцчшщыэюя"  # Cyrillic
    "日本語中文字漢字かなカタカナ한국어"  # CJK
    "العربيةעברית"  # RTL
    "हिन्दीதமிழ்ไทย"  # Indic, Thai with combining marks
    "🎉🚀😀👍🏽👨‍👩‍👧❤️✨🔥"  # emoji incl. ZWJ sequences and modifiers
    "\u00a0\u2003\u3000\u200b\u200d\u2028\u0085\ufeff"  # unusual whitespace and invisibles
    "½²³€£¥©®™°±×÷∑∫√∞≈≠≤≥"
)
CODE = [
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\r\n",
    "SELECT id, name FROM users WHERE created_at >= '2024-01-01' ORDER BY id DESC LIMIT 10;",
    '{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}',
    "const f = async (x) => { await sleep(100); return x?.y ?? 42; };",
    "#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do echo \"$f\"; done\n",
    "<html><body><div class=\"a\">&nbsp;&amp;</div></body></html>",
    "x = [i**2 for i in range(1000) if i % 3 == 0]  # squares\n\n\n",
]
WORDS = ["I'LL", "don't", "You're", "we've", "it's", "THEY'D", "I'm", "1234567", "3.14159", "0x1F",
         "a", "the", "   ", "\t", "\n", "\r\n", "!!!", "...", "--", "__init__", "foo_bar", "CamelCase"]


def _corpus_slice(rng: random.Random, length: int) -> str:
    start = rng.randrange(0, max(1, len(CORPUS) - length))
    return CORPUS[start:start + length]


def _random_text(rng: random.Random) -> str:
    kind = rng.randrange(8)
    if kind == 0:
        return _corpus_slice(rng, rng.randrange(1, 400))
    if kind == 1:
        return "".join(rng.choice(UNICODE_POOL) for _ in range(rng.randrange(1, 80)))
    if kind == 2:
        return rng.choice(CODE) * rng.randrange(1, 3)
    if kind == 3:  # whitespace runs between words
        return "".join(rng.choice(WORDS) + rng.choice([" ", "  ", "\t", "\n\n", " \n ", "     ", ""])
                       for _ in range(rng.randrange(1, 40)))
    if kind == 4:  # special-token strings embedded in text
        return "".join(rng.choice([rng.choice(SPECIALS), _corpus_slice(rng, 30), " ", "\n"])
                       for _ in range(rng.randrange(1, 10)))
    if kind == 5:  # long text
        return _corpus_slice(rng, rng.randrange(2000, 6000))
    if kind == 6:  # mixed
        return " ".join([_corpus_slice(rng, 50), rng.choice(CODE),
                         "".join(rng.choice(UNICODE_POOL) for _ in range(20)), rng.choice(WORDS)])
    return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(160, 0x2FFF), rng.randrange(0x1F300, 0x1FAFF)]))
                   for _ in range(rng.randrange(1, 60)))


def _random_messages(rng: random.Random) -> list[dict]:
    messages: list[dict] = []
    if rng.random() < 0.6:
        messages.append({"role": "system", "content": _random_text(rng)[:1500]})
    for turn in range(rng.randrange(1, 4)):
        if rng.random() < 0.4:  # content-part list
            content: object = [{"type": "text", "text": _random_text(rng)[:800]} for _ in range(rng.randrange(1, 4))]
        else:
            content = _random_text(rng)[:1500]
        messages.append({"role": "user", "content": content})
        if rng.random() < 0.7:
            messages.append({"role": "assistant", "content": _random_text(rng)[:800]})
    if messages[-1]["role"] == "assistant" and rng.random() < 0.5:
        messages.append({"role": "user", "content": "continue"})
    return messages


def _cases(n_prompts: int = 700, n_chats: int = 400) -> list[dict]:
    rng = random.Random(20261)
    cases: list[dict] = [{"prompt": ""}, {"prompt": " "}, {"prompt": "\n\n\n"}]
    cases += [{"prompt": _random_text(rng)} for _ in range(n_prompts)]
    cases += [{"messages": _random_messages(rng)} for _ in range(n_chats)]
    return cases


@pytest.fixture(scope="module")
def engine_url(request: pytest.FixtureRequest) -> str:
    """Standard engine: the session `stack` when it exists, else YIELDGATE_TEST_ENGINE_URL."""
    try:
        stack = request.getfixturevalue("stack")
    except pytest.FixtureLookupError:
        url = os.environ.get("YIELDGATE_TEST_ENGINE_URL")
        if not url:
            pytest.skip("no engine: no `stack` fixture and YIELDGATE_TEST_ENGINE_URL unset")
        return url.rstrip("/")
    return stack.engines["standard"].rstrip("/")


@pytest.fixture(scope="module")
def model_dir(request: pytest.FixtureRequest) -> Path:
    try:
        return Path(request.getfixturevalue("stack").model_dir)
    except pytest.FixtureLookupError:
        from yieldgate.serving.demo_model import ensure_demo_model
        return Path(ensure_demo_model())


async def _engine_tokens(engine_url: str, cases: list[dict]) -> list[list[int]]:
    sem = asyncio.Semaphore(16)
    async with aiohttp.ClientSession() as http:
        async def one(case: dict) -> list[int]:
            async with sem:
                async with http.post(f"{engine_url}/tokenize", json={"model": "demo", **case}) as resp:
                    body = await resp.json()
                    assert resp.status == 200, body
                    return body["tokens"]
        return await asyncio.gather(*(one(c) for c in cases))


async def test_tiktoken_path_matches_engine_tokenize(engine_url: str, model_dir: Path) -> None:
    tok = Tokenizer.from_model_dir(model_dir)
    assert tok.backend == "tiktoken", tok.not_convertible_reason
    cases = _cases()
    assert len(cases) >= 1000
    expected = await _engine_tokens(engine_url, cases)
    mismatches = []
    for case, want in zip(cases, expected):
        got = tok.encode(case["prompt"]) if "prompt" in case else tok.encode_chat(case["messages"])
        if got != want:
            mismatches.append((case, got[:20], want[:20]))
    record_counts("tokenizer_parity", "tests/test_cache_tokenizer_parity.py::test_tiktoken_path_matches_engine_tokenize",
                  ["cache/", "serving/data/", "tests/test_cache_tokenizer_parity.py"],
                  {"prompts": len(cases), "identical": len(cases) - len(mismatches)})
    assert not mismatches, f"{len(mismatches)}/{len(cases)} differ; first: {mismatches[0]!r}"


async def test_hf_fallback_matches_engine_tokenize(engine_url: str, model_dir: Path) -> None:
    tok = Tokenizer.from_model_dir(model_dir, backend="hf")
    assert tok.backend == "hf"
    cases = _cases(150, 100)
    expected = await _engine_tokens(engine_url, cases)
    got = [tok.encode(c["prompt"]) if "prompt" in c else tok.encode_chat(c["messages"]) for c in cases]
    assert got == expected


def test_non_byte_level_tokenizer_falls_back_to_hf(tmp_path: Path) -> None:
    import json

    from yieldgate.serving.demo_model import ensure_demo_model
    model_dir = Path(ensure_demo_model())
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Lowercase"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer.from_model_dir(tmp_path)
    assert tok.backend == "hf" and "normalizer" in (tok.not_convertible_reason or "")
    assert tok.encode("HeLLo") == tok.encode("hello")


def test_segment_cache_gives_the_ids_of_an_uncached_encode() -> None:
    """Every segment between special tokens is cached, short ones included; a warm cache must
    give what the HF tokenizer gives for the whole text."""
    from yieldgate.serving.demo_model import ensure_demo_model
    tok = Tokenizer.from_model_dir(Path(ensure_demo_model()))
    assert tok.backend == "tiktoken"
    system = "You are a helpful assistant. " * 20
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": f"question {i}: why?"}]
             for i in range(5)] + [[{"role": "user", "content": "user\n"}], [{"role": "user", "content": "\n"}]]
    for _ in range(2):  # cold, then warm
        for messages in chats:
            text = tok.render_chat(messages)
            assert tok.encode_chat(messages) == tok.hf.encode(text, add_special_tokens=False).ids
            ids, packed = tok.encode_chat_packed(messages)  # the packed ids come from the cache too
            assert ids == tok.encode_chat(messages) and packed == pack_tokens(ids)
    assert "\n" in tok._segment_cache  # the template's short separators are cached too


AGENT_CORPUS = Path(__file__).resolve().parent / "data" / "agent_corpus.jsonl"


def _agent_cases() -> list[dict]:
    import json
    return [json.loads(line) for line in AGENT_CORPUS.read_text(encoding="utf-8").splitlines() if line]


async def test_agent_corpus_matches_engine_tokenize(engine_url: str, model_dir: Path) -> None:
    """Tools, assistant tool calls (arguments valid, malformed, non-object, empty), tool results as
    strings and part arrays, the developer role, content-part arrays: the gateway's rendering and
    tokens equal vLLM's chat `/tokenize` for every request of the committed corpus."""
    tok = Tokenizer.from_model_dir(model_dir)
    cases = _agent_cases()
    assert len(cases) >= 300
    assert sum("tools" in c and bool(c["tools"]) for c in cases) > 100
    assert sum(any(m["role"] == "tool" for m in c["messages"]) for c in cases) > 100
    assert sum(any(m["role"] == "developer" for m in c["messages"]) for c in cases) > 30
    expected = await _engine_tokens(engine_url, cases)
    mismatches = [i for i, (case, want) in enumerate(zip(cases, expected))
                  if tok.encode_chat(case["messages"], case.get("tools")) != want]
    print(f"\n[parity] agent corpus: {len(cases) - len(mismatches)}/{len(cases)} identical")
    record_counts("agent_corpus", "tests/test_cache_tokenizer_parity.py::test_agent_corpus_matches_engine_tokenize",
                  ["cache/", "tests/data/agent_corpus.jsonl", "tests/test_cache_tokenizer_parity.py"],
                  {"requests": len(cases), "identical": len(cases) - len(mismatches)})
    assert not mismatches, f"{len(mismatches)}/{len(cases)} differ; first: case {mismatches[0]}: " \
        f"{cases[mismatches[0]]!r}"
