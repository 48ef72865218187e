"""A bound on request bodies, for the worker and the router alike: ASGI middleware.

uvicorn reads a body of any size, and both servers read the whole body before parsing it,
so without a bound one request could take all the memory. A body that declares a length
over the bound (``Content-Length``) is answered 413 at once, before any of it is read; a
chunked body is counted as it arrives and refused (``BodyTooLarge``) as soon as it passes
the bound. What the client still sends of a refused body, uvicorn reads and drops.

Not Starlette's ``RequestBodyLimitMiddleware`` (FastAPI's ``max_body_size``): it answers a
declared oversize body in plain text ("Content Too Large") whatever the app's error
handlers say, where clients of an OpenAI API expect ``{"error": {...}}``.
"""

from __future__ import annotations

import argparse
from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

# Far above any prompt the served models take (128k tokens of text, or of token ids, are
# about 1 MB of JSON), far below what would strain a worker's memory.
DEFAULT_MAX_BODY_BYTES = 16 * 2**20


def add_max_body_arg(p: argparse.ArgumentParser) -> None:
    """``--max-body-mb``, for the worker's and the router's command lines."""
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=DEFAULT_MAX_BODY_BYTES / 2**20,
        metavar="MB",
        help="answer 413 to a request body larger than this many MiB "
        f"(default {DEFAULT_MAX_BODY_BYTES // 2**20})",
    )


class BodyTooLarge(HTTPException):
    """Raised by the wrapped ``receive`` once a body passes the bound: each server's handler
    of ``HTTPException`` answers it as an OpenAI error, and ``BodyLimit`` answers it where
    no handler did."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is larger than {max_bytes} bytes")


def too_large(max_bytes: int) -> JSONResponse:
    message = f"the request body is larger than {max_bytes} bytes"
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return JSONResponse({"error": error}, status_code=413)


class BodyLimit:
    """Refuses request bodies over ``max_bytes`` with a 413 (see the module's docstring)."""

    def __init__(self, app: Any, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None:  # the server delivers exactly that many bytes, no more
            if length > self.max_bytes:
                await too_large(self.max_bytes)(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        await self._counted(scope, receive, send)

    async def _counted(self, scope: dict, receive: Any, send: Any) -> None:
        received = 0
        started = False

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise BodyTooLarge(self.max_bytes)
            return message

        async def watched_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watched_send)
        except BodyTooLarge:
            if started:
                raise
            await too_large(self.max_bytes)(scope, receive, send)


def _content_length(scope: dict) -> int | None:
    """The declared body length; None when there is none (chunked, or no body)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser has already refused it
    return None
