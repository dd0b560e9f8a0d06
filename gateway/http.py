"""HTTP helpers every gateway router uses: JSON answers, typed body decoding, bearer tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from .errors import AuthenticationError, InvalidRequest, PayloadTooLarge

# Money is encoded as JSON numbers printed from the exact Decimals.
ENCODER = msgspec.json.Encoder(decimal_format="number")


def json_response(data: Any, status: int = 200) -> Response:
    return Response(ENCODER.encode(data), status_code=status, media_type="application/json")


async def read_body(request: Request, max_bytes: int, too_large: str = "") -> bytes:
    """The whole body, refused (413, `too_large` or a plain message) past `max_bytes`, by its
    declared length before anything is read, else as soon as the chunks pass it."""
    message = too_large or f"Request body exceeds {max_bytes} bytes."
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(message)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(message)
        chunks.append(chunk)
    return b"".join(chunks)


async def decode_body(request: Request, type_: type) -> Any:
    """The request body decoded (and validated) as `type_`; an empty body is `{}`."""
    body = await request.body()
    try:
        return msgspec.json.decode(body or b"{}", type=type_)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(str(exc), code="invalid_value") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}", code="invalid_json") from None


class AdminCheck(Protocol):
    """What tells the admin credential (gateway/accounting.py `Accounting`)."""

    def is_admin_token(self, token: str) -> bool: ...


def admin_only(check: AdminCheck) -> Callable[[Request], None]:
    """The FastAPI dependency of the admin routes: 401 unless the request carries the admin token."""
    def require_admin(request: Request) -> None:
        if not check.is_admin_token(bearer_token(request.headers.get("authorization"))):
            raise AuthenticationError("Admin credential required.", code="invalid_admin_token")

    return require_admin


def bearer_token(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` header value, or ""."""
    header = authorization or ""
    return header[7:].strip() if header[:7].lower() == "bearer " else ""
