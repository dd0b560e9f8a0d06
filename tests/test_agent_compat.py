"""Compatibility matrix: every agent request that works straight to an engine also works through the
gateway — route (chat completions, Responses, Messages) x streaming x tools (none, required) x tier.
Same body both ways (the model name aside); "works" is a 200 whose answer (or stream's last event) is
complete and, with tools required, carries a tool call. Writes benchmarks/results/agent_compat.json;
docs/agents.md's table is rendered from it (benchmarks/agent_compat.py).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
from conftest import bench_harness
from conftest import record_result

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("agent_compat", ROOT / "benchmarks" / "agent_compat.py")
agent_compat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agent_compat)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
          "required": ["city"], "additionalProperties": False}
ASK = "What is the weather in Paris?"


def body(route: str, stream: bool, tools: bool) -> tuple[str, dict]:
    if route == "chat":
        b = {"messages": [{"role": "user", "content": ASK}], "max_tokens": 300, "temperature": 0, "stream": stream}
        if stream:
            b["stream_options"] = {"include_usage": True}
        if tools:
            b |= {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}],
                  "tool_choice": "required", "parallel_tool_calls": False}
        return "/v1/chat/completions", b
    if route == "responses":
        b = {"input": ASK, "max_output_tokens": 300, "temperature": 0, "stream": stream, "store": False}
        if tools:
            b |= {"tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}], "tool_choice": "required",
              "parallel_tool_calls": False}
        return "/v1/responses", b
    b = {"messages": [{"role": "user", "content": ASK}], "max_tokens": 300, "temperature": 0, "stream": stream}
    if tools:
        b |= {"tools": [{"name": "get_weather", "input_schema": SCHEMA}],
              "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    return "/v1/messages", b


def outcome(route: str, stream: bool, tools: bool, resp: httpx.Response) -> dict:
    """ok: status 200, complete, and with a tool call when tools were required."""
    text = resp.text
    done = called = False
    if resp.status_code == 200:
        if not stream:
            answer = resp.json()
            if route == "chat":
                done = bool(answer.get("choices")) and "usage" in answer
                called = bool(answer["choices"][0]["message"].get("tool_calls"))
            elif route == "responses":
                done = answer.get("status") in ("completed", "incomplete")
                called = any(o.get("type") == "function_call" for o in answer.get("output", []))
            else:
                done = answer.get("type") == "message"
                called = any(b.get("type") == "tool_use" for b in answer.get("content", []))
        elif route == "chat":
            done = text.rstrip().endswith("data: [DONE]")
            called = '"tool_calls":[' in text
        elif route == "responses":
            done = "event: response.completed" in text
            called = "response.function_call_arguments.delta" in text
        else:
            done = "event: message_stop" in text
            called = '"type":"tool_use"' in text
    ok = resp.status_code == 200 and done and (called or not tools)
    why = "" if ok else (f"HTTP {resp.status_code}" if resp.status_code != 200 else
                         "incomplete" if not done else "no tool call")
    return {"status": resp.status_code, "ok": ok, "why": why}


def test_agent_compat_matrix(stack):
    cells = []
    with httpx.Client(timeout=120) as http:
        for route in ("chat", "responses", "messages"):
            for stream in (False, True):
                for tools in (False, True):
                    for tier in ("standard", "fast"):
                        path, b = body(route, stream, tools)
                        direct = http.post(stack.engines[tier] + path, json={**b, "model": "demo"})
                        model = "demo" if tier == "standard" else "demo:fast"
                        through = http.post(stack.gateway_url + path, json={**b, "model": model})
                        cells.append({"route": path, "stream": stream, "tools": "required" if tools else "none",
                                      "tier": tier, "engine": outcome(route, stream, tools, direct),
                                      "gateway": outcome(route, stream, tools, through)})
    result = {
        "meta": bench_harness().meta(["gateway/", "cache/", "serving/", "pricing/", "tests/test_agent_compat.py",
                                "benchmarks/agent_compat.py"],
                               setup="one request at a time, the session stack's two demo engines",
                               command="python -m pytest tests/test_agent_compat.py"),
        "cells": cells,
    }
    record_result(agent_compat.RESULT, result)
    broken = [c for c in cells if c["engine"]["ok"] and not c["gateway"]["ok"]]
    assert not broken, broken
    # Where the engine itself fails (the random model's call), the gateway answers as it does.
    assert all(c["engine"]["status"] == c["gateway"]["status"] for c in cells), cells
    assert sum(c["engine"]["ok"] for c in cells) >= 20, [c for c in cells if not c["engine"]["ok"]]


def test_docs_table_is_the_committed_result():
    result = json.loads(agent_compat.RESULT.read_text())
    assert agent_compat.doc_table() == agent_compat.render_table(result), \
        "docs/agents.md is stale: run python benchmarks/agent_compat.py"
