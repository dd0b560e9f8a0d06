"""A JSON answer for the inference hot path.

Starlette's Response builds its header list from a dict on every request (lower-casing, encoding,
guessing a charset); the proxy already knows its headers as bytes, so it hands over the list itself.
It is still a Starlette Response, so FastAPI routes and exception handlers can return it.
"""

from __future__ import annotations

from typing import Any, Sequence

from starlette.responses import Response

from .context import RequestContext

_JSON = (b"content-type", b"application/json")


class JSONReply(Response):
    media_type = "application/json"

    def __init__(self, body: bytes, headers: Sequence[tuple[bytes, bytes]] = (), status_code: int = 200):
        self.body = body
        self.status_code = status_code
        self.background = None
        self.raw_headers = [(b"content-length", b"%d" % len(body)), _JSON, *headers]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body})


def yieldgate_headers(ctx: RequestContext) -> list[tuple[bytes, bytes]]:
    """The x-yieldgate-* response headers of a request, as a raw header list."""
    headers = [
        (b"x-request-id", ctx.request_id.encode("latin-1")),
        (b"x-yieldgate-tier", ctx.tier.encode("latin-1")),
        (b"x-yieldgate-replica", ctx.replica_name.encode("latin-1")),
        (b"x-yieldgate-weight-version", ctx.weight_version.encode("latin-1")),
        (b"x-yieldgate-predicted-cached-tokens", b"%d" % ctx.predicted_cached_tokens),
    ]
    if ctx.requested_tier:
        headers.append((b"x-yieldgate-requested-tier", ctx.requested_tier.encode("latin-1")))
    if ctx.requested_model:  # an alias, `auto`, or a model that fell back to this one
        headers.append((b"x-yieldgate-model", ctx.model.encode("latin-1")))
        headers.append((b"x-yieldgate-requested-model", ctx.requested_model.encode("latin-1")))
    if ctx.auto_reason:
        headers.append((b"x-yieldgate-auto", ctx.auto_reason.encode("latin-1")))
    if ctx.priced_tier:
        headers.append((b"x-yieldgate-priced-tier", ctx.priced_tier.encode("latin-1")))
    if ctx.cost_header:
        headers.append((b"x-yieldgate-cost-usd", ctx.cost_header.encode("latin-1")))
    if ctx.reservation is not None and ctx.reservation.over_soft_budget:
        headers.append((b"x-yieldgate-budget", b"soft-exceeded"))
    return headers
