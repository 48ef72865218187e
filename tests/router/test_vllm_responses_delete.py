"""``DELETE /v1/responses/{id}`` over vLLM workers: vLLM can delete no stored response and
erase no chain's KV, so the router answers a 400 that says so instead of passing on vLLM's
405 (a fake worker stands in for vLLM: the router answers without asking it)."""

from __future__ import annotations

import openai
import pytest

from .conftest import HTTP
from .test_proxy import urls

pytestmark = pytest.mark.timeout(120)


def test_deleting_a_response_on_vllm_workers_is_a_400_that_says_why(workers3, make_router):
    router = make_router(workers=urls(workers3[:1]), worker_engine="vllm")
    r = HTTP.delete(router.url + "/v1/responses/resp_" + "a" * 48, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_on_vllm"
    assert error["param"] == "response_id" and "erase" in error["message"]
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="not supported with vLLM workers"):
        client.responses.delete("resp_" + "b" * 48)
