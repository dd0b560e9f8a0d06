"""Cache-friendliness advisor fed with deliberately cache-hostile chat traffic, tokenized with the
demo model's tokenizer when available (byte-level ids otherwise: the demo BPE is byte-level too)."""

import json

import pytest

from pricing import CacheAdvisor, common_prefix_len, diagnose

TOOLS = [{"name": f"tool_{i}", "description": f"Does thing number {i} with care and precision.",
          "parameters": {"x": "int", "y": "string"}} for i in range(4)]
HISTORY = ["How do I sort a list in Python?", "Use sorted(xs) or xs.sort().",
           "And in reverse order?", "Pass reverse=True.", "What about by key?"]


def _tokenizer():
    from serving.demo_model import ensure_demo_model
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


@pytest.mark.parametrize("n", [0, 1, 5000])
def test_diagnose_handles_sizes(n):
    toks = list(range(n))
    assert diagnose(toks, toks + [1]).kind == "none"
