"""Erasure is namespaced by tenant: an in-process worker on the real engine, with a stand-in
for authentication that sets ``request.state.tenant`` from a test header."""

from __future__ import annotations

import asyncio
import random

import httpx

from splitserve.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.worker.server import create_app


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def test_erasing_a_session_of_one_tenant_leaves_the_same_session_of_another():
    engine = LLMEngine(EngineConfig(kv_cache_gb=0.05, max_model_len=512, threads=1))
    app = create_app(engine)

    @app.middleware("http")
    async def tenant(request, call_next):  # what the tenants' authentication will do
        request.state.tenant = request.headers.get("x-test-tenant", "")
        return await call_next(request)

    async def turn(client, tenant: str, prompt: list[int]) -> dict:
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
        headers = {"x-test-tenant": tenant, "X-Session-Id": "s"}
        r = await client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def main() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://w", timeout=60
            ) as client:
                a, b = tokens(1, 70), tokens(2, 70)
                await turn(client, "A", a)
                await turn(client, "B", b)
                r = await client.delete("/v1/sessions/s", headers={"x-test-tenant": "A"})
                assert r.status_code == 200 and r.json()["tenant"] == "A"
                assert r.json()["removed"]["device"] == 4  # 70 prompt + 3 computed: 4 blocks
                assert await turn(client, "A", a) == 0
                assert await turn(client, "B", b) == 64  # B's session s was not touched
                r = await client.delete("/v1/tenants/B/kv", headers={"x-test-tenant": "A"})
                assert r.status_code == 403
                r = await client.delete("/v1/tenants/B/kv", headers={"x-test-tenant": "B"})
                assert r.status_code == 200 and r.json()["removed"]["device"] == 4
                assert await turn(client, "B", b) == 0

    asyncio.run(main())
