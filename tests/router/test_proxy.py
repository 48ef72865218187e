"""The router's HTTP front against fake worker processes: routing, streaming, retries."""

from __future__ import annotations

import json

import pytest

from splitserve.router.proxy import DECODE_HEADER, PREFILL_HEADER

from .conftest import HTTP, FakeWorker, wait_until

pytestmark = pytest.mark.timeout(120)


def chat(session: str | None = None, stream: bool = False, **fields) -> dict:
    body = {
        "model": "fake",
        "stream": stream,
        "messages": [{"role": "user", "content": f"hello from {session}"}],
        **fields,
    }
    return body


def post(router, body: dict, headers: dict | None = None, path: str = "/v1/chat/completions"):
    return HTTP.post(router.url + path, json=body, headers=headers or {}, timeout=30.0)


def urls(workers) -> list[str]:
    return [w.url for w in workers]


def metric(router, name: str) -> float:
    text = HTTP.get(router.url + "/metrics", timeout=5.0).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_sessions_stick_to_their_worker(workers3, make_router):
    router = make_router(workers=urls(workers3))
    for s in range(10):
        placed = {
            post(router, chat(), {"X-Session-Id": f"s{s}"}).headers[DECODE_HEADER] for _ in range(3)
        }
        assert len(placed) == 1
    assert metric(router, "splitserve:router_home_turn_fraction") == 1.0


def test_non_streaming_body_and_worker_header(workers3, make_router):
    router = make_router(workers=urls(workers3))
    r = post(router, chat("a"), {"X-Session-Id": "a"})
    assert r.status_code == 200
    by_url = {w.url: w.name for w in workers3}
    assert r.json()["worker"] == by_url[r.headers[DECODE_HEADER]]
    assert PREFILL_HEADER not in r.headers
    assert r.headers["x-request-id"]


