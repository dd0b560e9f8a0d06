"""Errors in the shape of the API a client speaks: OpenAI's {"error": {message, type, param, code}}
everywhere, Anthropic's {"type": "error", "error": {type, message}} on the Messages routes."""

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

    def anthropic_response(self) -> Response:
        return anthropic_error_response(self.status, self.message, self.headers)


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


class PreviousResponseNotFound(NotFound):
    code = "previous_response_not_found"


class ResponseNotFound(NotFound):
    code = "response_not_found"


class PayloadTooLarge(APIError):
    status = 413
    code = "payload_too_large"


class TooManyRequests(APIError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class QuotaExceeded(TooManyRequests):
    type = "insufficient_quota"
    code = "insufficient_quota"


class ServiceUnavailable(APIError):
    status = 503
    type = "service_unavailable"
    code = "no_healthy_replica"


class InternalError(APIError):
    status = 500
    type = "server_error"
    code = "internal_error"


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


# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}


def anthropic_status(status: int) -> int:
    """503 (no replica can serve now) is Anthropic's 529 overloaded_error, which its SDK retries."""
    return 529 if status == 503 else status


def anthropic_error_body(status: int, message: str) -> bytes:
    type_ = _ANTHROPIC_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return _encoder.encode({"type": "error", "error": {"type": type_, "message": message}})


def anthropic_error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    status = anthropic_status(status)
    return Response(anthropic_error_body(status, message), status_code=status,
                    media_type="application/json", headers=headers)
