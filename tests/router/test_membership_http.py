"""Run-time membership, health-driven failover, and replicas, over real HTTP."""

from __future__ import annotations

import httpx
import pytest

from splitserve.router.proxy import DECODE_HEADER

from .conftest import HTTP, start_workers, wait_until

pytestmark = pytest.mark.timeout(120)
ADMIN = {"Authorization": "Bearer admin"}


def place(router, key: str) -> str:
    r = HTTP.post(
        router.url + "/v1/chat/completions",
        timeout=30.0,
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers={"X-Session-Id": key},
    )
    assert r.status_code == 200, r.text
    return r.headers[DECODE_HEADER]


def listing(router) -> dict[str, dict]:
    r = HTTP.get(router.url + "/workers", headers=ADMIN, timeout=5.0)
    return {w["url"]: w for w in r.json()["workers"]}


def test_membership_endpoints_need_the_admin_key(workers3, make_router):
    router = make_router(workers=[workers3[0].url], admin_key="admin")
    new = {"url": workers3[1].url + "/", "role": "decode"}
    assert HTTP.post(router.url + "/workers", json=new).status_code == 401
    r = HTTP.post(router.url + "/workers", json=new, headers=ADMIN)
    assert r.status_code == 201 and r.json()["url"] == workers3[1].url
    assert HTTP.post(router.url + "/workers", json=new, headers=ADMIN).status_code == 200
    assert set(listing(router)) == {workers3[0].url, workers3[1].url}
    r = HTTP.delete(f"{router.url}/workers/{workers3[1].url}", headers=ADMIN)
    assert r.status_code == 200
    r = HTTP.delete(f"{router.url}/workers/{workers3[1].url}", headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["code"] == "worker_not_found"
    bad = HTTP.post(router.url + "/workers", json={"url": "x", "role": "boss"}, headers=ADMIN)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "role"


def test_membership_endpoints_are_off_without_an_admin_key(workers3, make_router):
    router = make_router(workers=[workers3[0].url])
    r = HTTP.post(router.url + "/workers", json={"url": workers3[1].url})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"


def test_added_worker_takes_only_its_share_of_sessions(workers3, make_router):
    router = make_router(workers=[w.url for w in workers3[:2]], admin_key="admin")
    keys = [f"s{i}" for i in range(60)]
    before = {k: place(router, k) for k in keys}
    HTTP.post(router.url + "/workers", json={"url": workers3[2].url}, headers=ADMIN)
    after = {k: place(router, k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(after[k] == workers3[2].url for k in moved)


def test_unhealthy_worker_leaves_the_ring_and_comes_back(workers3, make_router):
    router = make_router(
        workers=[w.url for w in workers3], failure_threshold=1, cooldown_s=0.3, admin_key="admin"
    )
    keys = [f"s{i}" for i in range(30)]
    before = {k: place(router, k) for k in keys}
    sick = workers3[0]
    sick.mode(mode="unhealthy")
    wait_until(lambda: not listing(router)[sick.url]["healthy"], 10, "the probe to notice")
    during = {k: place(router, k) for k in keys}
    assert sick.url not in during.values()
    assert all(during[k] == before[k] for k in keys if before[k] != sick.url)
    sick.mode(mode="ok")
    wait_until(lambda: listing(router)[sick.url]["healthy"], 10, "the worker to come back")
    assert {k: place(router, k) for k in keys} == before


def test_load_reports_reach_the_router(workers3, make_router):
    router = make_router(workers=[w.url for w in workers3], admin_key="admin")
    workers3[1].mode(running=5, waiting=2)
    wait_until(lambda: listing(router)[workers3[1].url]["load"] == 7, 10, "a /load report")


def test_killed_worker_moves_only_its_sessions(make_router):
    workers = start_workers("k1", "k2", "k3")
    try:
        router = make_router(workers=[w.url for w in workers])
        keys = [f"s{i}" for i in range(30)]
        before = {k: place(router, k) for k in keys}
        victim = workers[1]
        victim.kill()
        after = {k: place(router, k) for k in keys}  # no client error, even before a probe
        assert victim.url not in after.values()
        assert {k for k in keys if before[k] != after[k]} == {
            k for k in keys if before[k] == victim.url
        }
    finally:
        for w in workers:
            w.kill()


def test_two_replicas_place_200_sessions_identically_and_fail_over(workers3, make_router):
    urls = [w.url for w in workers3]
    a = make_router(workers=urls)
    b = make_router(workers=list(reversed(urls)))
    keys = [f"session-{i}" for i in range(200)]
    on_a = [place(a, k) for k in keys]
    assert on_a == [place(b, k) for k in keys]
    assert len(set(on_a)) == 3
    a.stop()
    with pytest.raises(httpx.TransportError):
        place(a, "session-0")
    assert [place(b, k) for k in keys[:20]] == on_a[:20]  # clients continue through b


def test_client_leaving_mid_stream_frees_the_in_flight_slot(workers3, make_router):
    router = make_router(workers=[workers3[0].url], health_interval_s=60, admin_key="admin")
    workers3[0].mode(delay_s=0.3)
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    with HTTP.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30.0) as r:
        next(r.iter_raw())  # one chunk, then hang up
    wait_until(lambda: listing(router)[workers3[0].url]["in_flight"] == 0, 10, "the relay to close")


def test_client_leaving_a_slow_stream_closes_the_upstream_at_once(workers3, make_router):
    # The relay watches for the client's disconnect itself (no Starlette task group): a
    # client that hangs up must free the worker now, not when the worker's next chunk comes.
    router = make_router(workers=[workers3[0].url], health_interval_s=60, admin_key="admin")
    workers3[0].mode(delay_s=30.0)
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    with HTTP.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30.0) as r:
        next(r.iter_raw())
    wait_until(lambda: listing(router)[workers3[0].url]["in_flight"] == 0, 5, "the relay to close")


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:99999", "http://h:port", "http://a..b", "http://[::1", "http://x\x0f"]
)
def test_undialable_worker_url_is_a_400_not_a_500_later(workers3, make_router, url):
    """Regression (schemathesis): such a URL was added, and a request placed there would have
    met a ValueError in the connection pool (a 500), not a worker failure."""
    router = make_router(workers=[workers3[0].url], admin_key="admin")
    r = HTTP.post(router.url + "/workers", json={"url": url}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "url", r.text
    assert set(listing(router)) == {workers3[0].url}


def test_removing_a_blank_worker_url_is_a_404_not_a_500(workers3, make_router):
    """Regression (schemathesis): ``DELETE /workers/%20`` raised in URL normalisation."""
    router = make_router(workers=[workers3[0].url], admin_key="admin")
    r = HTTP.delete(f"{router.url}/workers/%20", headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["code"] == "worker_not_found"


def test_the_listing_counts_the_sessions_each_worker_served_last(workers3, make_router):
    router = make_router(workers=[w.url for w in workers3], admin_key="admin")
    last = {k: place(router, k) for k in (f"s{i}" for i in range(12))}
    place(router, "s0")  # a second turn of a session counts once
    counts = {url: w["sessions"] for url, w in listing(router).items()}
    assert counts == {w.url: list(last.values()).count(w.url) for w in workers3}
    assert sum(counts.values()) == 12
