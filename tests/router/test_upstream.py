"""The router's worker-facing HTTP client (``upstream``) against real loopback servers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import uvicorn

from splitserve.router import response, upstream
from splitserve.router.config import RouterConfig
from splitserve.router.response import UpstreamError
from splitserve.router.upstream import Pool

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _head(reader: asyncio.StreamReader) -> bytes:
    """A request's head and its body (by content-length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + (await reader.readexactly(length) if length else b"")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _serve(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 20))


class Recorder:
    """A ``Sink`` that keeps what it was given."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def data(self, piece: bytes) -> None:
        self.pieces.append(piece)

    def end(self, last: bytes) -> None:
        if last:
            self.pieces.append(last)
        self.done.set_result(None)

    def failed(self, error: UpstreamError) -> None:
        self.done.set_result(error)


def test_the_pool_takes_the_configured_limits():
    config = RouterConfig(workers=["h:1"], max_connections=64, keepalive_expiry_s=1.5)

    async def build() -> tuple[int, float, float, float]:
        pool = upstream.pool(config)
        await pool.close()
        return pool.max_connections, pool.keepalive_s, pool.connect_timeout_s, pool.read_timeout_s

    assert asyncio.run(build()) == (64, 1.5, config.connect_timeout_s, config.read_timeout_s)


def test_idle_connections_retire_before_a_worker_closes_them():
    # Regression: with the router's keep-alive expiry equal to the workers' (uvicorn's 5 s),
    # a request could go out on a connection the worker was closing and fail with a 502
    # (a read error before the first byte) although the worker was healthy.
    default = RouterConfig(workers=["h:1"]).keepalive_expiry_s
    assert default < uvicorn.Config(None).timeout_keep_alive


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("max_connections", 0, "max_connections must be >= 1"),
        ("keepalive_expiry_s", 0.0, "keepalive_expiry_s must be > 0"),
    ],
)
def test_bad_pool_options_are_rejected(option, value, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(workers=["h:1"], **{option: value})


def test_requests_reuse_one_kept_alive_connection_and_send_the_body():
    seen: list[bytes] = []
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while not reader.at_eof():
            try:
                seen.append(await _head(reader))
            except asyncio.IncompleteReadError:
                break
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nX-Thing: a\r\n\r\nok")

    async def test() -> None:
        server, url = await _serve(handler)
        pool = Pool()
        for _ in range(3):
            r = await pool.request("POST", url, "/v1/x", {"x-request-id": "r1"}, b'{"a":1}')
            assert (r.status, r.headers["x-thing"], await r.read()) == (200, "a", b"ok")
            r.release()
        await pool.close()
        server.close()

    _run(test)
    assert connections == 1
    assert seen[0].startswith(b"POST /v1/x HTTP/1.1\r\nhost: 127.0.0.1:")
    assert b"x-request-id: r1\r\ncontent-length: 7\r\n\r\n" in seen[0]
    assert seen[0].endswith(b'{"a":1}')


def test_a_piped_stream_reaches_the_sink_in_order_and_ends():
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunk(b"a"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(_chunk(b"b") + _chunk(b"c"))  # two chunks in one read: one piece
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(_chunk(b"d") + b"0\r\n\r\n")
        await writer.drain()

    async def test() -> None:
        server, url = await _serve(handler)
        pool = Pool()
        r = await pool.request("GET", url, "/", {})
        assert await r.piece() == b"a"
        sink = Recorder()
        r.pipe(sink)
        assert await sink.done is None
        r.release()
        assert b"".join(sink.pieces) == b"bcd"
        assert b"bc" in sink.pieces
        await pool.close()
        server.close()

    _run(test)


def test_only_connections_closed_under_a_request_count_as_dropped():
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        writer.transport.abort()  # RST before any answer

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await writer.drain()
        writer.close()

    async def test() -> None:
        pool = Pool(connect_timeout_s=1.0)
        server, url = await _serve(reset)
        with pytest.raises(UpstreamError) as dropped:
            await pool.request("POST", url, "/", {}, b"{}")
        assert response.dropped(dropped.value)
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamError) as refused:  # never opened: nothing to redial
            await pool.request("POST", url, "/", {}, b"{}")
        assert not response.dropped(refused.value)
        server, url = await _serve(cut)
        r = await pool.request("POST", url, "/", {}, b"{}")
        with pytest.raises(UpstreamError) as short:  # the answer began: not dropped
            await r.read()
        assert not response.dropped(short.value)
        r.release()
        await pool.close()
        server.close()

    _run(test)
    assert not response.dropped(TimeoutError())


def test_a_worker_that_stops_sending_times_out_on_the_read_timeout():
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunk(b"a"))
        await writer.drain()
        await asyncio.sleep(5)

    async def test() -> None:
        server, url = await _serve(stall)
        pool = Pool(read_timeout_s=0.2)
        r = await pool.request("GET", url, "/", {})
        assert await r.piece() == b"a"
        sink = Recorder()
        r.pipe(sink)
        error = await sink.done
        assert isinstance(error, UpstreamError) and "no data from the worker" in str(error)
        r.release()
        await pool.close()
        server.close()

    _run(test)


def test_at_most_max_connections_are_open_at_once():
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not reader.at_eof():
            try:
                await _head(reader)
            except asyncio.IncompleteReadError:
                break
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")

    async def test() -> None:
        server, url = await _serve(handler)
        pool = Pool(max_connections=1)
        first = await pool.request("GET", url, "/", {})
        second = asyncio.ensure_future(pool.request("GET", url, "/", {}))
        await asyncio.sleep(0.1)
        assert not second.done()  # waits for the one connection
        await first.read()
        first.release()
        (await second).release()
        await pool.close()
        server.close()

    _run(test)
