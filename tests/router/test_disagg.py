"""The two-leg disaggregated flow: conditional remote prefill, then decode with its params."""

from __future__ import annotations

import pytest

from splitserve.router import disagg
from splitserve.router.proxy import DECODE_HEADER, PREFILL_HEADER

from .conftest import HTTP

pytestmark = pytest.mark.timeout(120)
LONG = "word " * 400  # 2,000 characters: about 500 tokens at 4 characters a token


def chat(content: str, stream: bool = False) -> dict:
    return {
        "messages": [{"role": "user", "content": content}],
        "stream": stream,
        "stream_options": {"include_usage": True},
        "max_tokens": 20,
    }


@pytest.fixture
def pd(workers3, make_router):
    prefill, decode = workers3[0], workers3[1]
    router = make_router(
        prefill=[prefill.url],
        decode=[decode.url],
        disaggregate=True,
        remote_prefill_threshold=256,
        health_interval_s=60,
    )
    return router, prefill, decode


def test_long_prompt_runs_both_legs(pd):
    router, prefill, decode = pd
    with HTTP.stream("POST", router.url + "/v1/chat/completions", json=chat(LONG, True)) as r:
        assert r.status_code == 200
        assert r.read().endswith(b"data: [DONE]\n\n")
    assert r.headers[PREFILL_HEADER] == prefill.url
    assert r.headers[DECODE_HEADER] == decode.url
    leg1 = prefill.seen()[-1]["body"]
    assert leg1["max_tokens"] == 1 and leg1["stream"] is False and leg1["n"] == 1
    assert leg1["kv_transfer_params"] == {"do_remote_decode": True}
    assert "stream_options" not in leg1
    leg2 = decode.seen()[-1]["body"]
    assert leg2["kv_transfer_params"]["do_remote_prefill"] is True
    assert leg2["kv_transfer_params"]["remote_engine_id"] == prefill.name
    assert leg2["max_tokens"] == 20 and leg2["stream"] is True
    assert (
        prefill.seen()[-1]["headers"]["x-request-id"]
        == decode.seen()[-1]["headers"]["x-request-id"]
    )


def test_short_prompt_prefills_locally(pd):
    router, prefill, decode = pd
    before = len(prefill.seen())
    r = HTTP.post(router.url + "/v1/chat/completions", json=chat("short"))
    assert r.status_code == 200 and PREFILL_HEADER not in r.headers
    assert len(prefill.seen()) == before
    assert "kv_transfer_params" not in decode.seen()[-1]["body"]


def test_failed_prefill_falls_back_to_local_prefill(pd):
    router, prefill, decode = pd
    prefill.mode(mode="error500")
    r = HTTP.post(router.url + "/v1/chat/completions", json=chat(LONG))
    assert r.status_code == 200 and PREFILL_HEADER not in r.headers
    assert "kv_transfer_params" not in decode.seen()[-1]["body"]


def test_params_are_accepted_only_when_the_prefill_worker_kept_the_kv():
    assert disagg.accepted_params({"kv_transfer_params": {"do_remote_decode": True}}) is None
    assert disagg.accepted_params({"kv_transfer_params": None}) is None
    assert disagg.accepted_params([]) is None
    params = {"do_remote_prefill": True, "remote_block_ids": [3]}
    assert disagg.accepted_params({"kv_transfer_params": params}) == params
