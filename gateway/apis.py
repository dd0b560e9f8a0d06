"""The inference APIs the proxy serves, one `Api` each: its upstream path and request schema, where
its answers carry usage, how the gateway adds tier and cost to them, and the shape of its errors.
The request path (gateway/exchange.py) is the same for all of them.

Streams: `final_marker` finds the events that may carry the final usage and `is_final` tells which
one does (the one event the relay decodes and rewrites); `generated` reads the text of relayed events,
which bills a stream cut short (gateway/relay.py).
"""

from __future__ import annotations

from typing import Any, Iterator

import msgspec
from starlette.responses import Response

from yieldgate.pricing import Usage

from .context import RequestContext
from .errors import (APIError, anthropic_error_body, anthropic_error_response, anthropic_status, error_body)
from .schemas import (ChatCompletionRequest, CompletionRequest, CountTokensRequest, MessagesRequest,
                      ResponsesRequest)
from .sse import DONE, EVENT_END, data_event, events
from .tiers import BATCH, response_service_tier

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder(decimal_format="number").encode
# Anthropic's usage.service_tier vocabulary.
_ANTHROPIC_SERVICE_TIER = {"standard": "standard", "fast": "priority"}


def _int(value: Any) -> int:
    return value if isinstance(value, int) and value > 0 else 0


def _usage(wire: Any, prompt: str, details: str, completion: str) -> Usage:
    """OpenAI's shape of usage (chat, completions, Responses): the prompt's tokens, their cached
    part in `details`.cached_tokens, the completion's tokens."""
    if not isinstance(wire, dict):
        return Usage()
    part = wire.get(details)
    cached = part.get("cached_tokens") if isinstance(part, dict) else 0
    return Usage.reported(_int(wire.get(prompt)), _int(cached), _int(wire.get(completion)))


class Api:
    """OpenAI's chat completions and completions: usage in `usage` (prompt_tokens_details for the
    cached part), streamed in a final `data:` chunk without choices."""

    name = "chat"
    path = "/v1/chat/completions"
    request: type = ChatCompletionRequest
    final_marker = b'"usage":{'
    event_prefix = b"data: {"
    # The final usage event has no choices; a client that asked for
    # `stream_options.continuous_usage_stats` gets a running usage in every content event too.
    final_shape = b'"choices":[]'

    def is_final(self, event: bytes) -> bool:
        """Whether this event carries the stream's final usage."""
        return event.startswith(self.event_prefix) and self.final_marker in event and self.final_shape in event

    def generated(self, relayed: bytes) -> tuple[list[str], int]:
        """The text that relayed stream events carried, one string per choice (or output block), and
        how many content events there were (each carries at least one token; its text can be empty
        while a multi-byte character is incomplete)."""
        pieces: dict[Any, list[str]] = {}
        content_events = 0
        for event in events(relayed):
            at = event.find(b"data: {")
            if at < 0:
                continue  # [DONE]
            try:
                data = _decode(event[at + 6:])
            except msgspec.DecodeError:
                continue
            content = False
            for key, text in self._texts(data) if isinstance(data, dict) else ():
                if isinstance(text, str):
                    pieces.setdefault(key, []).append(text)
                    content = True
            content_events += content
        return ["".join(p) for p in pieces.values()], content_events

    def _texts(self, event: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
        """(choice or block, text) for each generated text an event carries."""
        for choice in event.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict) or (delta.get("role") and not delta.get("content")):
                continue  # the first event of a chat stream only announces the role
            i = choice.get("index")
            yield i, delta.get("content")
            yield i, delta.get("reasoning") or delta.get("reasoning_content")
            for call in delta.get("tool_calls") or ():
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    yield i, function.get("name")
                    yield i, function.get("arguments")

    def usage(self, answer: dict[str, Any]) -> Usage:
        """The usage of a unary answer (or of the final stream event)."""
        return _usage(answer.get("usage"), "prompt_tokens", "prompt_tokens_details", "completion_tokens")

    def final_usage(self, event: dict[str, Any]) -> Usage:
        return self.usage(event)

    def decorate(self, answer: dict[str, Any], ctx: RequestContext, usage: Usage, extra: dict[str, Any]) -> None:
        answer["service_tier"] = response_service_tier(ctx.tier, ctx.lane)
        answer["system_fingerprint"] = f"yieldgate-{ctx.weight_version}"
        _add_to_usage(answer, "prompt_tokens_details", usage, extra)

    def decorate_final(self, event: dict[str, Any], ctx: RequestContext, usage: Usage,
                       extra: dict[str, Any]) -> None:
        self.decorate(event, ctx, usage, extra)

    def error(self, exc: APIError) -> Response:
        return exc.response()

    def upstream_error(self, status: int, data: bytes) -> Response:
        """Pass the engine's OpenAI-shaped error through; wrap anything else."""
        try:
            body = _decode(data)
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                err = body["error"]
                code = err.get("code")
                return Response(error_body(str(err.get("message", "")),
                                           "invalid_request_error" if status < 500 else "upstream_error",
                                           err.get("param"), code if isinstance(code, str) else None),
                                status_code=status if status < 500 else 502, media_type="application/json")
        except msgspec.DecodeError:
            pass
        return self.error(APIError(f"Upstream replica answered HTTP {status}.",
                                   status=502 if status >= 500 else status, code="upstream_error"))

    def stream_error(self, message: str) -> bytes:
        """How a stream ends when its engine fails mid-way."""
        return data_event(error_body(message, "upstream_error", None, "upstream_error")) + DONE


