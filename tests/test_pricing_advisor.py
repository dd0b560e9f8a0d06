"""Cache-friendliness advisor fed with deliberately cache-hostile chat traffic, tokenized with the
demo model's tokenizer when available (byte-level ids otherwise: the demo BPE is byte-level too)."""

import gc
import json

import pytest

from yieldgate.cache.blocks import pack_tokens
from yieldgate.pricing import CacheAdvisor, common_prefix_len, diagnose

TOOLS = [{"name": f"tool_{i}", "description": f"Does thing number {i} with care and precision.",
          "parameters": {"x": "int", "y": "string"}} for i in range(4)]
HISTORY = ["How do I sort a list in Python?", "Use sorted(xs) or xs.sort().",
           "And in reverse order?", "Pass reverse=True.", "What about by key?"]


def _tokenizer():
    from yieldgate.serving.demo_model import ensure_demo_model
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ensure_demo_model() / "tokenizer.json"))
    return lambda s: tok.encode(s, add_special_tokens=False).ids


encode = _tokenizer()


def system_line(suffix: str) -> int:
    return len(encode(f"<|im_start|>system\nYou are a helpful assistant.{suffix}\n"))


def chat(turns: int, system_suffix: str = "", tools=TOOLS) -> list[int]:
    text = f"<|im_start|>system\nYou are a helpful assistant.{system_suffix}\n"
    text += "Tools: " + json.dumps(tools) + "<|im_end|>\n"
    for i, msg in enumerate(HISTORY[:turns]):
        role = "user" if i % 2 == 0 else "assistant"
        text += f"<|im_start|>{role}\n{msg}<|im_end|>\n"
    return encode(text)


def test_common_prefix():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([5, 6], [5, 6, 7]) == 2


def test_append_only_conversation_is_clean():
    d = diagnose(chat(1), chat(3))
    assert d.kind == "none" and d.lost_tokens == 0 and d.reused_tokens == len(chat(1))


def test_timestamp_in_system_prompt_is_a_volatile_span():
    prev = chat(1, " Current time: 2025-01-01 10:00:01")
    cur = chat(3, " Current time: 2025-01-01 10:00:07")
    d = diagnose(prev, cur)
    assert d.kind == "volatile_span"
    assert d.position < system_line(" Current time: 2025-01-01 10:00:07")  # inside the system prompt
    assert d.lost_tokens > 0.8 * (len(prev) - d.position)  # nearly all the rest was recomputed


def test_reordered_tools_are_detected():
    d = diagnose(chat(1), chat(3, tools=TOOLS[::-1]))
    assert d.kind == "reordered" and d.lost_tokens > 100


def test_edited_message_is_not_a_break():
    prev = encode("<|im_start|>user\n" + "Tell me a story about a dragon." * 2)
    cur = encode("<|im_start|>user\n" + "Summarize the French revolution in three lines please.")
    assert diagnose(prev, cur).kind == "edited"


def test_advisor_reports_per_key_and_stays_bounded():
    adv = CacheAdvisor(max_sessions=50)
    for s in range(10):
        for turn, second in ((1, "01"), (3, "09"), (5, "17")):
            adv.observe("clock-key", f"s{s}", chat(turn, f" Current time: 10:00:{second}"))
            adv.observe("tools-key", f"s{s}", chat(turn, tools=TOOLS if turn != 3 else TOOLS[::-1]))
            adv.observe("good-key", f"s{s}", chat(turn))
    clock, tools, good = adv.report("clock-key"), adv.report("tools-key"), adv.report("good-key")
    assert clock.requests == 20 and clock.breaks == 20 and clock.volatile_span_breaks == 20
    assert "volatile" in clock.advice
    assert tools.breaks == 20 and tools.reordered_breaks >= 10 and tools.lost_tokens > 0
    assert good.breaks == 0 and good.lost_tokens == 0 and good.reused_tokens > 0
    assert good.advice == "prompts are prefix-stable"
    assert [r.key_id for r in adv.reports()][-1] == "good-key"
    assert clock.median_break_position is not None and clock.median_break_position < system_line(" Current time: 10:00:01")
    for s in range(200):
        adv.observe("many", f"x{s}", chat(1))
    assert len(adv._last) == 50


