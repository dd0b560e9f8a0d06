"""Tool calling end to end: the demo engines run vLLM's `hermes` tool parser and a chat template that
renders tools, calls and results; the official `openai` and `anthropic` clients call tools through
the gateway on chat completions, Responses and Messages, unary and streamed.

The demo model is random: with tool_choice auto it writes text, never a <tool_call>. With
required / named (Anthropic: any / tool), vLLM constrains decoding to a call of a listed tool, so
those answers carry tool calls whose names are the tools'. The arguments are what the random model
writes inside that constraint (on vLLM CPU 0.32 a JSON value, not always an object of the schema);
only their being JSON is asserted. Every answer's cost equals its single ledger row's.
"""

from __future__ import annotations

import json
from decimal import Decimal

import anthropic
import openai
import pytest

from test_agent_routes import money, only_row, rid
from yieldgate.cache import Tokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False}}},
]
NAMES = {t["function"]["name"] for t in TOOLS}
RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"]} for t in TOOLS]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Enough for the constrained call to close; greedy, so every run decodes the same call.
MAX = 200
# The installed anthropic client has no `temperature` argument; the engine takes it from the body.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(stack):
    return anthropic.Anthropic(base_url=stack.gateway_url, api_key="unused", max_retries=0, timeout=120)


def billed_once(stack, request_id: str, cost: dict, prompt: int, output: int) -> None:
    row = only_row(stack, request_id)
    assert row["status"] == "ok"
    assert (int(row["prompt_tokens"]), int(row["completion_tokens"])) == (prompt, output)
    assert money(cost["total"]) == Decimal(row["cost_total"]) > 0


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


# -- chat completions ------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["auto", "required", "named"])
def test_chat_tool_choice(stack, oai, choice):
    request_id = rid("chat-tools")
    resp = oai.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice=choice,
                                       max_tokens=MAX, temperature=0, extra_headers={"x-request-id": request_id})
    message = resp.choices[0].message
    if choice == "auto":  # the random model answers in text
        assert message.tool_calls in (None, []) and message.content
    else:
        calls = message.tool_calls
        assert calls, message
        assert {c.function.name for c in calls} <= ({"get_time"} if isinstance(choice, dict) else NAMES)
        assert all(c.id and c.type == "function" for c in calls)
        # "length": the random model may leave the constrained array of calls open to the limit;
        # the calls it closed are still parsed and relayed.
        assert resp.choices[0].finish_reason in ("tool_calls", "stop", "length")
        assert all(is_json(c.function.arguments) for c in calls)
    billed_once(stack, request_id, resp.usage.model_extra["cost"], resp.usage.prompt_tokens,
                resp.usage.completion_tokens)


def test_chat_tool_results_in_a_later_turn_are_rendered_and_routed(stack, oai):
    first = oai.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="required",
                                        max_tokens=MAX, extra_body=GREEDY)
    calls = first.choices[0].message.tool_calls
    turn = ASK + [first.choices[0].message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": f"result {i}: 21 C, clear"} for i, c in enumerate(calls)]
    request_id = rid("chat-tool-result")
    resp = oai.chat.completions.create(model="demo", messages=turn, tools=TOOLS, max_tokens=5,
                                       extra_headers={"x-request-id": request_id})
    tok = Tokenizer.from_model_dir(stack.model_dir)
    text = tok.render_chat(turn, TOOLS)
    assert "<tool_response>\nresult 0: 21 C, clear\n</tool_response>" in text and "<tool_call>\n{" in text
    # The engine's prompt is exactly the gateway's rendering of it: what cache-aware routing keys on.
    assert resp.usage.prompt_tokens == len(tok.encode_chat(turn, TOOLS)) > first.usage.prompt_tokens
    billed_once(stack, request_id, resp.usage.model_extra["cost"], resp.usage.prompt_tokens,
                resp.usage.completion_tokens)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_chat_stream_tool_call_deltas(stack, oai, choice):
    request_id = rid("chat-tools-stream")
    chunks = list(oai.chat.completions.create(
        model="demo:fast", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=MAX, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_headers={"x-request-id": request_id}))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) >= 2  # the name first, then the arguments in pieces
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"name": "", "arguments": ""})
        if d.function and d.function.name:
            call["name"] += d.function.name
        if d.function and d.function.arguments:
            call["arguments"] += d.function.arguments
    assert calls and {c["name"] for c in calls.values()} <= (NAMES if choice == "required" else {"get_weather"})
    usage = chunks[-1].usage
    billed_once(stack, request_id, usage.model_extra["cost"], usage.prompt_tokens, usage.completion_tokens)


def test_parallel_tool_calls_with_required(stack, oai):
    """`required` lets the engine return several calls (a JSON array of at least one); the gateway
    relays them all, ids distinct. parallel_tool_calls=false caps the array at one."""
    many = oai.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=MAX, extra_body=GREEDY)
    one = oai.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=MAX, temperature=0)
    ids = [c.id for c in many.choices[0].message.tool_calls]
    assert len(ids) == len(set(ids)) >= 1
    assert len(one.choices[0].message.tool_calls) == 1
    print(f"\n[tools] required: {len(ids)} call(s) in one answer")


# -- Responses -------------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "name": "get_time"}],
                         ids=["auto", "required", "named"])
