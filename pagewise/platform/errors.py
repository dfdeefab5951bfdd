"""The one place errors are formatted: all leave the API as `{"error": {message, type, param, code}}`."""

from __future__ import annotations

import logging
import re

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.status_codes import HTTP_500_INTERNAL_SERVER_ERROR

from pagewise.platform.db.faults import is_database_fault
from pagewise.serving.faults import RETRY_AFTER_S, is_redis_fault

logger = logging.getLogger(__name__)

_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
# the code of an error raised without one: OpenAI's where it has one, ours where not — never null
_CODE_BY_STATUS = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "service_unavailable",
}


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class APIError(Exception):
    """An error for the caller. Raising it changes no state; the handler renders it in OpenAI's shape. Its `code`
    is never null: without one given, the status's (`_CODE_BY_STATUS`)."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,  # noqa: A002 - OpenAI's field name
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code or _CODE_BY_STATUS.get(status_code, "api_error")
        self.param = param
        self.type = type or _TYPE_BY_STATUS.get(status_code, "api_error")
        self.headers = headers or {}

    def body(self) -> ErrorBody:
        return ErrorBody(ErrorDetail(self.message, self.type, self.param, self.code))


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(what: str, ident: str) -> APIError:
    """404 for a missing id — also the answer for another tenant's id, so existence never leaks."""
    return APIError(404, f"No {what} found with id '{ident}'", code="not_found", param="id")


def error_response(error: APIError) -> Response[ErrorBody]:
    return Response(error.body(), status_code=error.status_code, headers=error.headers)


def api_error_handler(_: Request, exc: APIError) -> Response[ErrorBody]:
    return error_response(exc)


def validation_error_handler(_: Request, exc: ValidationException) -> Response[ErrorBody]:
    """Malformed JSON or wrong types: 400 naming the first offending field."""
    message, param = exc.detail, None
    if isinstance(exc.extra, list) and exc.extra and isinstance(exc.extra[0], dict):
        first = exc.extra[0]
        message = str(first.get("message", message))
        key = first.get("key")
        missing = _MISSING_FIELD.search(message)
        param = missing.group(1) if missing else str(key) if key and key != "data" else None
        if param and param not in message:
            message = f"{message} - at `{param}`"
    return error_response(APIError(400, message, param=param, code="invalid_request"))


def http_error_handler(_: Request, exc: HTTPException) -> Response[ErrorBody]:
    return error_response(APIError(exc.status_code, exc.detail, headers=exc.headers))


def nesting_error_handler(_: Request, exc: RecursionError) -> Response[ErrorBody]:
    """msgspec refuses JSON nested deeper than it can decode with a `RecursionError`: the body's fault."""
    return error_response(APIError(400, "The JSON body is nested too deeply", code="invalid_request"))


def as_api_error(exc: Exception, where: str) -> APIError:
    """The error a caller sees for `exc`: an `APIError` as it is; the database or Redis (the quota store) out of
    reach a 503 to retry (logged in one line); anything else a logged, opaque 500."""
    if isinstance(exc, APIError):
        return exc
    for fault, what, code in (
        (is_database_fault, "database", "database_unavailable"),
        (is_redis_fault, "Redis (quotas, hand-over to engines)", "service_unavailable"),
    ):
        if fault(exc):
            logger.warning("%s unavailable on %s: %s", what, where, exc)
            return APIError(
                503, "A service this request needs is unavailable; retry shortly", code=code,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
    logger.error("unhandled error on %s", where, exc_info=exc)
    return APIError(HTTP_500_INTERNAL_SERVER_ERROR, "Internal server error", type="api_error")


def internal_error_handler(request: Request, exc: Exception) -> Response[ErrorBody]:
    return error_response(as_api_error(exc, f"{request.method} {request.url.path}"))


EXCEPTION_HANDLERS = {
    APIError: api_error_handler,
    ValidationException: validation_error_handler,
    HTTPException: http_error_handler,
    RecursionError: nesting_error_handler,
    Exception: internal_error_handler,
}