def test_advisor_keeps_a_copy_of_a_first_prompt():
    """A session's first prompt is kept until a second one comes, so it must be a copy: the
    caller's list may change afterwards. Packed, so the garbage collector never walks it (10,000
    kept prompts as tuples made young-generation passes of ~100 ms)."""
    adv = CacheAdvisor()
    first = chat(1)
    assert adv.observe("k", "s", first) is None
    assert not gc.is_tracked(adv._last["k", "s"][0])
    kept = list(first)
    first[:] = [7] * len(first)
    d = adv.observe("k", "s", chat(3))
    assert d is not None and d.kind == "none" and d.reused_tokens == len(kept)
    assert diagnose(kept, chat(3)) == d


def test_advisor_keeps_prompts_of_any_token_type():
    """Ids that do not fit 64 bits, or content hashes that are not ints, are kept as tuples."""
    for prompt in ([2**40 + i for i in range(100)], [2**70 + i for i in range(100)], [f"block-{i}" for i in range(100)]):
        adv = CacheAdvisor()
        adv.observe("k", "s", prompt)
        d = adv.observe("k", "s", prompt + prompt[:10])
        assert d is not None and d.kind == "none" and d.reused_tokens == len(prompt)



def test_advisor_takes_prompts_packed_as_int32_bytes():
    """The gateway hands over the bytes it packed for block hashing: the same diagnosis and counts
    as for the token list, and a long prompt keeps only its head."""
    for packed_first in (False, True):
        adv, ref = CacheAdvisor(max_tokens=64), CacheAdvisor(max_tokens=64)
        for turn in (1, 3):
            prompt = chat(turn, " Current time: 10:00:0%d" % turn)
            packed = pack_tokens(prompt)
            d = adv.observe("k", "s", packed if packed_first or turn == 3 else prompt)
            assert d == ref.observe("k", "s", prompt)
        assert adv.report("k") == ref.report("k") and adv.report("k").prompt_tokens == len(prompt)
        assert len(adv._last["k", "s"][0]) == 64

@pytest.mark.parametrize("n", [0, 1, 5000])
def test_diagnose_handles_sizes(n):
    toks = list(range(n))
    assert diagnose(toks, toks + [1]).kind == "none"


def _reference_diagnose(prev, cur, window=8, min_lost=32):
    """The advisor's original pure-Python walk (a dict of token tuples), kept as the oracle."""
    p = common_prefix_len(prev, cur)
    if p >= len(prev):
        return (p, 0, "none")
    starts = {}
    for j in range(p, len(cur) - window + 1):
        starts.setdefault(tuple(cur[j:j + window]), j)
    lost, shifts, i = 0, [], p
    while i <= len(prev) - window:
        j = starts.get(tuple(prev[i:i + window]))
        if j is None:
            i += 1
            continue
        k = window
        while i + k < len(prev) and j + k < len(cur) and prev[i + k] == cur[j + k]:
            k += 1
        shifts.append(j - i)
        lost += k
        i += k
    kind = ("edited" if lost < min_lost else
            "volatile_span" if len(set(shifts)) <= 2 and all(abs(s) <= 64 for s in shifts) else "reordered")
    return (p, lost, kind)


def test_vectorised_diagnosis_matches_the_pure_python_walk():
    import random

    rng = random.Random(7)
    for _ in range(300):
        vocab = rng.choice((3, 50, 50_000))  # tiny vocabularies repeat windows inside a prompt
        prev = [rng.randrange(vocab) for _ in range(rng.randrange(0, 400))]
        cur = list(prev)
        for _ in range(rng.randrange(1, 4)):  # volatile spans, moved chunks, appends, deletions
            a = rng.randrange(len(cur) + 1)
            b = min(len(cur), a + rng.randrange(0, 80))
            op = rng.randrange(4)
            if op == 0:
                cur[a:b] = [rng.randrange(vocab) for _ in range(b - a)]
            elif op == 1:
                chunk = cur[a:b]
                del cur[a:b]
                at = rng.randrange(len(cur) + 1)
                cur[at:at] = chunk
            elif op == 2:
                cur += [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
            else:
                del cur[a:b]
        d = diagnose(prev, cur)
        assert (d.position, d.lost_tokens, d.kind) == _reference_diagnose(prev, cur), (prev, cur)
    # Non-integer items (e.g. block content hashes as bytes) are compared by their hash.
    blocks = [bytes([i]) * 8 for i in range(60)]
    d = diagnose(blocks, [b"x" * 8] + blocks[1:])
    assert (d.position, d.lost_tokens, d.kind) == _reference_diagnose(blocks, [b"x" * 8] + blocks[1:])
