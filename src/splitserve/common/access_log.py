"""The access log (``--access-log PATH``): one JSON line per API request, for the router and
the worker alike. Fields: ``FIELDS``, described in docs/security.md.

A line holds ids, counts and times only: never prompt or output text, API keys or headers
other than the request and session ids. Lines are handed to a background thread
(``QueueListener``) that writes them to ``PATH``, rotated by size into ``PATH.1`` ...
``PATH.<backups>``, so a slow disk never stalls the event loop. Off (no ``--access-log``),
nothing is built or queued: the servers hold ``None`` and skip the call.
"""

from __future__ import annotations

import argparse
import logging
import queue
import time
from datetime import UTC, datetime
from logging.handlers import QueueHandler, QueueListener, RotatingFileHandler
from typing import Any

import orjson

DEFAULT_MAX_MB = 100.0
BACKUPS = 5
# Every line has every field, in this order; null where it does not apply or is unknown.
FIELDS = (
    "time",  # arrival, ISO 8601 UTC
    "server",  # "router" or "worker"
    "method",
    "path",
    "status",
    "latency_s",  # arrival to the last byte written
    "tenant",
    "session",
    "request_id",
    "workers",  # router: the workers used, the decode worker first
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "kv_blocks_received",  # worker: prompt KV blocks pulled from a prefill worker or peer
    "kv_peer_fetch",  # worker: the outcome of a peer KV fetch, when the turn named a peer
)


def add_access_log_args(p: argparse.ArgumentParser) -> None:
    """``--access-log`` and ``--access-log-max-mb``, for every server's command line."""
    p.add_argument(
        "--access-log",
        default=None,
        metavar="PATH",
        help="write one JSON line per API request to PATH (no prompt or output text; "
        "fields: docs/security.md)",
    )
    p.add_argument(
        "--access-log-max-mb",
        type=float,
        default=DEFAULT_MAX_MB,
        metavar="MB",
        help=f"rotate the access log at this many MiB, keeping {BACKUPS} old files "
        f"(default {DEFAULT_MAX_MB:g})",
    )


def max_bytes(mb: float) -> int:
    if mb <= 0:
        raise ValueError(f"--access-log-max-mb must be > 0, got {mb}")
    return max(1, int(mb * 2**20))


class AccessLog:
    """Writes lines to ``path`` from a background thread; ``close`` flushes and stops it."""

    def __init__(self, path: str, max_bytes: int, backups: int = BACKUPS) -> None:
        self.path = path
        self._file = RotatingFileHandler(
            path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8"
        )
        q: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        self._listener = QueueListener(q, self._file)
        self._logger = logging.Logger("splitserve.access")  # not registered: no propagation
        self._logger.addHandler(QueueHandler(q))
        self._listener.start()

    def write(self, **fields: Any) -> None:
        """Queue one line; ``fields`` are ``FIELDS`` less ``time`` (missing ones are null),
        and ``arrived``, the arrival's ``time.time()``."""
        arrived = fields.pop("arrived")
        line = {name: fields.get(name) for name in FIELDS}
        line["time"] = datetime.fromtimestamp(arrived, UTC).isoformat(timespec="milliseconds")
        self._logger.info(orjson.dumps(line).decode())

    def close(self) -> None:
        self._listener.stop()  # writes what is queued
        self._file.close()


def usage_fields(usage: dict[str, Any] | None) -> dict[str, int | None]:
    """The token fields of an OpenAI ``usage`` object (all null without one): a chat or
    text completion's, or a Responses API response's (``input_tokens``, ...)."""
    if not isinstance(usage, dict):
        return {}
    responses = "input_tokens" in usage
    details = usage.get("input_tokens_details" if responses else "prompt_tokens_details") or {}
    return {
        "prompt_tokens": usage.get("input_tokens" if responses else "prompt_tokens"),
        "cached_tokens": details.get("cached_tokens") if isinstance(details, dict) else None,
        "completion_tokens": usage.get("output_tokens" if responses else "completion_tokens"),
    }


def wall_clock(monotonic_at: float) -> float:
    """The ``time.time()`` of a past ``time.monotonic()`` reading."""
    return time.time() - (time.monotonic() - monotonic_at)


class AccessLogMiddleware:
    """ASGI middleware: a line for each HTTP request whose path starts with ``prefix``.

    The app leaves what it knows in the request's state (``scope["state"]``, Starlette's
    ``request.state``): ``tenant``, ``session``, ``request_id`` and the names of ``FIELDS``.
    The status is the one sent (500 if the app raised before answering); the latency runs
    to the app's return, after the last byte of a streamed answer.
    """

    def __init__(self, app: Any, log: AccessLog, server: str, prefix: str = "/v1/") -> None:
        self.app = app
        self.log = log
        self.server = server
        self.prefix = prefix

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        start, arrived = time.monotonic(), time.time()
        state = scope.setdefault("state", {})
        status = 500

        async def send_noting_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            noted = {name: state.get(name) for name in FIELDS[6:]}
            noted["request_id"] = _header(scope, b"x-request-id") or noted["request_id"]
            self.log.write(
                **noted,
                arrived=arrived,
                server=self.server,
                method=scope["method"],
                path=scope["path"],
                status=status,
                latency_s=round(time.monotonic() - start, 6),
            )


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
