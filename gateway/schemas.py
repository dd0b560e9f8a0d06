"""Wire schemas of the OpenAI endpoints the gateway serves.

Decoding validates: handlers receive typed objects. Only the fields the gateway acts on are
declared; every other field of the request body is forwarded to vLLM unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any

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


class ModelCard(msgspec.Struct):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "yieldgate"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
