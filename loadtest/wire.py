"""Wire formats the load tester speaks: one small `Wire` per API, registered by name.

The runner keeps every conversation as OpenAI chat messages (system, user, assistant with
`tool_calls`, tool results); a wire renders them as its API's request body and reads its API's
answers and stream events back into one `WireUsage` (prompt, cached and output tokens, cost).
Where each API reports cached tokens: chat/completions `usage.prompt_tokens_details.cached_tokens`,
Responses `usage.input_tokens_details.cached_tokens`, Messages `usage.cache_read_input_tokens`
(whose `input_tokens` is only the uncached part).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import msgspec


class WireUsage(msgspec.Struct, kw_only=True):
    """Usage in one shape whatever the API; a field an event did not carry is None."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    cost: float | None = None  # usage.cost.total, as the yieldgate gateway adds it

    def merged(self, later: "WireUsage") -> "WireUsage":
        """This usage updated with the fields a later event carries (Messages streams report the
        input on message_start and the output, cache reads and cost on message_delta)."""
        return WireUsage(**{f: getattr(later, f) if getattr(later, f) is not None else getattr(self, f)
                            for f in self.__struct_fields__})


class Piece(NamedTuple):
    """What one stream event meant to the client."""

    token: bool = False  # a generated-token event (TTFT / inter-token timing)
    text: str | None = None
    usage: WireUsage | None = None
    done: bool = False  # the stream's own end marker ([DONE], response.completed, message_stop)
    error: str | None = None


class BadAnswer(ValueError):
    """The body is not this API's answer, or it carries an error."""


class Wire(Protocol):
    name: str
    path: str  # after the /v1 base
    error_marker: bytes  # a stream event name that means the stream failed

    def body(self, model: str, messages: list[dict[str, Any]], tools: list[dict] | None, max_tokens: int,
             stream: bool, include_usage: bool) -> dict[str, Any]: ...

    def answer(self, raw: bytes) -> tuple[str, WireUsage | None]: ...

    def event(self, name: str, data: bytes) -> Piece: ...


# -- shared pieces of the wire schemas (unknown fields are ignored on purpose) ---------------------


class _Cost(msgspec.Struct):
    total: float | str | None = None  # the gateway writes a Decimal; accept it as number or string


class _Error(msgspec.Struct):
    message: str = ""
    type: str | None = None
    code: str | int | None = None


def _cost(c: _Cost | float | None) -> float | None:
    if isinstance(c, _Cost):
        c = c.total  # type: ignore[assignment]
    return float(c) if c is not None else None


def _err_text(err: _Error | str) -> str:
    return err if isinstance(err, str) else err.message


# -- OpenAI chat completions and completions -------------------------------------------------------


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _ChatUsage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None
    cost: _Cost | float | None = None

    def normal(self) -> WireUsage:
        d = self.prompt_tokens_details
        return WireUsage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                         cached_tokens=d.cached_tokens if d else None, cost=_cost(self.cost))


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    message: _Delta | None = None
    text: str | None = None


class _ChatBody(msgspec.Struct):
    """Both a full response and a stream chunk."""

    choices: list[_Choice] = []
    usage: _ChatUsage | None = None
    error: _Error | str | None = None


_decode_chat = msgspec.json.Decoder(_ChatBody).decode


def _choice_text(choice: _Choice) -> str | None:
    d = choice.delta or choice.message
    if d is not None:
        return d.content if d.content is not None else d.reasoning_content
    return choice.text


