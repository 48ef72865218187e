"""The HTTP layer in-process on a fake engine: auth, queue limits, engine failures, SSE shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import httpx
import pytest

from splitserve.worker.server import create_app
from tests.worker.fake_engine import FakeEngine

KEY = "sk-test"


def run_app(
    engine: FakeEngine, test: Callable[[httpx.AsyncClient], Awaitable[None]], **app_options
) -> None:
    """Run ``test`` against an app on ``engine`` with its lifespan (engine thread) active."""
    app = create_app(engine, **app_options)

    async def main() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://test", timeout=10
            ) as client:
                await test(client)

    asyncio.run(main())


def completion(max_tokens: int = 3, **extra) -> dict:
    return {"model": "fake-model", "prompt": "hi", "max_tokens": max_tokens, **extra}


def test_api_key_guards_the_api_but_not_health_or_metrics():
    async def test(client: httpx.AsyncClient) -> None:
        for method, path in [
            ("GET", "/v1/models"),
            ("GET", "/load"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
        ]:
            r = await client.request(method, path, json=completion())
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
            r = await client.request(
                method, path, json=completion(), headers={"Authorization": "Bearer wrong"}
            )
            assert r.status_code == 401, path
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        ok = await client.post(
            "/v1/completions", json=completion(), headers={"Authorization": f"Bearer {KEY}"}
        )
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "abc"

    run_app(FakeEngine(), test, api_key=KEY)


def test_full_waiting_queue_answers_429_then_recovers():
    engine = FakeEngine()
    engine.hold = True  # nothing leaves the waiting queue

    async def test(client: httpx.AsyncClient) -> None:
        first = asyncio.create_task(client.post("/v1/completions", json=completion()))
        await _until(lambda: engine.num_waiting == 1)
        r = await client.post("/v1/completions", json=completion())
        assert r.status_code == 429
        assert r.json()["error"] == {
            "message": r.json()["error"]["message"],
            "type": "rate_limit_error",
            "param": None,
            "code": "queue_full",
        }
        engine.hold = False  # the idle engine thread notices within its poll interval
        assert (await asyncio.wait_for(first, 10)).status_code == 200

    run_app(engine, test, max_waiting=1)


def test_engine_failure_fails_in_flight_requests_and_the_worker_keeps_serving():
    engine = FakeEngine()
    engine.fail_next_step = True

    async def test(client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/completions", json=completion())
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        r = await client.post("/v1/completions", json=completion())
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"
        assert (await client.get("/health")).status_code == 200

    run_app(engine, test)


def test_chat_stream_has_role_content_finish_usage_and_done():
    async def test(client: httpx.AsyncClient) -> None:
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
        assert text == "abc"
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        assert all(c["usage"] is None for c in chunks[:-1])

    run_app(FakeEngine(), test)


def test_load_reports_running_requests_and_blocks():
    engine = FakeEngine(step_s=0.01)

    async def test(client: httpx.AsyncClient) -> None:
        r = await client.get("/load")
        assert r.json() == {
            "running": 0,
            "waiting": 0,
            "requests": 0,
            "kv_blocks_used": 0,
            "kv_blocks_total": 100,
            "kv_usage": 0.0,
            "kv_blocks_leased": 0,
        }
        task = asyncio.create_task(client.post("/v1/completions", json=completion(200)))
        await _until_async(client, lambda load: load["running"] == 1 and load["requests"] == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await _until_async(client, lambda load: load["requests"] == 0)

    run_app(engine, test)


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


async def _until_async(client: httpx.AsyncClient, cond, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond((await client.get("/load")).json()):
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("path", ["/v1/completions", "/nope"])
def test_unknown_routes_and_methods_use_the_error_body(path):
    async def test(client: httpx.AsyncClient) -> None:
        r = await client.get(path)
        assert r.status_code in (404, 405)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    run_app(FakeEngine(), test)


def test_metrics_count_tokens_latencies_and_errors():
    async def test(client: httpx.AsyncClient) -> None:
        assert (await client.post("/v1/completions", json=completion())).status_code == 200
        assert (await client.post("/v1/completions", json={"prompt": ""})).status_code == 400
        text = (await client.get("/metrics")).text
        for line in (
            'splitserve:request_success_total{finished_reason="length"} 1.0',
            'splitserve:request_errors_total{status="400"} 1.0',
            "splitserve:generation_tokens_total 3.0",
            "splitserve:prompt_tokens_total 2.0",
            "splitserve:time_to_first_token_seconds_count 1.0",
            "splitserve:inter_token_latency_seconds_count 2.0",
            "splitserve:e2e_request_latency_seconds_count 1.0",
            "splitserve:kv_cache_usage_perc 0.0",
        ):
            assert line in text, line
        # Every engine step is timed: at least one per generated token.
        steps = [ln for ln in text.splitlines() if ln.startswith("splitserve:engine_step_seconds_")]
        count = next(float(ln.split()[1]) for ln in steps if "_count" in ln)
        total = next(float(ln.split()[1]) for ln in steps if "_sum" in ln)
        assert count >= 3 and total > 0
        cpu = float(text.split("\nsplitserve:engine_cpu_seconds_total ")[1].split()[0])
        assert 0 < cpu <= total + 0.01  # the engine thread's CPU within the steps' wall time
        assert "\nprocess_cpu_seconds_total " in text

    run_app(FakeEngine(), test)


def test_a_client_written_kv_peer_or_transfer_is_refused_and_nothing_is_lent():
    async def test(client: httpx.AsyncClient) -> None:
        for name, value in (
            ("kv_peer", "http://127.0.0.1:9"),
            ("kv_transfer_params", {"do_remote_prefill": True, "remote_host": "10.0.0.1"}),
        ):
            r = await client.post("/v1/completions", json=completion(**{name: value}))
            assert r.status_code == 400, name
            assert r.json()["error"]["param"] == name
            assert "only be set by the router" in r.json()["error"]["message"]
        r = await client.post("/v1/kv/lease", json={"prompt_token_ids": [1, 2, 3]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "kv_peer_disabled"

    run_app(FakeEngine(), test)
