"""OpenAI's Files and Batches APIs (`/v1/files`, `/v1/batches`), as the official client calls them:
upload a JSONL file of requests with purpose `batch`, create a batch over it, follow its status,
read its output and error files. State lives in PostgreSQL (gateway/batch_store.py); the lines run
through the request pipeline at batch priority (gateway/batch_worker.py). docs/batch.md. Anthropic's
Message Batches (gateway/message_batches.py) share the store, the worker and the helpers here.

A key sees only its own files and batches (another's are 404); the admin credential sees all.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from fastapi import APIRouter, Depends, Request
from starlette.datastructures import UploadFile
from starlette.responses import Response, StreamingResponse

from yieldgate.pricing import ApiKey

from .apis import ROUTES
from .batch_store import CHUNK_BYTES, BatchRow, BatchStore, DuplicateCustomId, FileRow, NewLine, new_id
from .errors import AuthenticationError, InvalidRequest, NotFound, PayloadTooLarge
from .http import bearer_token, decode_body, json_response

# The endpoints a batch's lines may call, by the API that serves them.
BATCH_ENDPOINTS = {path: kind for path, kind in ROUTES.items() if kind in ("chat", "completions", "responses")}
COMPLETION_WINDOW_S = {"24h": 24 * 3600}
LINES_PER_INSERT = 500
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder(decimal_format="number").encode


@dataclass(slots=True)
class Principal:
    """Who calls: an API key (owner = its id) or the admin credential (sees every owner's)."""

    owner: str
    key: ApiKey | None = None
    admin: bool = False

    def may_see(self, owner: str) -> bool:
        return self.admin or owner == self.owner


class Authenticator(Protocol):
    """What tells an API key or the admin credential (gateway/accounting.py `Accounting`)."""

    def is_admin_token(self, token: str) -> bool: ...

    async def authenticate_header(self, raw: bytes | None) -> ApiKey | None: ...


def batch_principal(auth: Authenticator, x_api_key: bool = False,
                    refusal: str = "The Files and Batches APIs need an API key: send 'Authorization: Bearer yg-...'."
                    ) -> Callable[[Request], Any]:
    """The routes' dependency: an API key or the admin token; batch endpoints always need one.
    `x_api_key`: also as Anthropic's clients send it (`x-api-key`), as on the Messages route."""
    async def principal(request: Request) -> Principal:
        raw = request.headers.get("authorization")
        if x_api_key and "x-api-key" in request.headers:
            raw = "Bearer " + request.headers["x-api-key"]
        if auth.is_admin_token(bearer_token(raw)):
            return Principal(owner="admin", admin=True)
        key = await auth.authenticate_header(raw.encode("latin-1") if raw else None)
        if key is None:
            raise AuthenticationError(refusal)
        return Principal(owner=key.id, key=key)

    return principal


class CreateBatch(msgspec.Struct, forbid_unknown_fields=False):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def file_object(f: FileRow) -> dict[str, Any]:
    return {"id": f.id, "object": "file", "bytes": f.bytes, "created_at": int(f.created_at),
            "filename": f.filename, "purpose": f.purpose, "status": "processed", "status_details": None,
            "expires_at": None}


def line_error(custom_id: str | None, code: str, message: str, line: int | None = None) -> bytes:
    """An error-file line for a line that never ran (unreadable, cancelled, expired)."""
    return _encode({"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
                    "error": {"code": code, "message": message, **({"line": line} if line is not None else {})}})


class ResultLines(Protocol):
    """How a job's API writes a line's result (the worker writes one per line, once)."""

    def answered(self, custom_id: str, request_id: str, status: int, body: bytes) -> bytes:
        """The route's answer (status, body) to the line."""
        ...

    def closed(self, custom_id: str, why: str, cut_off: bool) -> bytes:
        """A line the job's cancel or expiry (`why`: "cancelled", "expired") ended unanswered;
        `cut_off`: it was running then, and is not billed."""
        ...


_CLOSED = {"cancelled": ("batch_cancelled", "The batch was cancelled before this line ran."),
           "expired": ("batch_expired", "The batch expired before this line ran.")}


class BatchResultLines:
    """OpenAI's output and error file lines: `{"id", "custom_id", "response": {"status_code",
    "request_id", "body"}, "error"}`."""

    def answered(self, custom_id: str, request_id: str, status: int, body: bytes) -> bytes:
        return (b'{"id":"%s","custom_id":%s,"response":{"status_code":%d,"request_id":"%s","body":%s},"error":null}'
                % (request_id.encode(), _encode(custom_id), status, request_id.encode(), body))

    def closed(self, custom_id: str, why: str, cut_off: bool) -> bytes:
        code, message = _CLOSED[why]
        return line_error(custom_id, code, message + (" It was cut off while running and is not billed."
                                                       if cut_off else ""))


def prefix_key(kind: str, body: dict[str, Any]) -> int:
    """What a line shares with its neighbours: the messages before the last one (system prompt,
    shared documents), or the start of a completion prompt. Lines are claimed in this order so
    a job's shared prefix is prefilled once per replica, then hit in its cache."""
    if kind == "completions":
        shared: Any = body.get("prompt")
        shared = shared[:2048] if isinstance(shared, str) else shared
    elif kind == "messages":  # Anthropic's system prompt is beside the messages
        messages = body.get("messages")
        shared = [body.get("system"), body.get("tools"), messages[:-1] if isinstance(messages, list) else None]
    elif kind == "responses":
        shared = [body.get("instructions"), body.get("input")[:-1] if isinstance(body.get("input"), list) else None]
    else:
        messages = body.get("messages")
        shared = messages[:-1] if isinstance(messages, list) and len(messages) > 1 else messages
    digest = hashlib.blake2b(_encode(shared), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


async def read_lines(chunks: AsyncIterator[bytes], max_line: int) -> AsyncIterator[bytes | None]:
    """The file's lines (None for one past `max_line` bytes), read chunk by chunk."""
    rest = b""
    async for chunk in chunks:
        rest += chunk
        *lines, rest = rest.split(b"\n")
        for line in lines:
            yield line if len(line) <= max_line else None
        if len(rest) > max_line:
            raise InvalidRequest(f"A line of the input file is longer than {max_line} bytes.",
                                 param="input_file_id", code="invalid_file")
    if rest.strip():
        yield rest


def parse_line(raw: bytes | None, n: int, endpoint: str) -> NewLine:
    """One input line as a job line: pending, or failed at once with the reason in its error line."""
    kind = BATCH_ENDPOINTS[endpoint]
    if raw is None:
        return NewLine(n, None, None, 0, "failed", line_error(None, "invalid_request", "Line too long.", n + 1))
    try:
        doc = _decode(raw)
    except msgspec.DecodeError as exc:
        return NewLine(n, None, None, 0, "failed",
                       line_error(None, "invalid_json_line", f"Line {n + 1} is not valid JSON: {exc}", n + 1))
    custom_id = doc.get("custom_id") if isinstance(doc, dict) else None
    if not isinstance(custom_id, str) or not custom_id:
        return NewLine(n, None, None, 0, "failed",
                       line_error(None, "missing_custom_id", f"Line {n + 1} has no custom_id string.", n + 1))
    problem = None
    if doc.get("method", "POST") != "POST":
        problem = "method must be POST"
    elif doc.get("url") != endpoint:
        problem = f"url must be the batch's endpoint {endpoint!r}, not {doc.get('url')!r}"
    elif not isinstance(doc.get("body"), dict):
        problem = "body must be a JSON object"
    elif doc["body"].get("stream"):
        problem = "stream is not supported in a batch"
    if problem is not None:
        return NewLine(n, custom_id, None, 0, "failed",
                       line_error(custom_id, "invalid_request", f"Line {n + 1}: {problem}.", n + 1))
    body = doc["body"]
    return NewLine(n, custom_id, _encode(body), prefix_key(kind, body), "pending")


def build_batch_router(store: BatchStore, auth: Authenticator, max_file_bytes: int, max_line_bytes: int,
                       max_lines: int) -> APIRouter:
    router = APIRouter()
    principal = batch_principal(auth)

    async def owned_file(file_id: str, who: Principal) -> FileRow:
        f = await store.get_file(file_id)
        if f is None or not who.may_see(f.owner):
            raise NotFound(f"No such File object: {file_id}", param="id")
        return f

    async def owned_batch(batch_id: str, who: Principal) -> BatchRow:
        b = await store.get_batch(batch_id)
        if b is None or not who.may_see(b.owner):
            raise NotFound(f"No such batch: {batch_id}", param="batch_id")
        return b

    async def batch_object(b: BatchRow) -> dict[str, Any]:
        counts = await store.counts(b.id)
        stamp = lambda t: None if t is None else int(t)  # noqa: E731
        return {"id": b.id, "object": "batch", "endpoint": b.endpoint, "errors": None,
                "input_file_id": b.input_file_id, "completion_window": b.completion_window, "status": b.status,
                "output_file_id": b.output_file_id, "error_file_id": b.error_file_id,
                "created_at": int(b.created_at), "in_progress_at": stamp(b.in_progress_at),
                "expires_at": stamp(b.expires_at), "finalizing_at": stamp(b.finalizing_at),
                "completed_at": stamp(b.completed_at), "failed_at": stamp(b.failed_at),
                "expired_at": stamp(b.expired_at), "cancelling_at": stamp(b.cancelling_at),
                "cancelled_at": stamp(b.cancelled_at),
                "request_counts": {"total": counts.total, "completed": counts.completed, "failed": counts.failed},
                "metadata": _decode(b.metadata) if b.metadata else None}

    def page(items: list[dict[str, Any]], limit: int) -> Response:
        more = len(items) > limit
        items = items[:limit]
        return json_response({"object": "list", "data": items, "has_more": more,
                              "first_id": items[0]["id"] if items else None,
                              "last_id": items[-1]["id"] if items else None})

    def check_limit(limit: int) -> None:
        if not 1 <= limit <= 10_000:
            raise InvalidRequest("limit must be between 1 and 10000.", param="limit")

    # -- files -------------------------------------------------------------------------------------

    @router.post("/v1/files")
    async def upload(request: Request, who: Principal = Depends(principal)) -> Response:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > max_file_bytes + 64 * 1024:
            raise PayloadTooLarge(f"File exceeds {max_file_bytes} bytes.")
        try:
            # python-multipart spools a file part to disk past 1 MB: never whole in memory.
            form = await request.form(max_files=1, max_fields=8)
        except Exception as exc:  # a body that is no multipart form
            raise InvalidRequest(f"Expected a multipart/form-data upload with 'file' and 'purpose': {exc}",
                                 param="file") from None
        upload_file, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload_file, UploadFile):
            raise InvalidRequest("Missing the 'file' part.", param="file")
        if purpose != "batch":
            raise InvalidRequest(f"Invalid purpose {purpose!r}: this gateway stores files for 'batch' only.",
                                 param="purpose", code="invalid_value")

        async def chunks() -> AsyncIterator[bytes]:
            while chunk := await upload_file.read(CHUNK_BYTES):
                yield chunk

        try:
            f = await store.create_file(who.owner, purpose, upload_file.filename or "upload.jsonl", chunks(),
                                        max_file_bytes)
        except ValueError as exc:
            raise PayloadTooLarge(str(exc)) from None
        finally:
            await form.close()
        return json_response(file_object(f))

    @router.get("/v1/files")
    async def list_files(purpose: str | None = None, limit: int = 10_000, after: str | None = None,
                         order: str = "desc", who: Principal = Depends(principal)) -> Response:
        check_limit(limit)
        if order not in ("asc", "desc"):
            raise InvalidRequest("order must be 'asc' or 'desc'.", param="order")
        rows = await store.list_files(None if who.admin else who.owner, purpose, after, limit, order == "asc")
        return page([file_object(f) for f in rows], limit)

    @router.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str, who: Principal = Depends(principal)) -> Response:
        return json_response(file_object(await owned_file(file_id, who)))

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, who: Principal = Depends(principal)) -> Response:
        f = await owned_file(file_id, who)
        await store.delete_file(f.id)
        return json_response({"id": f.id, "object": "file", "deleted": True})

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, who: Principal = Depends(principal)) -> Response:
        f = await owned_file(file_id, who)
        return StreamingResponse(store.file_content(f), media_type="application/octet-stream",
                                 headers={"content-length": str(f.bytes)})

    # -- batches -----------------------------------------------------------------------------------

    @router.post("/v1/batches")
    async def create_batch(request: Request, who: Principal = Depends(principal)) -> Response:
        spec: CreateBatch = await decode_body(request, CreateBatch)
        if spec.endpoint not in BATCH_ENDPOINTS:
            raise InvalidRequest(f"Unsupported endpoint {spec.endpoint!r}: expected one of "
                                 f"{', '.join(sorted(BATCH_ENDPOINTS))}.", param="endpoint", code="invalid_value")
        window = COMPLETION_WINDOW_S.get(spec.completion_window)
        if window is None:
            raise InvalidRequest(f"Invalid completion_window {spec.completion_window!r}: expected '24h'.",
                                 param="completion_window", code="invalid_value")
        f = await owned_file(spec.input_file_id, who)
        if f.purpose != "batch":
            raise InvalidRequest(f"File {f.id} has purpose {f.purpose!r}, not 'batch'.", param="input_file_id")
        now = time.time()
        batch = BatchRow(id=new_id("batch_"), owner=who.owner, key_id=who.key.id if who.key else "",
                         input_file_id=f.id, endpoint=spec.endpoint, completion_window=spec.completion_window,
                         status="in_progress", created_at=now, expires_at=now + window, in_progress_at=now,
                         metadata=_encode(spec.metadata).decode() if spec.metadata else None)

        async def groups() -> AsyncIterator[list[NewLine]]:
            group: list[NewLine] = []
            n = 0
            async for raw in read_lines(store.file_content(f), max_line_bytes):
                if raw is not None and not raw.strip():
                    continue
                if n >= max_lines:
                    raise InvalidRequest(f"The input file has more than {max_lines} request lines.",
                                         param="input_file_id", code="too_many_lines")
                group.append(parse_line(raw, n, spec.endpoint))
                n += 1
                if len(group) >= LINES_PER_INSERT:
                    yield group
                    group = []
            if group:
                yield group

        try:
            batch = await store.create_batch(batch, groups())
        except DuplicateCustomId:
            raise InvalidRequest("The input file has duplicate custom_id values; each line needs its own.",
                                 param="input_file_id", code="duplicate_custom_id") from None
        if not batch.total:
            raise InvalidRequest("The input file has no request lines.", param="input_file_id", code="empty_file")
        return json_response(await batch_object(batch))

    @router.get("/v1/batches")
    async def list_batches(limit: int = 20, after: str | None = None,
                           who: Principal = Depends(principal)) -> Response:
        check_limit(limit)
        rows = await store.list_batches(None if who.admin else who.owner, limit, after=after)
        return page([await batch_object(b) for b in rows[:limit]] + [{}] * (len(rows) > limit), limit)

    @router.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str, who: Principal = Depends(principal)) -> Response:
        return json_response(await batch_object(await owned_batch(batch_id, who)))

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, who: Principal = Depends(principal)) -> Response:
        b = await owned_batch(batch_id, who)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            raise InvalidRequest(f"Cannot cancel a batch with status '{b.status}'.", param="batch_id",
                                 code="invalid_state")
        return json_response(await batch_object(await store.cancel(b.id) or b))

    return router
