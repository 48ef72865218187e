"""Erasure is namespaced by tenant: an in-process worker on the real engine, two tenants
with their own keys, both using session id ``s``."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from splitserve.common.tenants import Tenants
from splitserve.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.worker.server import create_app


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def as_tenant(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer sk-{tenant}"}


def test_erasing_a_session_of_one_tenant_leaves_the_same_session_of_another(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"key": f"sk-{t}", "tenant": t} for t in ("A", "B")]))
    engine = LLMEngine(EngineConfig(kv_cache_gb=0.05, max_model_len=512, threads=1))
    app = create_app(engine, tenants=Tenants.load(keys))

    async def turn(client, tenant: str, prompt: list[int]) -> dict:
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
        headers = {**as_tenant(tenant), "X-Session-Id": "s"}
        r = await client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def main() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://w", timeout=60
            ) as client:
                a = b = tokens(1, 70)  # the same prompt: only the tenants' salts differ
                await turn(client, "A", a)
                await turn(client, "B", b)
                r = await client.delete("/v1/sessions/s", headers=as_tenant("A"))
                assert r.status_code == 200 and r.json()["tenant"] == "A"
                assert r.json()["removed"]["device"] == 4  # 70 prompt + 3 computed: 4 blocks
                assert await turn(client, "A", a) == 0
                assert await turn(client, "B", b) == 64  # B's session s was not touched
                r = await client.delete("/v1/tenants/B/kv", headers=as_tenant("A"))
                assert r.status_code == 403
                r = await client.delete("/v1/tenants/B/kv", headers=as_tenant("B"))
                assert r.status_code == 200 and r.json()["removed"]["device"] == 4
                assert await turn(client, "B", b) == 0

    asyncio.run(main())
