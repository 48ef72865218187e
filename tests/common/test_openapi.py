"""``/openapi.json`` of the worker and the router: the real request bodies and answers."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from splitserve.router.app import create_app as create_router
from splitserve.router.config import RouterConfig
from splitserve.worker.server import create_app as create_worker
from tests.worker.fake_engine import FakeEngine

OPENAI = {
    ("post", "/v1/chat/completions"): "ChatCompletionRequest",
    ("post", "/v1/completions"): "CompletionRequest",
    ("get", "/v1/models"): None,
}


def worker_schema(api_key: str | None = "k") -> dict:
    return TestClient(create_worker(FakeEngine(), api_key=api_key)).get("/openapi.json").json()


def router_schema(**options) -> dict:
    config = RouterConfig(workers=["http://127.0.0.1:9"], **options)
    return TestClient(create_router(config)).get("/openapi.json").json()


def body_ref(op: dict) -> str | None:
    body = op.get("requestBody")
    return body and body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]


@pytest.mark.parametrize("schema", [worker_schema, router_schema], ids=["worker", "router"])
def test_the_openai_operations_name_their_request_models(schema):
    doc = schema()
    for (method, path), model in OPENAI.items():
        op = doc["paths"][path][method]
        assert body_ref(op) == model, path
        assert "ErrorResponse" in str(op["responses"]["503"]), path
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["messages"] and chat["additionalProperties"] is True
    assert doc["components"]["schemas"]["ToolDefinition"]["required"] == ["function"]
    ok = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(ok) == {"application/json", "text/event-stream"}
    assert doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"].keys() == {"text/plain"}


def test_the_worker_describes_its_kv_routes_and_its_key():
    doc = worker_schema()
    for path in ("/v1/kv/prefetch", "/v1/kv/lease"):
        assert body_ref(doc["paths"][path]["post"]) == "KVPrefetchRequest"
    assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert doc["paths"]["/load"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert "security" not in worker_schema(api_key=None)["paths"]["/v1/completions"]["post"]


def test_the_router_describes_membership_behind_the_admin_key():
    doc = router_schema(api_key="k", admin_key="a")
    add = doc["paths"]["/workers"]["post"]
    assert add["requestBody"]["content"]["application/json"]["schema"]["required"] == ["url"]
    assert {"200", "201", "400", "401", "403"} <= set(add["responses"])
    assert add["security"] == [{"admin": []}]
    assert doc["paths"]["/v1/chat/completions"]["post"]["security"] == [{"bearer": []}]
