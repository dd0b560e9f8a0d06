"""OpenAI-shaped errors: every failure leaves the gateway as {"error": {message, type, param, code}}."""

from __future__ import annotations

import msgspec
from starlette.responses import Response


class APIError(Exception):
    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.headers = headers or {}

    def response(self) -> Response:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)


class InvalidRequest(APIError):
    status = 400


class AuthenticationError(APIError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(APIError):
    status = 403
    type = "permission_error"


class NotFound(APIError):
    status = 404
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class PayloadTooLarge(APIError):
    status = 413
    code = "payload_too_large"


class RateLimited(APIError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class QuotaExceeded(RateLimited):
    type = "insufficient_quota"
    code = "insufficient_quota"


class ServiceUnavailable(APIError):
    status = 503
    type = "service_unavailable"
    code = "no_healthy_replica"


class UpstreamError(APIError):
    status = 502
    type = "upstream_error"
    code = "upstream_error"


_encoder = msgspec.json.Encoder()


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> bytes:
    return _encoder.encode({"error": {"message": message, "type": type_, "param": param, "code": code}})


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(message, type_, param, code), status_code=status,
                    media_type="application/json", headers=headers)


def param_from_msgspec(message: str) -> str | None:
    """msgspec says '... - at `$.messages[0].role`'; OpenAI's param is 'messages[0].role'."""
    marker = "at `$."
    i = message.rfind(marker)
    if i >= 0:
        return message[i + len(marker):].rstrip("`")
    # "Object missing required field `messages`" (at the top level, msgspec names no path)
    missing = "missing required field `"
    i = message.find(missing)
    if i >= 0:
        return message[i + len(missing):].split("`", 1)[0]
    return None