class CompletionsApi(Api):
    name = "completions"
    path = "/v1/completions"
    request = CompletionRequest

    def _texts(self, event: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
        for choice in event.get("choices") or ():
            if isinstance(choice, dict):
                yield choice.get("index"), choice.get("text")


class ResponsesApi(Api):
    """OpenAI's Responses API: usage as input_tokens (input_tokens_details.cached_tokens) and
    output_tokens on the response object; a stream's final event is `response.completed`."""

    name = "responses"
    path = "/v1/responses"
    request = ResponsesRequest
    final_marker = b"event: response.completed\n"
    event_prefix = b"event: "
    final_shape = b""

    def _texts(self, event: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
        # response.output_text.delta, reasoning_text.delta, function_call_arguments.delta, ...
        if str(event.get("type", "")).endswith(".delta"):
            yield event.get("output_index"), event.get("delta")

    def usage(self, answer: dict[str, Any]) -> Usage:
        return _usage(answer.get("usage"), "input_tokens", "input_tokens_details", "output_tokens")

    def final_usage(self, event: dict[str, Any]) -> Usage:
        response = event.get("response")
        return self.usage(response) if isinstance(response, dict) else Usage()

    def decorate(self, answer: dict[str, Any], ctx: RequestContext, usage: Usage, extra: dict[str, Any]) -> None:
        answer["service_tier"] = response_service_tier(ctx.tier, ctx.lane)
        _add_to_usage(answer, "input_tokens_details", usage, extra)

    def decorate_final(self, event: dict[str, Any], ctx: RequestContext, usage: Usage,
                       extra: dict[str, Any]) -> None:
        response = event.get("response")
        if isinstance(response, dict):
            self.decorate(response, ctx, usage, extra)

    def upstream_error(self, status: int, data: bytes) -> Response:
        if status == 404 and b"not found" in data:
            # vLLM keeps stored responses in memory: an engine that restarted has forgotten them.
            try:
                message = str(_decode(data)["error"]["message"])
            except (msgspec.DecodeError, KeyError, TypeError):
                message = "Previous response not found."
            return Response(error_body(f"Previous response not found: {message}", "invalid_request_error",
                                       "previous_response_id", "previous_response_not_found"),
                            status_code=404, media_type="application/json")
        return super().upstream_error(status, data)

    def stream_error(self, message: str) -> bytes:
        return b"event: error\ndata: " + _encode(
            {"type": "error", "code": "upstream_error", "message": message, "param": None}) + EVENT_END


class MessagesApi(Api):
    """Anthropic's Messages API: usage as input_tokens (the uncached part), cache_read_input_tokens,
    cache_creation_input_tokens and output_tokens; streamed on message_start and, final, on
    message_delta. Errors in Anthropic's shape."""

    name = "messages"
    path = "/v1/messages"
    request = MessagesRequest
    final_marker = b"event: message_delta\n"
    event_prefix = b"event: "
    final_shape = b""

    def _texts(self, event: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
        delta = event.get("delta") if event.get("type") == "content_block_delta" else None
        if isinstance(delta, dict):  # text_delta, input_json_delta, thinking_delta
            yield event.get("index"), delta.get("text") or delta.get("partial_json") or delta.get("thinking")

    def usage(self, answer: dict[str, Any]) -> Usage:
        u = answer.get("usage")
        if not isinstance(u, dict):
            return Usage()
        cached = _int(u.get("cache_read_input_tokens"))
        prompt = _int(u.get("input_tokens")) + cached + _int(u.get("cache_creation_input_tokens"))
        return Usage.reported(prompt, cached, _int(u.get("output_tokens")))

    def decorate(self, answer: dict[str, Any], ctx: RequestContext, usage: Usage, extra: dict[str, Any]) -> None:
        wire = answer.get("usage")
        if isinstance(wire, dict):
            wire["cache_read_input_tokens"] = usage.cached_tokens
            # A Message Batches line says "batch", as Anthropic's do.
            wire["service_tier"] = BATCH if ctx.lane == BATCH else _ANTHROPIC_SERVICE_TIER.get(ctx.tier, "standard")
            wire.update(extra)

    def error(self, exc: APIError) -> Response:
        return exc.anthropic_response()

    def upstream_error(self, status: int, data: bytes) -> Response:
        """vLLM answers these routes in Anthropic's shape already; keep the message, set the type
        from the status as Anthropic does."""
        message = f"Upstream replica answered HTTP {status}."
        try:
            body = _decode(data)
            err = body.get("error") if isinstance(body, dict) else None
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                message = err["message"]
        except msgspec.DecodeError:
            pass
        return anthropic_error_response(status if status < 500 else 502, message)

    def stream_error(self, message: str) -> bytes:
        return b"event: error\ndata: " + anthropic_error_body(anthropic_status(502), message) + EVENT_END


class CountTokensApi(MessagesApi):
    """Anthropic's token count: answered by an engine, not billed (it generates nothing)."""

    name = "count_tokens"
    path = "/v1/messages/count_tokens"
    request = CountTokensRequest


APIS: dict[str, Api] = {api.name: api for api in (Api(), CompletionsApi(), ResponsesApi(), MessagesApi(),
                                                  CountTokensApi())}
# The inference routes, served straight from ASGI (gateway/app.py).
ROUTES: dict[str, str] = {api.path: api.name for api in APIS.values()}
ANTHROPIC = frozenset({"messages", "count_tokens"})


def _add_to_usage(answer: dict[str, Any], details_key: str, usage: Usage, extra: dict[str, Any]) -> None:
    """The cached tokens the gateway billed, and its cost fields, into the answer's `usage`."""
    wire = answer.get("usage")
    if isinstance(wire, dict):
        details = wire.get(details_key)
        if not isinstance(details, dict):
            details = wire[details_key] = {}
        details["cached_tokens"] = usage.cached_tokens
        wire.update(extra)
