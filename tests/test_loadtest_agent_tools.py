"""The load tester's "agent with tools" workload and its three wire formats, without a server:
the sessions' shape, the conversation each turn re-sends, and each API's usage read back."""

from __future__ import annotations

import json

import msgspec
import pytest

from yieldgate.loadtest import AgentToolsWorkload, RequestOutcome, Target
from yieldgate.loadtest.client import OpenAIClient
from yieldgate.loadtest.runner import _append_turn
from yieldgate.loadtest.sse import SSEDecoder
from yieldgate.loadtest.wire import WIRES


def conversation(session, answers: list[str] | None = None) -> list[list[dict]]:
    """The chat messages of each turn's request, as the runner builds them."""
    messages: list[dict] = [{"role": "system", "content": session.system}]
    sent = []
    for k, turn in enumerate(session.turns):
        _append_turn(messages, turn, "")
        sent.append(json.loads(json.dumps(messages)))
        messages.append({"role": "assistant", "content": (answers or [])[k] if answers else f"answer {k}"})
    return sent


def test_sessions_are_seeded_multi_turn_with_one_fixed_tool_list():
    wl = AgentToolsWorkload(seed=3, turns_min=3, turns_max=5)
    a, b = wl.take(20), AgentToolsWorkload(seed=3, turns_min=3, turns_max=5).take(20)
    assert a == b and a != AgentToolsWorkload(seed=4, turns_min=3, turns_max=5).take(20)
    assert {len(s.turns) for s in a} <= {3, 4, 5} and len({len(s.turns) for s in a}) > 1
    assert all(s.tools == a[0].tools for s in a) and len(a[0].tools) == 4
    names = {t["function"]["name"] for t in a[0].tools}
    for s in a:
        assert s.turns[0].tool_call is None and s.turns[0].tool_output is None
        for t in s.turns[1:]:
            assert t.tool_call is not None and t.tool_call.name in names and t.tool_output
            assert isinstance(json.loads(t.tool_call.arguments), dict)
        ids = [t.tool_call.id for t in s.turns[1:]]
        assert len(set(ids)) == len(ids)


def test_each_turn_resends_the_growing_conversation_with_the_call_and_its_result():
    session = AgentToolsWorkload(seed=1, turns_min=4, turns_max=4).take(1)[0]
    sent = conversation(session)
    for prev, cur in zip(sent, sent[1:]):
        # The previous request is a prefix of this one, but for the answer that gained the call.
        assert cur[:len(prev)] == prev
        answer, result, followup = cur[len(prev):]
        assert answer["role"] == "assistant" and answer["tool_calls"][0]["type"] == "function"
        assert result == {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"],
                          "content": result["content"]}
        assert followup["role"] == "user"
    assert len(sent[-1]) == 1 + 1 + 3 * 3


def test_chat_wire_sends_tools_and_tool_messages_unchanged():
    session = AgentToolsWorkload(seed=2, turns_min=2, turns_max=2).take(1)[0]
    last = conversation(session)[-1]
    body = WIRES["chat"].body("demo", last, session.tools, 16, True, True)
    assert body["messages"] == last and body["tools"] == session.tools
    assert body["stream_options"] == {"include_usage": True}


def test_responses_wire_renders_instructions_function_call_and_output_items():
    session = AgentToolsWorkload(seed=2, turns_min=3, turns_max=3).take(1)[0]
    last = conversation(session)[-1]
    body = WIRES["responses"].body("demo", last, session.tools, 16, True, True)
    assert body["instructions"] == session.system and body["max_output_tokens"] == 16 and body["store"] is False
    items = body["input"]
    kinds = [i.get("type", i.get("role")) for i in items]
    assert kinds == ["user", "assistant", "function_call", "function_call_output", "user",
                     "assistant", "function_call", "function_call_output", "user"]
    call, output = items[2], items[3]
    assert call["call_id"] == output["call_id"] == session.turns[1].tool_call.id
    assert call["name"] == session.turns[1].tool_call.name and output["output"] == session.turns[1].tool_output
    assert body["tools"][0] == {"type": "function", **session.tools[0]["function"]}


