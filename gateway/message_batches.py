"""Anthropic's Message Batches API (`/v1/messages/batches`), as the official `anthropic` client calls
it: create a job from a list of Messages requests, follow it to `ended`, read its results as JSONL,
list, cancel and delete jobs. Jobs share the Batch API's store and worker (gateway/batch_store.py,
gateway/batch_worker.py): each request runs through the one pipeline as a Messages request at the
batch lane's priority and price. docs/batch.md.

Every request's params are validated at create with the Messages route's own schema and limits; a
bad one refuses the whole job with a 400 that names it. Errors are in Anthropic's shape.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import UTC, datetime
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.responses import Response, StreamingResponse

from .batch_api import COMPLETION_WINDOW_S, LINES_PER_INSERT, Authenticator, Principal, batch_principal, prefix_key
from .batch_store import ANTHROPIC, TERMINAL, BatchRow, BatchStore, DuplicateCustomId, NewLine, new_id
from .config import LaneConfig, RequestLimits
from .errors import APIError, InvalidRequest, NotFound, anthropic_error_response
from .http import json_response, read_body
from .intake import parse_request

ENDPOINT = "/v1/messages"
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder(decimal_format="number").encode
# Anthropic's closed-line results, by why the job closed them.
_CLOSED = {"cancelled": b'{"type":"canceled"}', "expired": b'{"type":"expired"}'}


class MessageBatchRequest(msgspec.Struct):
    custom_id: Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    params: msgspec.Raw                     # validated as the Messages route's request, stored as sent


class CreateMessageBatch(msgspec.Struct):
    requests: list[MessageBatchRequest]


class MessageBatchResultLines:
    """Anthropic's result lines: `{"custom_id", "result": {"type": "succeeded", "message"}}`, or
    `errored` with the route's error (and the line's request id), `canceled`, `expired`."""

    def answered(self, custom_id: str, request_id: str, status: int, body: bytes) -> bytes:
        if status == 200:
            return b'{"custom_id":%s,"result":{"type":"succeeded","message":%s}}' % (_encode(custom_id), body)
        try:
            error = _decode(body)
        except msgspec.DecodeError:
            error = None
        if not isinstance(error, dict) or not isinstance(error.get("error"), dict):
            error = {"type": "error", "error": {"type": "api_error", "message": f"The line's route answered "
                                                                                f"HTTP {status}."}}
        error["request_id"] = request_id
        return _encode({"custom_id": custom_id, "result": {"type": "errored", "error": error}})

    def closed(self, custom_id: str, why: str, cut_off: bool) -> bytes:
        return b'{"custom_id":%s,"result":%s}' % (_encode(custom_id), _CLOSED[why])


class AnthropicRoute(APIRoute):
    """A route that answers every refusal in Anthropic's error shape, as the Messages route does."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as exc:
                return exc.anthropic_response()
            except RequestValidationError as exc:
                problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:3])
                return anthropic_error_response(400, problems)

        return route


def rfc3339(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


async def parse_requests(body: bytes, limits: RequestLimits, max_requests: int) -> list[NewLine]:
    """The job's lines, each request's params checked as the Messages route checks a body;
    InvalidRequest (400) naming the first request that is not one."""
    try:
        spec = msgspec.json.decode(body or b"{}", type=CreateMessageBatch)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}") from None
    if not spec.requests:
        raise InvalidRequest("requests: a batch needs at least one request.")
    if len(spec.requests) > max_requests:
        raise InvalidRequest(f"requests: a batch holds at most {max_requests} requests, not {len(spec.requests)}.")
    seen: set[str] = set()
    lines = []
    for n, request in enumerate(spec.requests):
        name = f"requests.{n} (custom_id {request.custom_id!r})"
        if request.custom_id in seen:
            raise InvalidRequest(f"{name}: custom_id is not unique within the batch.")
        seen.add(request.custom_id)
        params = bytes(request.params)
        if len(params) > limits.max_body_bytes:
            raise InvalidRequest(f"{name}: params exceed {limits.max_body_bytes} bytes.")
        try:
            raw, typed = parse_request("messages", params, limits)
        except InvalidRequest as exc:
            raise InvalidRequest(f"{name}: params: {exc.message}") from None
        if typed.stream:
            raise InvalidRequest(f"{name}: params: stream is not supported in a batch.")
        lines.append(NewLine(n, request.custom_id, params, prefix_key("messages", raw), "pending"))
        if n % LINES_PER_INSERT == LINES_PER_INSERT - 1:
            await asyncio.sleep(0)  # a job of 100,000 requests: other requests are served meanwhile
    return lines


