"""The request body bound (``common.body_limit``) on its own, in the worker and in the router."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from splitserve.common.body_limit import BodyLimit
from splitserve.router.app import create_app as create_router
from splitserve.router.config import RouterConfig
from splitserve.worker.server import create_app as create_worker
from tests.worker.fake_engine import FakeEngine

LIMIT = 1000


async def echo_length(scope, receive, send) -> None:
    """Reads the whole body and answers its length."""
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


def post(app, body: bytes, chunked: bool = False, path: str = "/", key: str = "") -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

            async def pieces():
                for i in range(0, len(body), 100):
                    yield body[i : i + 100]

            content = pieces() if chunked else body
            return await client.post(path, content=content, headers={"authorization": key})

    return asyncio.run(main())


def assert_413(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and str(LIMIT) in error["message"]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_at_the_limit_passes_one_over_it_is_a_413(chunked):
    app = BodyLimit(echo_length, LIMIT)
    assert post(app, b"x" * LIMIT, chunked).text == str(LIMIT)
    assert_413(post(app, b"x" * (LIMIT + 1), chunked))


def test_a_declared_length_over_the_limit_is_refused_before_the_app_runs():
    called = []

    async def app(scope, receive, send):
        called.append(scope)

    limited = BodyLimit(app, LIMIT)
    messages = []

    async def send(message):
        messages.append(message)

    async def receive():
        raise AssertionError("the body was read")

    scope = {"type": "http", "headers": [(b"content-length", str(2**40).encode())]}
    asyncio.run(limited(scope, receive, send))
    assert not called and messages[0]["status"] == 413


def test_the_limit_must_be_positive():
    with pytest.raises(ValueError):
        BodyLimit(echo_length, 0)


@pytest.mark.parametrize("chunked", [False, True])
def test_the_worker_answers_413_in_openai_form(chunked):
    app = create_worker(FakeEngine(), max_body_bytes=LIMIT)
    body = b'{"prompt": "' + b"a" * LIMIT + b'"}'
    assert_413(post(app, body, chunked, "/v1/completions"))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/workers"])
@pytest.mark.parametrize("chunked", [False, True])
def test_the_router_answers_413_in_openai_form(path, chunked):
    config = RouterConfig(workers=["http://127.0.0.1:9"], max_body_bytes=LIMIT, api_key="k")
    body = b'{"prompt": "' + b"a" * LIMIT + b'"}'
    assert_413(post(create_router(config), body, chunked, path, "Bearer k"))
