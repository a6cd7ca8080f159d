"""What a refusal or an error result is in HTTP: a status, the OpenAI error body
(``{"error": {"message", "type", "param", "code"}}``, ``code`` the protocol's error code or
the client's), and headers (``Retry-After`` on 429)."""

from __future__ import annotations

from typing import Any

from redbatch.common.protocol import ErrorCode, RedbatchError, ResultEnvelope
from redbatch.producer.errors import (
    FUNCTIONS_MISSING,
    REDIS_REFUSED,
    REDIS_UNAVAILABLE,
    RESULT_TIMEOUT,
)

#: The HTTP status of each code a job's answer or a refusal carries; anything else is 500.
STATUS_OF: dict[str, int] = {
    **{code.value: 400 for code in (
        ErrorCode.BAD_ENVELOPE, ErrorCode.UNSUPPORTED_VERSION, ErrorCode.BAD_REQUEST_ID,
        ErrorCode.WRONG_MODEL, ErrorCode.WRONG_LANE, ErrorCode.BAD_IMAGE,
        ErrorCode.UNSUPPORTED_FORMAT, ErrorCode.BAD_INPUT)},
    ErrorCode.PAYLOAD_TOO_LARGE.value: 413,
    ErrorCode.IMAGE_TOO_LARGE.value: 413,
    ErrorCode.EXPIRED.value: 504,
    RESULT_TIMEOUT: 504,
    ErrorCode.QUEUE_FULL.value: 429,
    ErrorCode.DUPLICATE_REQUEST_ID.value: 409,
    ErrorCode.CANCELLED.value: 409,
    REDIS_UNAVAILABLE: 503,
    FUNCTIONS_MISSING: 503,
    REDIS_REFUSED: 503,
}
#: Codes of the gateway's own.
UNAUTHORIZED = "invalid_api_key"
NO_WORKER = "no_worker"
TENANT_FULL = "tenant_full"
NOT_FOUND = "not_found"
METHOD_NOT_ALLOWED = "method_not_allowed"
INTERNAL = "internal"
STATUS_OF.update({UNAUTHORIZED: 401, NO_WORKER: 503, TENANT_FULL: 429, NOT_FOUND: 404,
                  METHOD_NOT_ALLOWED: 405, INTERNAL: 500})

_TYPE_OF = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
            429: "rate_limit_error", 503: "service_unavailable", 504: "timeout_error"}


class ApiError(Exception):
    """A request answered with an error: ``status``, ``code``, ``message``, ``headers``."""

    def __init__(self, code: str, message: str, status: int | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status or STATUS_OF.get(code, 500)
        self.headers = headers or {}
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPE_OF.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    """A body the gateway refuses before anything is queued: 400 ``bad_input``."""
    return ApiError(ErrorCode.BAD_INPUT.value, message, 400, param=param)


def from_error(e: RedbatchError, retry_after_s: int) -> ApiError:
    """A client error as HTTP (QueueFull: 429 with Retry-After; Redis away: 503)."""
    code = str(e.code or "internal")
    headers = {"Retry-After": str(retry_after_s)} if STATUS_OF.get(code) == 429 else {}
    return ApiError(code, str(e).splitlines()[0][:500], headers=headers)


def from_result(result: ResultEnvelope) -> ApiError:
    """An error answer as HTTP: its code and message, the status its code has."""
    code = result.error_code.value if result.error_code else "internal"
    return ApiError(code, result.error_message[:500] or code)
