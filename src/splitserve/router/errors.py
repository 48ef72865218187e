"""OpenAI-shaped error responses: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class RouterError(Exception):
    """An error the router answers itself (bad request, auth, no worker available)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers
        self.message = message
        self.code = code
        self.param = param

    @property
    def type(self) -> str:
        if self.status >= 500:
            return "server_error"
        return "rate_limit_error" if self.status == 429 else "invalid_request_error"

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers=self.headers)


def no_worker(role: str) -> RouterError:
    return RouterError(
        503, f"no healthy {role} worker is available; retry later", code="no_healthy_worker"
    )
