"""Wire schemas of the OpenAI and Anthropic endpoints the gateway serves.

Decoding validates: handlers receive typed objects. Only the fields the gateway acts on are
declared; every other field of the request body is forwarded to vLLM unchanged.

Every request type answers the same few questions for the proxy and accounting: `output_limit`,
`requested_service_tier` (in OpenAI's vocabulary), `user` and `shows_usage` (whether the client
sees the usage of a stream). Responses and Messages requests also render themselves as chat
messages (`chat_messages`), which is what cache-aware routing tokenizes and budgets estimate.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

PositiveInt = Annotated[int, Meta(ge=1)]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ChatMessage(msgspec.Struct):
    role: Annotated[str, Meta(min_length=1, max_length=64)]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1, max_length=256)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    service_tier: str | None = None
    max_tokens: PositiveInt | None = None
    user: Annotated[str, Meta(max_length=256)] | None = None
    n: Annotated[int, Meta(ge=1, le=16)] | None = None
    temperature: float | None = None  # read by the speculation routing filter

    @property
    def requested_service_tier(self) -> str | None:
        return self.service_tier

    @property
    def shows_usage(self) -> bool:
        # A unary answer always has usage; a stream only if the client asked for it.
        return not self.stream or bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    tools: list[dict[str, Any]] | None = None

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    # str, list[str], list[int] or list[list[int]]; msgspec allows one array type per union.
    prompt: str | list[Any]

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens


def _text_of(content: Any) -> str:
    """The text of a message's content: a string, or the `text` of its parts joined by newlines
    (how vLLM flattens text parts for a string-content chat template)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


class ChatShaped(msgspec.Struct, kw_only=True):
    """A request whose prompt the engine renders through the chat template."""

    def chat_messages(self) -> list[dict[str, str]]:
        raise NotImplementedError


class ResponsesRequest(ChatShaped, kw_only=True):
    """OpenAI's Responses API (`POST /v1/responses`)."""

    model: Annotated[str, Meta(min_length=1, max_length=256)]
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    stream: bool = False
    service_tier: str | None = None
    max_output_tokens: PositiveInt | None = None
    previous_response_id: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    store: bool | None = None
    background: bool | None = None
    user: Annotated[str, Meta(max_length=256)] | None = None
    temperature: float | None = None

    @property
    def output_limit(self) -> int | None:
        return self.max_output_tokens

    @property
    def requested_service_tier(self) -> str | None:
        return self.service_tier

    @property
    def shows_usage(self) -> bool:
        return True  # usage is on the response object and on the final response.completed event

    @property
    def stores(self) -> bool:
        """Whether the engine keeps the response for a later previous_response_id (the API's
        default is to store)."""
        return self.store is not False

    def chat_messages(self) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        for item in self.input:
            role = item.get("role")
            if isinstance(role, str) and item.get("type", "message") == "message":
                messages.append({"role": "system" if role == "developer" else role,
                                 "content": _text_of(item.get("content"))})
        return messages


class AnthropicMessage(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicMetadata(msgspec.Struct):
    user_id: Annotated[str, Meta(max_length=256)] | None = None


class _AnthropicCommon(ChatShaped, kw_only=True):
    model: Annotated[str, Meta(min_length=1, max_length=256)]
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None

    def chat_messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": _text_of(self.system)}] if self.system else []
        return head + [{"role": m.role, "content": _text_of(m.content)} for m in self.messages]


class MessagesRequest(_AnthropicCommon, kw_only=True):
    """Anthropic's Messages API (`POST /v1/messages`)."""

    max_tokens: PositiveInt
    stream: bool = False
    # Anthropic's own values; the fast tier is asked for with the `:fast` model suffix.
    service_tier: Literal["auto", "standard_only"] | None = None
    metadata: AnthropicMetadata | None = None
    temperature: float | None = None

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def requested_service_tier(self) -> str | None:
        return None

    @property
    def user(self) -> str | None:
        return self.metadata.user_id if self.metadata else None

    @property
    def shows_usage(self) -> bool:
        return True  # message_start and message_delta always carry usage


class CountTokensRequest(_AnthropicCommon, kw_only=True):
    """Anthropic's `POST /v1/messages/count_tokens`."""

    @property
    def stream(self) -> bool:
        return False

    @property
    def shows_usage(self) -> bool:
        return True  # nothing streams: the client's bytes go upstream unless the model name changes

    @property
    def user(self) -> str | None:
        return None

    @property
    def temperature(self) -> float | None:
        return None

    @property
    def output_limit(self) -> int | None:
        return None

    @property
    def requested_service_tier(self) -> str | None:
        return None


class ModelCard(msgspec.Struct):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "yieldgate"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
