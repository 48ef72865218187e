"""OpenAI-shaped errors: every failure a client can cause becomes a 4xx with a useful body."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitserve.common.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)

_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error"}


class APIError(Exception):
    """An error the HTTP layer reports as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers
        self.message = message
        self.param = param
        self.code = code
        if type is None:
            type = "server_error" if status >= 500 else _TYPES.get(status, "invalid_request_error")
        self.type = type

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(e: ValidationError) -> APIError:
    """The first problem pydantic found, named by its dotted field path."""
    first = e.errors(include_url=False)[0]
    loc = [str(p) for p in first["loc"]]
    # Drop the union-member tags pydantic appends (``prompt.str``): clients never wrote them.
    loc = [p for p in loc if not _is_type_tag(p)]
    param = ".".join(loc) or None
    msg = first["msg"]
    message = f"{param}: {msg}" if param else msg
    return bad_request(message, param=param)


def _is_type_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list", "dict", "none", "function-after"} or (
        "[" in part and "]" in part
    )


def install_handlers(app: FastAPI) -> None:
    """Route every error, including Starlette's own 404/405, through the OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.request_errors.labels(str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}").response()