def test_streaming_passes_every_chunk_through(workers3, make_router):
    router = make_router(workers=urls(workers3))
    with HTTP.stream(
        "POST", router.url + "/v1/completions", timeout=30.0, json={"prompt": "hi", "stream": True}
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    name = {w.url: w.name for w in workers3}[r.headers[DECODE_HEADER]]
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert texts == [f"{name}-{i} " for i in range(4)]
    assert events[-1] == "data: [DONE]"


@pytest.mark.parametrize("engine", ["builtin", "vllm"])
def test_streams_get_migration_bookkeeping_unless_a_vllm_worker_could_not_resume_them(
    workers3, make_router, engine
):
    # The router asks for token ids (its resume bookkeeping) on every stream it can resume:
    # on vLLM ones too when they offer tools (they are replayed), but not with ``echo``, whose
    # echoed text vLLM leaves out when ids are asked for.
    router = make_router(workers=urls(workers3[:1]), worker_engine=engine)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    echo = {"prompt": "abc", "echo": True, "stream": True}
    for path, body, wants_ids in (
        ("/v1/chat/completions", chat(stream=True), True),
        ("/v1/chat/completions", chat(stream=True, tools=tools), True),
        ("/v1/completions", echo, engine == "builtin"),
    ):
        with HTTP.stream("POST", router.url + path, timeout=30.0, json=body) as r:
            assert r.read().endswith(b"data: [DONE]\n\n")
        seen = workers3[0].seen()[-1]["body"]
        assert seen.get("return_token_ids", False) is wants_ids


def test_client_errors_pass_through_without_retry(workers3, make_router):
    router = make_router(workers=urls(workers3))
    r = post(router, chat(max_tokens=400), {"X-Session-Id": "a"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    assert metric(router, "splitserve:router_retries_total") == 0


def test_5xx_is_retried_on_another_worker(workers3, make_router):
    router = make_router(workers=urls(workers3), health_interval_s=60)
    home = post(router, chat(), {"X-Session-Id": "s"}).headers[DECODE_HEADER]
    next(w for w in workers3 if w.url == home).mode(mode="error500")
    r = post(router, chat(), {"X-Session-Id": "s"})
    assert r.status_code == 200
    assert r.headers[DECODE_HEADER] != home
    assert metric(router, "splitserve:router_retries_total") == 1
    assert metric(router, "splitserve:router_sessions_moved_total") == 1


def test_connection_refused_is_retried_and_stream_continues(workers3, make_router):
    doomed = FakeWorker("doomed").wait_ready()
    try:
        workers = [doomed.url, *urls(workers3)]
        router = make_router(workers=workers, health_interval_s=60, admin_key="admin")

        def probed() -> bool:  # the router's one probe in this test has read doomed's /load
            admin = {"Authorization": "Bearer admin"}
            listed = HTTP.get(router.url + "/workers", headers=admin, timeout=5.0).json()["workers"]
            return any(w["url"] == doomed.url and w["kv_blocks_total"] for w in listed)

        wait_until(probed, what="the router's first health probe")
        doomed.kill()  # healthy as far as the router knows: nothing probes for 60 s
        for s in range(40):  # some of these sessions call the dead worker home
            with HTTP.stream(
                "POST",
                router.url + "/v1/chat/completions",
                timeout=30.0,
                json=chat(stream=True),
                headers={"X-Session-Id": f"s{s}"},
            ) as r:
                assert r.status_code == 200
                assert r.headers[DECODE_HEADER] != doomed.url
                assert r.read().endswith(b"data: [DONE]\n\n")
        assert metric(router, "splitserve:router_worker_failures_total") >= 1
        assert metric(router, "splitserve:router_retries_total") >= 1
    finally:
        doomed.kill()


def test_mid_stream_failure_ends_with_an_error_event(workers3, make_router):
    router = make_router(workers=urls(workers3[:1]), health_interval_s=60)
    workers3[0].mode(mode="die_midstream")
    with HTTP.stream(
        "POST", router.url + "/v1/chat/completions", timeout=30.0, json=chat(stream=True)
    ) as r:
        events = [line for line in r.iter_lines() if line]
    assert len(events) == 3
    assert json.loads(events[-1][6:])["error"]["code"] == "worker_failed"
    assert metric(router, "splitserve:router_midstream_failures_total") == 1


def test_no_healthy_worker_is_a_503_with_an_openai_body(make_router):
    router = make_router(workers=["http://127.0.0.1:9"], max_retries=0)
    r = post(router, chat())
    assert r.status_code == 502  # the only worker failed: say so
    assert r.json()["error"]["code"] == "worker_failed"
    r = post(router, chat())  # ... and once its breaker opens nobody is left
    for _ in range(3):
        r = post(router, chat())
    assert r.status_code == 503
    assert r.json()["error"] == {
        "message": "no healthy decode worker is available; retry later",
        "type": "server_error",
        "param": None,
        "code": "no_healthy_worker",
    }
    assert HTTP.get(router.url + "/health").status_code == 503


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]"])
def test_bad_bodies_are_400(workers3, make_router, raw):
    router = make_router(workers=urls(workers3))
    r = HTTP.post(router.url + "/v1/chat/completions", content=raw, timeout=10.0)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_api_key_guards_the_openai_endpoints(workers3, make_router):
    router = make_router(workers=urls(workers3), api_key="sk-1")
    assert post(router, chat()).status_code == 401
    assert post(router, chat(), {"Authorization": "Bearer sk-1"}).status_code == 200
    assert HTTP.get(router.url + "/health").status_code == 200  # open for load balancers


def test_worker_api_key_replaces_the_clients(workers3, make_router):
    router = make_router(workers=urls(workers3[:1]), api_key="client", worker_api_key="inner")
    post(router, chat(), {"Authorization": "Bearer client", "X-Request-Id": "req-7"})
    last = workers3[0].seen()[-1]["headers"]
    assert last["authorization"] == "Bearer inner"
    assert last["x-request-id"] == "req-7"


def test_the_worker_is_asked_for_no_compression_the_client_did_not_ask_for(workers3, make_router):
    # The router passes content-encoding through undecoded, so it must not ask on its own.
    router = make_router(workers=urls(workers3[:1]))
    post(router, chat(), {"Accept-Encoding": "identity"})
    last = workers3[0].seen()[-1]["headers"]
    assert "accept-encoding" not in last and "user-agent" not in last


def test_models_come_from_a_worker(workers3, make_router):
    router = make_router(workers=urls(workers3))
    r = HTTP.get(router.url + "/v1/models", timeout=10.0)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "fake"


def test_metrics_count_requests_per_worker_and_role(workers3, make_router):
    router = make_router(workers=urls(workers3))
    for s in range(6):
        post(router, chat(), {"X-Session-Id": f"s{s}"})
    assert metric(router, "splitserve:router_requests_total") == 6
    text = HTTP.get(router.url + "/metrics").text
    assert 'splitserve:router_requests_total{role="decode",worker="' in text


def test_prefetch_hint_goes_to_the_sessions_decode_worker(workers3, make_router):
    router = make_router(workers=urls(workers3), prefetch_hints=True)
    body = chat("hint")
    r = post(router, body, {"X-Session-Id": "hint"})
    home = next(w for w in workers3 if w.url == r.headers[DECODE_HEADER])
    wait_until(lambda: any(s["path"] == "/v1/kv/prefetch" for s in home.seen()), 10, "hint")
    [hint] = [s for s in home.seen() if s["path"] == "/v1/kv/prefetch"]
    assert hint["body"] == body


def test_no_prefetch_hint_unless_turned_on(workers3, make_router):
    plain = make_router(workers=urls(workers3))
    hinted = make_router(workers=urls(workers3), prefetch_hints=True)
    post(plain, chat("off"), {"X-Session-Id": "off"})
    post(hinted, chat("marker"), {"X-Session-Id": "marker"})  # sent after the plain one

    def hinted_texts() -> list[str]:
        hints = [s for w in workers3 for s in w.seen() if s["path"] == "/v1/kv/prefetch"]
        texts = [s["body"]["messages"][0]["content"] for s in hints]
        return [t for t in texts if t in ("hello from off", "hello from marker")]

    wait_until(lambda: bool(hinted_texts()), 10, "hint")
    assert hinted_texts() == ["hello from marker"]


def test_a_cookie_one_worker_answer_sets_never_reaches_other_requests(workers3, make_router):
    # Regression: the router's one upstream session kept a cookie jar shared by all clients
    # (it takes cookies from host names, not from IP addresses: hence localhost).
    router = make_router(workers=[workers3[0].url.replace("127.0.0.1", "localhost")])
    workers3[0].mode(set_cookie=True)
    post(router, chat("a"))
    post(router, chat("b"))
    assert [s["headers"].get("cookie") for s in workers3[0].seen()[-2:]] == [None, None]
