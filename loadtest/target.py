"""Where load goes: an OpenAI-compatible base URL plus the request settings that make a variant."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from .wire import WIRES


class Target(msgspec.Struct, kw_only=True):
    """One variant under test: base URL + model + API flavour + extra body fields.

    Two targets may share a URL and differ only in `model` ("demo" vs "demo:fast") or in
    `extra_body` ({"service_tier": "priority"}); the runner sends identical seeded traffic to each.
    """

    base_url: str
    model: str = "demo"
    name: str = ""
    api: Literal["chat", "completions", "responses", "messages"] = "chat"  # the wire format (loadtest/wire.py)
    stream: bool = True
    extra_body: dict[str, Any] = {}
    headers: dict[str, str] = {}
    api_key: str | None = None
    # Per-request tokens are not counted client-side; ask the server to report usage in streams.
    include_usage: bool = True
    ignore_eos: bool = False  # vLLM extension: always generate max_tokens (benchmarks like vllm bench)

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        extra = ",".join(f"{k}={v}" for k, v in sorted(self.extra_body.items()))
        return f"{self.model}@{self.base_url.split('://')[-1]}" + (f"[{extra}]" if extra else "")

    @property
    def endpoint(self) -> str:
        base = self.base_url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        return base + WIRES[self.api].path