def test_responses_tool_choice(stack, oai, choice):
    request_id = rid("resp-tools")
    resp = oai.responses.create(model="demo", input="What is the weather in Paris?", tools=RESPONSES_TOOLS,
                                tool_choice=choice, max_output_tokens=MAX, temperature=0, store=False,
                                extra_headers={"x-request-id": request_id})
    calls = [o for o in resp.output if o.type == "function_call"]
    if choice == "auto":
        assert not calls and resp.output_text
    else:
        assert calls and {c.name for c in calls} <= ({"get_time"} if isinstance(choice, dict) else NAMES)
        assert all(c.call_id and is_json(c.arguments) for c in calls)
    u = resp.usage
    billed_once(stack, request_id, u.model_extra["cost"], u.input_tokens, u.output_tokens)


def test_responses_function_call_output_in_a_later_turn(stack, oai):
    first = oai.responses.create(model="demo", input="Weather in Rome?", tools=RESPONSES_TOOLS,
                                 tool_choice="required", max_output_tokens=MAX, temperature=0, store=False)
    calls = [o for o in first.output if o.type == "function_call"]
    turn = [{"role": "user", "content": "Weather in Rome?"}]
    for c in calls:
        turn.append({"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments})
        turn.append({"type": "function_call_output", "call_id": c.call_id, "output": "18 C, rain"})
    request_id = rid("resp-tool-result")
    resp = oai.responses.create(model="demo", input=turn, tools=RESPONSES_TOOLS, max_output_tokens=4,
                                store=False, extra_headers={"x-request-id": request_id})
    assert resp.usage.input_tokens > first.usage.input_tokens  # the call and its output are in the prompt
    billed_once(stack, request_id, resp.usage.model_extra["cost"], resp.usage.input_tokens,
                resp.usage.output_tokens)


def test_responses_stream_function_call_arguments_deltas(stack, oai):
    request_id = rid("resp-tools-stream")
    events = list(oai.responses.create(model="demo", input="Time in Paris?", tools=RESPONSES_TOOLS,
                                       tool_choice="required", max_output_tokens=MAX, temperature=0,
                                       store=False, stream=True, extra_headers={"x-request-id": request_id}))
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas
    final = events[-1]
    assert final.type == "response.completed"
    calls = [o for o in final.response.output if o.type == "function_call"]
    assert calls and {c.name for c in calls} <= NAMES
    assert "".join(d.delta for d in deltas) == "".join(c.arguments for c in calls)
    u = final.response.usage
    billed_once(stack, request_id, u.model_extra["cost"], u.input_tokens, u.output_tokens)


# -- Anthropic Messages ----------------------------------------------------------------------------


def prompt_of(u) -> int:
    """Anthropic's input_tokens is the uncached part of the prompt."""
    return u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)


@pytest.mark.parametrize("choice", [{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_time"}],
                         ids=["auto", "any", "named"])
def test_messages_tool_choice(stack, claude, choice):
    """Unary Messages with a forced call has three true outcomes with the random model, over a few
    sampled seeds: a tool_use of a listed tool; text, when the model leaves its <tool_call> unclosed
    at the limit; or vLLM refusing its own answer (400, "Input should be a valid dictionary") when
    the call's input is not a JSON object. The gateway relays each as the engine answers it, the 400
    in Anthropic's shape and unbilled (one `upstream_400` row, cost 0), the others billed once."""
    outcomes = set()
    for seed in range(4):
        request_id = rid("msg-tools")
        try:
            msg = claude.messages.create(model="demo", messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice=choice,
                                         max_tokens=MAX, extra_body={"seed": seed},
                                         extra_headers={"x-request-id": request_id})
        except anthropic.BadRequestError as exc:
            assert choice["type"] != "auto"
            assert exc.body["type"] == "error" and exc.body["error"]["type"] == "invalid_request_error"
            assert "valid dictionary" in exc.body["error"]["message"]
            row = only_row(stack, request_id)
            assert row["status"] == "upstream_400" and Decimal(row["cost_total"]) == 0
            outcomes.add("refused")
            continue
        uses = [b for b in msg.content if b.type == "tool_use"]
        if uses:
            assert choice["type"] != "auto" and msg.stop_reason == "tool_use"
            assert {b.name for b in uses} <= ({"get_time"} if choice["type"] == "tool" else NAMES)
            outcomes.add("tool_use")
        else:
            assert msg.content[0].type == "text"
            outcomes.add("text")
        billed_once(stack, request_id, msg.usage.model_extra["cost"], prompt_of(msg.usage), msg.usage.output_tokens)
    print(f"\n[tools] messages tool_choice={choice['type']}: {sorted(outcomes)}")


def test_messages_tool_result_in_a_later_turn(stack, claude):
    turn = ASK + [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking both."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {"zone": "CET"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C, clear"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "14:05"}]}]}]
    request_id = rid("msg-tool-result")
    msg = claude.messages.create(model="demo", messages=turn, tools=ANTHROPIC_TOOLS, max_tokens=4,
                                 extra_headers={"x-request-id": request_id})
    without = claude.messages.count_tokens(model="demo", messages=ASK, tools=ANTHROPIC_TOOLS)
    assert prompt_of(msg.usage) > without.input_tokens  # the calls and their results are in the prompt
    billed_once(stack, request_id, msg.usage.model_extra["cost"], prompt_of(msg.usage), msg.usage.output_tokens)


def test_messages_stream_input_json_deltas(stack, claude):
    request_id = rid("msg-tools-stream")
    with claude.messages.stream(model="demo:fast", messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
                                max_tokens=MAX, extra_body=GREEDY, extra_headers={"x-request-id": request_id}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    deltas = [e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert starts and {e.content_block.name for e in starts} <= NAMES
    assert deltas
    delta = next(e for e in events if e.type == "message_delta")
    assert final.stop_reason in ("tool_use", "max_tokens")
    billed_once(stack, request_id, delta.usage.model_extra["cost"], prompt_of(delta.usage), delta.usage.output_tokens)