def test_messages_wire_alternates_roles_with_tool_use_and_tool_result_blocks():
    session = AgentToolsWorkload(seed=2, turns_min=3, turns_max=3).take(1)[0]
    last = conversation(session, answers=["first", "", "third"])[-1]
    body = WIRES["messages"].body("demo", last, session.tools, 16, False, True)
    assert body["system"] == session.system and body["max_tokens"] == 16
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["user", "assistant", "user", "assistant", "user"]
    blocks = [[b["type"] for b in m["content"]] for m in body["messages"]]
    # The second answer was empty: Anthropic refuses empty text blocks, the tool_use stays.
    assert blocks == [["text"], ["text", "tool_use"], ["tool_result", "text"], ["tool_use"], ["tool_result", "text"]]
    use, result = body["messages"][1]["content"][1], body["messages"][2]["content"][0]
    assert use["id"] == result["tool_use_id"] and use["input"] == json.loads(session.turns[1].tool_call.arguments)
    assert body["tools"][0]["input_schema"] == session.tools[0]["function"]["parameters"]


def _stream(api: str, raw: bytes) -> tuple[RequestOutcome, str, bool]:
    client = OpenAIClient(Target(base_url="http://x", api=api))
    out = RequestOutcome(start=0.0)
    parts: list[str] = []
    done = False
    dec = SSEDecoder()
    for i, ev in enumerate(dec.feed(raw) + dec.flush()):
        done = client._event(ev.event, ev.data, float(i + 1), parts, out.token_times, out) or done
    return out, "".join(parts), done


def _sse(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


def test_responses_stream_reads_text_and_input_tokens_details_cached_tokens():
    usage = {"input_tokens": 90, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 64},
             "cost": {"currency": "USD", "total": 0.0000123}}
    raw = (_sse("response.created", {"type": "response.created", "response": {"output": []}})
           + _sse("response.output_text.delta", {"type": "response.output_text.delta", "delta": "Hi"})
           + _sse("response.function_call_arguments.delta",
                  {"type": "response.function_call_arguments.delta", "delta": "{\""})
           + _sse("response.completed", {"type": "response.completed", "response": {"output": [], "usage": usage}}))
    out, text, done = _stream("responses", raw)
    assert done and out.error is None and text == "Hi" and len(out.token_times) == 2
    assert (out.usage.prompt_tokens, out.usage.cached_tokens, out.usage.completion_tokens) == (90, 64, 2)
    assert out.cost == pytest.approx(0.0000123)
    out, _, done = _stream("responses", _sse("error", {"type": "error", "message": "engine died"}))
    assert not done and out.error == "stream_error" and out.error_detail == "engine died"


def test_messages_stream_adds_cache_reads_to_the_uncached_input_tokens():
    raw = (_sse("message_start", {"type": "message_start", "message": {
                "content": [], "usage": {"input_tokens": 26, "cache_read_input_tokens": 64, "output_tokens": 0}}})
           + _sse("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hel"}})
           + _sse("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "lo"}})
           + _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                                    "usage": {"output_tokens": 2, "cache_read_input_tokens": 64,
                                              "cost": {"total": "0.0000050"}}})
           + _sse("message_stop", {"type": "message_stop"}))
    out, text, done = _stream("messages", raw)
    assert done and out.error is None and text == "Hello"
    assert (out.usage.prompt_tokens, out.usage.cached_tokens, out.usage.completion_tokens) == (90, 64, 2)
    assert out.cost == pytest.approx(0.000005)
    out, _, done = _stream("messages", _sse("message_start", {"type": "message_start", "message": {}}))
    assert not done and out.error is None  # no message_stop: the runner reports incomplete_stream


@pytest.mark.parametrize("api,raw,expect", [
    ("chat", {"choices": [{"message": {"content": "ok"}}],
              "usage": {"prompt_tokens": 40, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 32}}},
     ("ok", 40, 32)),
    ("responses", {"output": [{"type": "function_call"}, {"type": "message", "content": [
        {"type": "output_text", "text": "ok"}]}],
        "usage": {"input_tokens": 40, "output_tokens": 1, "input_tokens_details": {"cached_tokens": 32}}},
     ("ok", 40, 32)),
    ("messages", {"content": [{"type": "tool_use"}, {"type": "text", "text": "ok"}],
                  "usage": {"input_tokens": 8, "cache_read_input_tokens": 32, "output_tokens": 1}},
     ("ok", 40, 32)),
])
def test_unary_answers_give_text_prompt_and_cached_tokens_per_api(api, raw, expect):
    text, usage = WIRES[api].answer(msgspec.json.encode(raw))
    assert (text, usage.prompt_tokens, usage.cached_tokens) == expect


def test_target_endpoint_follows_the_wire_format():
    assert [Target(base_url="http://h:1", api=a).endpoint for a in ("chat", "completions", "responses", "messages")] == [
        "http://h:1/v1/chat/completions", "http://h:1/v1/completions", "http://h:1/v1/responses",
        "http://h:1/v1/messages"]