class ChatWire:
    name = "chat"
    path = "/chat/completions"
    error_marker = b"error"

    def body(self, model: str, messages: list[dict[str, Any]], tools: list[dict] | None, max_tokens: int,
             stream: bool, include_usage: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": stream, "messages": messages}
        if tools:
            body["tools"] = tools
        if stream and include_usage:
            body["stream_options"] = {"include_usage": True}
        return body

    def answer(self, raw: bytes) -> tuple[str, WireUsage | None]:
        try:
            body = _decode_chat(raw)
        except msgspec.DecodeError as exc:
            raise BadAnswer(str(exc)) from exc
        if body.error is not None:
            raise BadAnswer(_err_text(body.error))
        text = (_choice_text(body.choices[0]) or "") if body.choices else ""
        return text, body.usage.normal() if body.usage else None

    def event(self, name: str, data: bytes) -> Piece:
        if data == b"[DONE]":
            return Piece(done=True)
        try:
            chunk = _decode_chat(data)
        except msgspec.DecodeError as exc:
            raise BadAnswer(str(exc)) from exc
        if chunk.error is not None:
            return Piece(error=_err_text(chunk.error))
        usage = chunk.usage.normal() if chunk.usage else None
        if chunk.choices:
            # Like vllm bench serve: every chunk with choices is a token event; the first is TTFT.
            return Piece(token=True, text=_choice_text(chunk.choices[0]), usage=usage)
        return Piece(usage=usage)


class CompletionsWire(ChatWire):
    """Legacy completions: the conversation as a plain, append-only transcript."""

    name = "completions"
    path = "/completions"

    def body(self, model: str, messages: list[dict[str, Any]], tools: list[dict] | None, max_tokens: int,
             stream: bool, include_usage: bool) -> dict[str, Any]:
        body = super().body(model, messages, None, max_tokens, stream, include_usage)
        del body["messages"]
        body["prompt"] = render_transcript(messages)
        return body


def render_transcript(messages: list[dict[str, Any]]) -> str:
    """Completions API: a plain transcript; append-only, so multi-turn prefixes stay cacheable."""
    parts = []
    for m in messages:
        text = m.get("content") or ""
        for call in m.get("tool_calls") or ():
            text += f"\n<tool_call>{call['function']['name']} {call['function']['arguments']}</tool_call>"
        parts.append(f"{m['role'].capitalize()}: {text}")
    return "\n\n".join(parts) + "\n\nAssistant:"


# -- OpenAI Responses --------------------------------------------------------------------------------


class _RespUsage(msgspec.Struct):
    input_tokens: int = 0
    output_tokens: int = 0
    input_tokens_details: _Details | None = None
    cost: _Cost | float | None = None

    def normal(self) -> WireUsage:
        d = self.input_tokens_details
        return WireUsage(prompt_tokens=self.input_tokens, completion_tokens=self.output_tokens,
                         cached_tokens=d.cached_tokens if d else None, cost=_cost(self.cost))


class _RespContent(msgspec.Struct):
    type: str = ""
    text: str | None = None


class _RespItem(msgspec.Struct):
    type: str = ""
    content: list[_RespContent] | None = None


class _Response(msgspec.Struct):
    output: list[_RespItem] = []
    usage: _RespUsage | None = None
    error: _Error | str | None = None


class _RespEvent(msgspec.Struct):
    type: str = ""
    delta: str | None = None
    response: _Response | None = None
    message: str | None = None  # on `error` events


_decode_response = msgspec.json.Decoder(_Response).decode
_decode_resp_event = msgspec.json.Decoder(_RespEvent).decode
# The events that end a Responses stream with a response object and its usage.
_RESPONSE_FINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponsesWire:
    name = "responses"
    path = "/responses"
    error_marker = b"error"

    def body(self, model: str, messages: list[dict[str, Any]], tools: list[dict] | None, max_tokens: int,
             stream: bool, include_usage: bool) -> dict[str, Any]:
        items: list[dict[str, Any]] = []
        instructions = None
        for m in messages:
            role = m["role"]
            if role == "system" and instructions is None and not items:
                instructions = m["content"]
            elif role == "tool":
                items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
            else:
                if m.get("content"):
                    items.append({"role": role, "content": m["content"]})
                for call in m.get("tool_calls") or ():
                    fn = call["function"]
                    items.append({"type": "function_call", "call_id": call["id"], "name": fn["name"],
                                  "arguments": fn["arguments"]})
        # store=False: a load test's conversations are re-sent whole, nothing needs the engine to keep them.
        body: dict[str, Any] = {"model": model, "input": items, "max_output_tokens": max_tokens,
                                "stream": stream, "store": False}
        if instructions is not None:
            body["instructions"] = instructions
        if tools:
            body["tools"] = [{"type": "function", **t["function"]} for t in tools]
        return body

    def answer(self, raw: bytes) -> tuple[str, WireUsage | None]:
        try:
            body = _decode_response(raw)
        except msgspec.DecodeError as exc:
            raise BadAnswer(str(exc)) from exc
        if body.error is not None:
            raise BadAnswer(_err_text(body.error))
        return _response_text(body), body.usage.normal() if body.usage else None

    def event(self, name: str, data: bytes) -> Piece:
        try:
            ev = _decode_resp_event(data)
        except msgspec.DecodeError as exc:
            raise BadAnswer(str(exc)) from exc
        kind = ev.type or name
        if kind.endswith(".delta"):  # output_text, reasoning_text, function_call_arguments ...
            return Piece(token=True, text=ev.delta if kind == "response.output_text.delta" else None)
        if kind in _RESPONSE_FINAL:
            usage = ev.response.usage.normal() if ev.response and ev.response.usage else None
            return Piece(usage=usage, done=True)
        if kind == "error":
            return Piece(error=ev.message or data.decode(errors="replace")[:500])
        return Piece()


def _response_text(body: _Response) -> str:
    return "".join(c.text or "" for item in body.output if item.type == "message"
                   for c in item.content or () if c.type == "output_text")


# -- Anthropic Messages ------------------------------------------------------------------------------


class _MsgUsage(msgspec.Struct):
    input_tokens: int | None = None  # the uncached part only
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cost: _Cost | float | None = None

    def normal(self) -> WireUsage:
        prompt = None
        if self.input_tokens is not None:
            prompt = self.input_tokens + (self.cache_read_input_tokens or 0) + (self.cache_creation_input_tokens or 0)
        return WireUsage(prompt_tokens=prompt, cached_tokens=self.cache_read_input_tokens,
                         completion_tokens=self.output_tokens, cost=_cost(self.cost))


class _MsgBlock(msgspec.Struct):
    type: str = ""
    text: str | None = None


class _Message(msgspec.Struct):
    content: list[_MsgBlock] = []
    usage: _MsgUsage | None = None
    error: _Error | None = None


class _MsgEvent(msgspec.Struct):
    type: str = ""
    message: _Message | None = None
    delta: _MsgBlock | None = None  # content_block_delta: {type: text_delta, text}; message_delta: stop reason
    usage: _MsgUsage | None = None
    error: _Error | None = None


_decode_message = msgspec.json.Decoder(_Message).decode
_decode_msg_event = msgspec.json.Decoder(_MsgEvent).decode


class MessagesWire:
    name = "messages"
    path = "/messages"
    error_marker = b"error"

    def body(self, model: str, messages: list[dict[str, Any]], tools: list[dict] | None, max_tokens: int,
             stream: bool, include_usage: bool) -> dict[str, Any]:
        system: list[str] = []
        out: list[dict[str, Any]] = []

        def add(role: str, block: dict[str, Any]) -> None:
            # Anthropic alternates roles: a tool result and the next user text share one user turn.
            if out and out[-1]["role"] == role:
                out[-1]["content"].append(block)
            else:
                out.append({"role": role, "content": [block]})

        for m in messages:
            role = m["role"]
            if role == "system":
                system.append(m["content"])
            elif role == "tool":
                add("user", {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]})
            else:
                if m.get("content"):  # Anthropic refuses empty text blocks
                    add(role, {"type": "text", "text": m["content"]})
                for call in m.get("tool_calls") or ():
                    fn = call["function"]
                    add(role, {"type": "tool_use", "id": call["id"], "name": fn["name"],
                               "input": msgspec.json.decode(fn["arguments"])})
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": stream, "messages": out}
        if system:
            body["system"] = "\n\n".join(system)
        if tools:
            body["tools"] = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                              "input_schema": t["function"]["parameters"]} for t in tools]
        return body

    def answer(self, raw: bytes) -> tuple[str, WireUsage | None]:
        try:
            body = _decode_message(raw)
        except msgspec.DecodeError as exc:
            raise BadAnswer(str(exc)) from exc
        if body.error is not None:
            raise BadAnswer(body.error.message)
        text = "".join(b.text or "" for b in body.content if b.type == "text")
        return text, body.usage.normal() if body.usage else None

    def event(self, name: str, data: bytes) -> Piece:
        try:
            ev = _decode_msg_event(data)
        except msgspec.DecodeError as exc:
            raise BadAnswer(str(exc)) from exc
        kind = ev.type or name
        if kind == "content_block_delta":
            return Piece(token=True, text=ev.delta.text if ev.delta else None)
        if kind == "message_start":
            usage = ev.message.usage if ev.message else None
            return Piece(usage=usage.normal() if usage else None)
        if kind == "message_delta":
            return Piece(usage=ev.usage.normal() if ev.usage else None)
        if kind == "message_stop":
            return Piece(done=True)
        if kind == "error":
            return Piece(error=ev.error.message if ev.error else data.decode(errors="replace")[:500])
        return Piece()


WIRES: dict[str, Wire] = {w.name: w for w in (ChatWire(), CompletionsWire(), ResponsesWire(), MessagesWire())}


def error_message(raw: bytes) -> str:
    """The message of an error body in OpenAI's or Anthropic's shape (both nest it in `error`)."""
    try:
        body = _decode_chat(raw)
        if body.error is not None:
            return _err_text(body.error)[:500]
    except msgspec.DecodeError:
        pass
    return raw[:500].decode(errors="replace")