def build_message_batch_router(store: BatchStore, auth: Authenticator, limits: RequestLimits,
                               lanes: LaneConfig) -> APIRouter:
    router = APIRouter(route_class=AnthropicRoute)
    principal = batch_principal(auth, x_api_key=True, refusal="The Message Batches API needs an API key: send "
                                                              "'x-api-key: yg-...'.")

    async def owned(batch_id: str, who: Principal) -> BatchRow:
        b = await store.get_batch(batch_id, ANTHROPIC)
        if b is None or not who.may_see(b.owner):
            raise NotFound(f"No such message batch: {batch_id}")
        return b

    async def message_batch(b: BatchRow, request: Request) -> dict[str, Any]:
        counts = await store.counts(b.id)
        ended = b.status in TERMINAL
        return {
            "id": b.id, "type": "message_batch",
            "processing_status": "ended" if ended else "canceling" if b.status == "cancelling" else "in_progress",
            # Live: a request is counted where it settled as soon as it has.
            "request_counts": {"processing": counts.open, "succeeded": counts.completed,
                               "errored": counts.failed - counts.cancelled - counts.expired,
                               "canceled": counts.cancelled, "expired": counts.expired},
            "created_at": rfc3339(b.created_at), "expires_at": rfc3339(b.expires_at),
            "ended_at": rfc3339(b.completed_at or b.cancelled_at or b.expired_at or b.failed_at),
            "cancel_initiated_at": rfc3339(b.cancelling_at), "archived_at": None,
            "results_url": str(request.url_for("message_batch_results", batch_id=b.id)) if ended else None,
        }

    @router.post("/v1/messages/batches")
    async def create(request: Request, who: Principal = Depends(principal)) -> Response:
        lines = await parse_requests(await read_body(request, lanes.max_file_bytes), limits, lanes.max_batch_requests)
        now = time.time()
        batch = BatchRow(id=new_id("msgbatch_"), owner=who.owner, key_id=who.key.id if who.key else "",
                         input_file_id="", endpoint=ENDPOINT, completion_window="24h", status="in_progress",
                         created_at=now, expires_at=now + COMPLETION_WINDOW_S["24h"], in_progress_at=now,
                         api=ANTHROPIC)

        async def groups() -> AsyncIterator[list[NewLine]]:
            for i in range(0, len(lines), LINES_PER_INSERT):
                yield lines[i:i + LINES_PER_INSERT]

        try:
            batch = await store.create_batch(batch, groups())
        except DuplicateCustomId:
            raise InvalidRequest("requests: each custom_id must be unique within the batch.") from None
        return json_response(await message_batch(batch, request))

    @router.get("/v1/messages/batches")
    async def list_batches(request: Request, limit: int = 20, after_id: str | None = None,
                           before_id: str | None = None, who: Principal = Depends(principal)) -> Response:
        if not 1 <= limit <= 1000:
            raise InvalidRequest("limit must be between 1 and 1000.")
        if after_id and before_id:
            raise InvalidRequest("Give after_id or before_id, not both.")
        rows = await store.list_batches(None if who.admin else who.owner, limit, api=ANTHROPIC,
                                        after=after_id, before=before_id)
        page = [await message_batch(b, request) for b in rows[:limit]]
        return json_response({"data": page, "has_more": len(rows) > limit,
                              "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None})

    @router.get("/v1/messages/batches/{batch_id}")
    async def retrieve(batch_id: str, request: Request, who: Principal = Depends(principal)) -> Response:
        return json_response(await message_batch(await owned(batch_id, who), request))

    @router.post("/v1/messages/batches/{batch_id}/cancel")
    async def cancel(batch_id: str, request: Request, who: Principal = Depends(principal)) -> Response:
        b = await owned(batch_id, who)
        if b.status in TERMINAL:
            raise InvalidRequest(f"Message batch {b.id} has ended: there is nothing left to cancel.")
        return json_response(await message_batch(await store.cancel(b.id) or b, request))

    @router.delete("/v1/messages/batches/{batch_id}")
    async def delete(batch_id: str, who: Principal = Depends(principal)) -> Response:
        b = await owned(batch_id, who)
        if b.status not in TERMINAL or not await store.delete_batch(b.id):
            raise InvalidRequest(f"Message batch {b.id} is still processing: cancel it, and delete it once "
                                 "it has ended.")
        return json_response({"id": b.id, "type": "message_batch_deleted"})

    @router.get("/v1/messages/batches/{batch_id}/results", name="message_batch_results")
    async def results(batch_id: str, who: Principal = Depends(principal)) -> Response:
        b = await owned(batch_id, who)
        if b.status not in TERMINAL:
            raise InvalidRequest(f"Message batch {b.id} is still processing: its results are ready once "
                                 "processing_status is 'ended'.")
        return StreamingResponse(store.results(b.id), media_type="application/x-jsonl")

    return router
