"""A stream's first leg relayed from the worker's connection straight to the client's socket
(``server.BodyWriter``), and through ASGI ``send`` on a server that offers no writer."""

from __future__ import annotations

import httpx
import pytest

from .test_migration import stream_text
from .test_proxy import urls

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"


def greedy_body(max_tokens: int = 8) -> dict:
    return {
        "messages": [{"role": "user", "content": "abc"}],
        "stream": True,
        "max_tokens": max_tokens,
    }


@pytest.mark.parametrize("protocol", ["httptools", "h11"])
def test_a_server_without_a_body_writer_relays_and_migrates_the_same(
    workers3, make_router, protocol
):
    router = make_router(protocol, workers=urls(workers3), health_interval_s=60)
    for w in workers3:
        w.mode(greedy=True)
    home, events, clean = stream_text(router, CHAT, greedy_body(), "plain")
    assert clean == "".join(f"t{p} " for p in range(3, 11))
    assert events[-1] == "data: [DONE]"
    next(w for w in workers3 if w.url == home).mode(mode="die_midstream", die_after=3)
    worker, events, text = stream_text(router, CHAT, greedy_body(), "plain")
    assert (worker, text) == (home, clean)
    assert any(e.startswith(": splitserve migrated to") for e in events)


def test_streams_end_cleanly_one_after_another_on_one_kept_alive_connection(workers3, make_router):
    # The answer's end is written with the worker's last chunk, inside its callback, and
    # uvicorn's request cycle completed there: the connection must serve the next request.
    router = make_router(workers=urls(workers3), health_interval_s=60)
    for w in workers3:
        w.mode(greedy=True)
    with httpx.Client(limits=httpx.Limits(max_connections=1), timeout=30.0) as client:
        for i in range(5):
            with client.stream("POST", router.url + CHAT, json=greedy_body(4 + i)) as r:
                lines = [line for line in r.iter_lines() if line]
            assert r.status_code == 200
            assert lines[-1] == "data: [DONE]" and len(lines) == 4 + i + 2
        r = client.get(router.url + "/health")
        assert r.status_code == 200
