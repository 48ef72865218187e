"""The router's HTTP/1.1 client to the workers: a keep-alive pool of ``asyncio.Protocol``
connections whose answers ``httptools`` parses, and a streamed body that is pushed to a sink
from the connection's ``data_received`` as it arrives.

Every proxied request and every streamed chunk passes through this client, so a chunk does
no more than it must: it goes from the socket through httptools' C parser into the relay and
onto the client's socket in one callback, with no task switch, and the read timeout is one
lazy timer per request. A general-purpose client (aiohttp) would wake a reading task through
a future, re-arm a timer on every read and build request objects per call; the router's cost
next to the Rust vllm-router's: docs/benchmarks.md ("Router overhead against vllm-router").
The health probes have a small pool of their own (``probe_pool``, ``fetch``), so a busy proxy
pool never holds them up.

::

    request(): idle connection (or a new one) -> head + body in one write -> await headers
    Response.piece()/read(): pull the body (the first piece, buffered answers, resumed legs)
    Response.pipe(sink): push every later piece to ``sink.data``, then ``sink.end(last)``
                         (the pieces that came with the body's end) or ``sink.failed(error)``;
                         ``pause()``/``resume()`` for flow control
    Response.release(): a complete keep-alive answer's connection goes back to the pool

``https://`` workers get the same connections over TLS (``start_tls`` after the TCP connect:
asyncio's SSL transport under the same protocol; ``_handshake`` says why its timeout is the
read timeout), verified against the pool's ``tls`` context: the router's ``--worker-ca``, or
the system's trust store. Idle connections are kept per scheme, host and port.
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

import httptools

from splitserve.common.tls import client_context
from splitserve.router.config import RouterConfig
from splitserve.router.response import Response, UpstreamError

# (scheme, host, port): what a pooled connection is to, and the key of its idle list.
Key = tuple[str, str, int]


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a worker; at most one request at a time."""

    def __init__(self, pool: Pool, key: Key) -> None:
        self.pool = pool
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.response: Response | None = None
        self._head_waiter: asyncio.Future | None = None
        self._header_list: list[tuple[bytes, bytes]] = []
        self._keep_alive = False
        self._paused = False
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # ---- the request -------------------------------------------------------------------

    async def send(self, head: bytes, body: bytes | None) -> Response:
        assert self.transport is not None and self.response is None
        self._header_list = []
        self._head_waiter = self.loop.create_future()
        self.transport.write(head if body is None else head + body)
        self._last_read = self.loop.time()
        self._timer = self.loop.call_at(self._last_read + self.pool.read_timeout_s, self._check)
        return await self._head_waiter

    def finish(self, response: Response) -> None:
        if response is not self.response:
            return  # released already
        self.response = None
        self._cancel_timer()
        if self._paused:
            self.resume()
        response._sink = None
        if response._complete and self._keep_alive and not self.closed:
            self.pool._put(self)
        else:
            self.close()
            self.pool._free()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self._last_read = self.loop.time()  # a paused read is not the worker's delay
            if not self.closed:
                self.transport.resume_reading()

    # ---- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamError(f"malformed answer from the worker: {e}"))
            self.close()
            return
        if self.response is not None:
            self.response._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        if self.response is None and self._head_waiter is None:
            self.pool._forget(self)  # an idle connection the worker closed
            return
        answered = self.response is not None
        reason = "Server disconnected" if exc is None else f"connection lost: {exc!r}"
        self._fail(UpstreamError(reason, dropped=not answered))
        if self.response is not None:
            self.response._flush()

    # ---- httptools callbacks -----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_list.append((name, value))

    def on_headers_complete(self) -> None:
        headers = {n.decode("latin-1").lower(): v.decode("latin-1") for n, v in self._header_list}
        self.response = Response(self, self.parser.get_status_code(), headers)
        waiter, self._head_waiter = self._head_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(self.response)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._pieces.append(body)

    def on_message_complete(self) -> None:
        self._keep_alive = self.parser.should_keep_alive()
        self._cancel_timer()
        if self.response is not None:
            self.response._complete = True

    # ---- failures ----------------------------------------------------------------------

    def _fail(self, error: UpstreamError) -> None:
        waiter, self._head_waiter = self._head_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        response = self.response
        if response is not None and not response._complete and response._error is None:
            response._error = error
            if response._waiter is not None and not response._waiter.done():
                response._waiter.set_result(None)

    def _check(self) -> None:
        """The lazy read timeout: re-armed from the last read, fired only when none came."""
        self._timer = None
        if self.closed or (self.response is None and self._head_waiter is None):
            return
        deadline = self._last_read + self.pool.read_timeout_s
        if self._paused or self.loop.time() < deadline:
            self._timer = self.loop.call_at(max(deadline, self.loop.time() + 0.001), self._check)
            return
        self._fail(UpstreamError(f"no data from the worker for {self.pool.read_timeout_s} s"))
        if self.response is not None:
            self.response._flush()
        self.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Pool:
    """Keep-alive connections to the workers, at most ``max_connections`` open at once.

    Idle connections are reused newest first and retired after ``keepalive_s`` idle, below
    the workers' own keep-alive timeout, so the router rarely sends a request down a
    connection the worker is closing. ``tls`` verifies ``https://`` workers (default: the
    system's trust store). Create it inside the running loop.
    """

    def __init__(
        self,
        max_connections: int = 1024,
        keepalive_s: float = 2.0,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 600.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._slots = asyncio.Semaphore(max_connections)
        self.tls = tls
        self._idle: dict[Key, list[_Connection]] = {}
        self._targets: dict[str, tuple[Key, bytes]] = {}
        self._closed = False

    async def request(
        self,
        method: str,
        url: str,
        path: str,
        headers: dict[str, str],
        body: bytes | None = None,
        timeout_s: float | None = None,
    ) -> Response:
        """Send ``method path`` to the worker at ``url`` (``http(s)://host:port``); returns once
        the answer's headers arrived. ``timeout_s``: a deadline for the headers."""
        key, host = self._target(url)
        head = _head(method, path, host, headers, body)
        await self._slots.acquire()
        conn = None
        try:
            async with asyncio.timeout(timeout_s):
                conn = self._reuse(key) or await self._connect(key)
                return await conn.send(head, body)
        except BaseException as e:
            if conn is not None:
                conn.close()
            self._free()
            if isinstance(e, TimeoutError):
                raise UpstreamError(f"no answer from {url} within {timeout_s} s") from e
            raise

    async def fetch(
        self, url: str, path: str, headers: dict[str, str], timeout_s: float
    ) -> tuple[int, bytes]:
        """``GET path`` from the worker at ``url``: (status, whole body) within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                r = await self.request("GET", url, path, headers)
                try:
                    return r.status, await r.read()
                finally:
                    r.release()
        except TimeoutError as e:
            raise UpstreamError(f"no answer from {url}{path} within {timeout_s} s") from e

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def _target(self, url: str) -> tuple[Key, bytes]:
        target = self._targets.get(url)
        if target is None:
            parsed = urlsplit(url)
            if parsed.scheme not in _DEFAULT_PORTS or not parsed.hostname:
                raise UpstreamError(f"cannot reach {url!r}: only http(s)://host:port workers")
            host, port = parsed.hostname, parsed.port or _DEFAULT_PORTS[parsed.scheme]
            target = self._targets[url] = ((parsed.scheme, host, port), f"{host}:{port}".encode())
        return target

    def _reuse(self, key: Key) -> _Connection | None:
        idle = self._idle.get(key)
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    async def _connect(self, key: Key) -> _Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, key), host, port),
                self.connect_timeout_s,
            )
        except TimeoutError as e:
            raise UpstreamError(f"cannot connect to {scheme}://{host}:{port}: timed out") from e
        except OSError as e:
            raise UpstreamError(f"cannot connect to {scheme}://{host}:{port}: {e}") from e
        if scheme == "https":
            await self._handshake(conn, host, f"{scheme}://{host}:{port}")
        return conn

    async def _handshake(self, conn: _Connection, host: str, where: str) -> None:
        """TLS over ``conn``'s connected socket, the host name verified. It may take as long
        as an answer may (the read timeout), not the connect timeout: the kernel accepts a
        plain connection on a busy worker's behalf, but a handshake needs the worker's event
        loop, and a worker busy for a few seconds should answer late, not fail."""
        if self.tls is None:
            self.tls = client_context()
        raw = conn.transport
        assert raw is not None
        try:
            conn.transport = await conn.loop.start_tls(  # type: ignore[assignment]
                raw, conn, self.tls, server_hostname=host, ssl_handshake_timeout=self.read_timeout_s
            )
        except BaseException as e:
            raw.close()
            if isinstance(e, ssl.SSLCertVerificationError):  # an OSError too: first
                raise UpstreamError(
                    f"cannot connect to {where}: its certificate failed verification "
                    f"({e.verify_message})"
                ) from e
            if isinstance(e, OSError):  # a plain-HTTP port, a handshake that timed out
                raise UpstreamError(f"cannot connect to {where}: TLS handshake: {e}") from e
            raise

    def _put(self, conn: _Connection) -> None:
        self._slots.release()
        if self._closed:
            conn.close()
            return
        conn.idle_since = conn.loop.time()
        self._idle.setdefault(conn.key, []).append(conn)

    def _free(self) -> None:
        self._slots.release()

    def _forget(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _head(
    method: str, path: str, host: bytes, headers: dict[str, str], body: bytes | None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1\r\n".encode(), b"host: ", host, b"\r\n"]
    for name, value in headers.items():
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    if body is not None:
        lines.append(b"content-length: %d\r\n" % len(body))
    lines.append(b"\r\n")
    return b"".join(lines)


def pool(config: RouterConfig) -> Pool:
    """The pool for forwarded requests; create it inside the running loop."""
    return Pool(
        config.max_connections,
        config.keepalive_expiry_s,
        config.connect_timeout_s,
        config.read_timeout_s,
        worker_tls(config),
    )


def probe_pool(config: RouterConfig) -> Pool:
    """The health checker's pool: a handful of connections, apart from the forwarded ones."""
    return Pool(
        32,
        config.keepalive_expiry_s,
        config.connect_timeout_s,
        config.health_timeout_s,
        worker_tls(config),
    )


def worker_tls(config: RouterConfig) -> ssl.SSLContext | None:
    """What ``https://`` workers are verified against: the configured CA, else (None) the
    system's trust store, loaded when a first such worker is reached."""
    return None if config.worker_ca is None else client_context(config.worker_ca)
