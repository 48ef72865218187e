"""A server's port, bound when its process starts and served once it is ready.

A worker serves only once its model is loaded, seconds after its launcher chose a free port.
Bound as the process starts (without listening), the port is held meanwhile: connections to it
are refused until the server is ready, and no other process, nor the OS picking a source port
for an outbound connection, can take it."""

from __future__ import annotations

import logging
import socket
import sys

import uvicorn

log = logging.getLogger("splitserve.listen")

# uvicorn's exit code where a server cannot start (its port taken, its app failing at startup):
# a launcher may retry such a worker on another port.
STARTUP_FAILED = 3


def bind_port(host: str, port: int, what: str = "splitserve") -> socket.socket:
    """A TCP socket bound to ``host:port``, not yet listening; exits with ``STARTUP_FAILED``
    and one line on stderr where the port cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # as uvicorn binds: a restart may take its port back while old connections linger (TIME_WAIT)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        print(f"{what}: cannot bind {host}:{port}: {e.strerror or e}", file=sys.stderr)
        sys.exit(STARTUP_FAILED)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, logging its URL once it serves (uvicorn logs none for a socket it is
    handed)."""

    def __init__(self, config: uvicorn.Config, url: str) -> None:
        super().__init__(config)
        self.url = url

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            log.info("serving on %s", self.url)


def serve(app, sock: socket.socket, **config) -> None:
    """Serve ``app`` with uvicorn on ``sock`` (from ``bind_port``) until SIGINT/SIGTERM;
    ``config``: ``uvicorn.Config``'s keyword arguments (HTTPS with its certificate ones). Exits
    with ``STARTUP_FAILED`` where the server does not start."""
    host, port = sock.getsockname()[:2]
    uconfig = uvicorn.Config(app, host=host, port=port, **config)
    scheme = "https" if uconfig.is_ssl else "http"
    server = _Server(uconfig, f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}")
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    if not server.started:
        sys.exit(STARTUP_FAILED)
