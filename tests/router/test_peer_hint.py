"""``--kv-peer-fetch``: a session turn placed off its busy home names the home (``kv_peer``)
for the chosen worker to pull the session's KV from; a turn at home names nobody."""

from __future__ import annotations

import time

import pytest

from splitserve.router.proxy import DECODE_HEADER, PEER_FIELD

from .test_proxy import chat, metric, post, urls

pytestmark = pytest.mark.timeout(120)


def bodies(workers, session: str) -> dict[str, list[dict]]:
    """What each worker received for ``session``'s turns, by worker URL."""
    text = f"hello from {session}"
    return {
        w.url: [
            s["body"]
            for s in w.seen()
            if s["path"] == "/v1/chat/completions" and s["body"]["messages"][0]["content"] == text
        ]
        for w in workers
    }


def move_off_home(router, workers, session: str) -> tuple[str, str]:
    """Send turns of ``session`` until one leaves its home, once the home looks busy;
    returns (home, the worker the moved turn went to)."""
    home = post(router, chat(session), {"X-Session-Id": session}).headers[DECODE_HEADER]
    next(w for w in workers if w.url == home).mode(running=8)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the router sees the load at its next probe
        placed = post(router, chat(session), {"X-Session-Id": session}).headers[DECODE_HEADER]
        if placed != home:
            return home, placed
        time.sleep(0.05)
    raise AssertionError("the turn never left its busy home")


def test_a_turn_placed_off_its_home_names_the_home(workers3, make_router):
    router = make_router(workers=urls(workers3), kv_peer_fetch=True)
    home, moved = move_off_home(router, workers3, "peer-on")
    seen = bodies(workers3, "peer-on")
    assert seen[home] and all(PEER_FIELD not in b for b in seen[home])
    assert [b[PEER_FIELD] for b in seen[moved]] == [home]
    assert metric(router, "splitserve:router_kv_peer_hints_total") == 1


def test_without_the_flag_no_turn_names_a_peer_and_clients_cannot(workers3, make_router):
    router = make_router(workers=urls(workers3))
    forged = chat("peer-off", **{PEER_FIELD: "http://127.0.0.1:9"})
    post(router, forged, {"X-Session-Id": "peer-off"})
    home, moved = move_off_home(router, workers3, "peer-off")
    seen = bodies(workers3, "peer-off")
    assert seen[moved] and all(PEER_FIELD not in b for v in seen.values() for b in v)
    assert metric(router, "splitserve:router_kv_peer_hints_total") == 0


def test_a_client_cannot_name_a_peer_when_the_flag_is_on(workers3, make_router):
    router = make_router(workers=urls(workers3), kv_peer_fetch=True)
    forged = chat("peer-forged", **{PEER_FIELD: "http://127.0.0.1:9"})
    assert post(router, forged, {"X-Session-Id": "peer-forged"}).status_code == 200
    [body] = [b for v in bodies(workers3, "peer-forged").values() for b in v]
    assert PEER_FIELD not in body
