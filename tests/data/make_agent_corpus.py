"""Writes agent_corpus.jsonl: agent-shaped chat requests (tools, tool calls, tool results, content-part
arrays, the developer role, multi-turn) for the tokenizer parity test. Seeded: rerunning gives the
same file. Run: python tests/data/make_agent_corpus.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run pytest on a path; returns the summary.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "k": {"type": "string"}},
                    "required": ["path"]}, "strict": True}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "description": "ripgrep pattern, e.g. `def \\w+`"}}}}},
    {"type": "function", "function": {"name": "now"}},  # no description, no parameters
    {"type": "function", "function": {"name": "météo", "description": "Wetter — 天気 — 🌦",
     "parameters": {"type": "object", "properties": {"ville": {"type": "string", "enum": ["Paris", "Zürich"]}}}}},
]
TEXTS = ["Fix the failing test in tests/test_proxy.py.", "Why does the router pick standard-0?",
         "def f(x):\n    return x * 2\n", "Résumé: ça marche pas 😅", "   leading and trailing   ",
         "<tool_call>not really a call</tool_call>", "line1\r\nline2\n\n\nline3", "日本語のテキスト",
         "{\"json\": [1, 2, {\"a\": null}]}", ""]
RESULTS = ["3 passed, 1 failed in 0.42s", "FileNotFoundError: no such file", "{\"temp_c\": 21.5, \"sky\": \"clear\"}",
           "", "a\nb\nc", "Ünïcödé result ✓"]


def _content(rng: random.Random) -> object:
    if rng.random() < 0.35:
        return [{"type": "text", "text": rng.choice(TEXTS)} for _ in range(rng.randrange(1, 4))]
    return rng.choice(TEXTS)


def _arguments(rng: random.Random, name: str) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return ""  # vLLM renders {}
    if kind == 1:
        return "not json"  # malformed history: vLLM renders {}
    if kind == 2:
        return "[1, 2]"  # valid JSON, not an object: {}
    args = {"path": rng.choice(["gateway/proxy.py", "tests/", "données/é.py"])}
    if rng.random() < 0.5:
        args["k"] = rng.choice(["routing and not slow", "ünï"])
    if rng.random() < 0.3:
        args["nested"] = {"list": [1, 2.5, None, True], "s": "x\ny"}
    return json.dumps(args, ensure_ascii=rng.random() < 0.5)


def _conversation(rng: random.Random, index: int) -> dict:
    messages: list[dict] = []
    head = rng.randrange(4)
    if head == 1:
        messages.append({"role": "system", "content": _content(rng)})
    elif head == 2:
        messages.append({"role": "developer", "content": _content(rng)})
    for turn in range(rng.randrange(1, 4)):
        messages.append({"role": "user", "content": _content(rng)})
        if rng.random() < 0.7:
            calls = []
            for c in range(rng.randrange(0 if rng.random() < 0.15 else 1, 4)):
                name = rng.choice(TOOLS)["function"]["name"]
                calls.append({"id": f"call_{index}_{turn}_{c}", "type": "function",
                              "function": {"name": name, "arguments": _arguments(rng, name)}})
            content = None if rng.random() < 0.6 else rng.choice(TEXTS)
            messages.append({"role": "assistant", "content": content, "tool_calls": calls})
            for call in calls:
                result: object = rng.choice(RESULTS)
                if rng.random() < 0.3:
                    result = [{"type": "text", "text": rng.choice(RESULTS)} for _ in range(rng.randrange(1, 3))]
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            if calls and rng.random() < 0.6:
                messages.append({"role": "assistant", "content": _content(rng)})
        elif rng.random() < 0.5:
            messages.append({"role": "assistant", "content": _content(rng)})
        if rng.random() < 0.15:
            messages.append({"role": "developer", "content": rng.choice(TEXTS)})
    if messages[-1]["role"] == "assistant" and rng.random() < 0.5:
        messages.append({"role": "user", "content": "continue"})
    case: dict = {"messages": messages}
    tools_kind = rng.randrange(5)
    if tools_kind == 1:
        case["tools"] = []
    elif tools_kind >= 2:
        case["tools"] = rng.sample(TOOLS, rng.randrange(1, len(TOOLS) + 1))
    return case


def main() -> None:
    rng = random.Random(2121)
    cases = [_conversation(rng, i) for i in range(300)]
    with open(HERE / "agent_corpus.jsonl", "w", encoding="utf-8") as out:
        for case in cases:
            out.write(json.dumps(case, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
