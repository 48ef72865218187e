"""A worker connection dropped before the answer began is retried, even with one worker.

The worker here sits behind ``DroppingFront``, a real TCP server on loopback that resets
(RST) chosen connections right after reading a completion request's head, as a worker does
when it closes a kept-alive connection the router is just reusing; every other connection
is piped to a fake worker unchanged.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from splitserve.router.proxy import DECODE_HEADER

from .conftest import HTTP, FakeWorker, start_workers

pytestmark = pytest.mark.timeout(120)

_DROPPED_PATH = b"POST /v1/"  # completion requests; probes and /v1/models pass


class DroppingFront:
    """Listens on loopback; resets the next ``drops`` completion requests' connections after
    their head arrives (before the body is read), and pipes everything else to ``target``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.drops = 0
        self.dropped = 0
        self.hold_s = 0.0  # how long a dropped connection stays open, unread, before the RST
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_next(self, count: int) -> None:
        with self._lock:
            self.drops = count

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        head = _read_head(conn)
        if head.startswith(_DROPPED_PATH) and self._take_drop():
            time.sleep(self.hold_s)
            # SO_LINGER 0: close() sends RST and discards what the client still sends.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
            return
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        upstream.sendall(head)
        threading.Thread(target=_pipe, args=(upstream, conn), daemon=True).start()
        _pipe(conn, upstream)

    def _take_drop(self) -> bool:
        with self._lock:
            if self.drops <= 0:
                return False
            self.drops -= 1
            self.dropped += 1
            return True


def _read_head(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        piece = conn.recv(65536)
        if not piece:
            break
        data += piece
    return data


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while piece := src.recv(65536):
            dst.sendall(piece)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def dropping_worker() -> Iterator[tuple[DroppingFront, FakeWorker]]:
    (worker,) = start_workers("behind-front")
    front = DroppingFront(worker.port)
    yield front, worker
    front.close()
    worker.kill()


def metric(router, name: str) -> float:
    text = HTTP.get(router.url + "/metrics", timeout=5.0).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


def chat(content: str = "hello", stream: bool = False) -> dict:
    return {"model": "fake", "stream": stream, "messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize("stream", [False, True])
def test_a_dropped_connection_is_retried_on_the_only_worker(dropping_worker, make_router, stream):
    front, _ = dropping_worker
    router = make_router(workers=[front.url], health_interval_s=60)
    front.drop_next(1)
    r = HTTP.post(router.url + "/v1/chat/completions", json=chat(stream=stream), timeout=30.0)
    assert r.status_code == 200, r.text
    assert r.headers[DECODE_HEADER] == front.url
    assert front.dropped == 1
    assert metric(router, "splitserve:router_retries_total") == 1
    if stream:
        assert r.text.endswith("data: [DONE]\n\n")
    else:
        assert json.loads(r.text)["choices"]


def test_a_body_the_worker_stopped_reading_is_sent_again(dropping_worker, make_router):
    # Regression: a reset while the router was still writing the body (aiohttp raises "Can not
    # write request body" or "Connection reset by peer", whichever it meets first) answered
    # a 502 when no other worker was left to try.
    front, worker = dropping_worker
    router = make_router(workers=[front.url], health_interval_s=60)
    front.drop_next(1)
    front.hold_s = 0.5  # the router fills the socket buffers and waits to write the rest
    big = "x" * (8 << 20)
    r = HTTP.post(router.url + "/v1/chat/completions", json=chat(big), timeout=60.0)
    assert r.status_code == 200, r.text
    assert front.dropped == 1
    assert len(worker.seen()[-1]["body"]["messages"][0]["content"]) == len(big)


def test_a_worker_that_drops_every_connection_is_a_502_after_the_retries(
    dropping_worker, make_router
):
    front, _ = dropping_worker
    router = make_router(workers=[front.url], health_interval_s=60, max_retries=2)
    front.drop_next(100)
    r = HTTP.post(router.url + "/v1/chat/completions", json=chat(), timeout=30.0)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "worker_failed"
    assert front.dropped == 2  # the first try and one more over a new connection


def test_a_dropped_connection_keeps_the_session_on_its_worker(
    dropping_worker, workers3, make_router
):
    front, _ = dropping_worker
    # The front inspects only a connection's first request: let kept-alive ones retire.
    router = make_router(
        workers=[front.url, workers3[0].url], health_interval_s=60, keepalive_expiry_s=0.05
    )

    def post(session: str):
        headers = {"X-Session-Id": session}
        return HTTP.post(router.url + "/v1/chat/completions", json=chat(), headers=headers)

    session = next(
        s for s in (f"s{i}" for i in range(64)) if post(s).headers[DECODE_HEADER] == front.url
    )
    time.sleep(0.3)
    front.drop_next(1)
    r = post(session)
    assert r.status_code == 200
    assert r.headers[DECODE_HEADER] == front.url
    assert front.dropped == 1
    assert metric(router, "splitserve:router_sessions_moved_total") == 0
