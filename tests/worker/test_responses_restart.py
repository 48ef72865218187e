"""A response chain survives its worker's restart when the worker has a disk KV tier: the
stored conversation is on disk next to the tier (``worker/saved_responses.py``), and the
chain's KV is read back from the tier instead of computed."""

from __future__ import annotations

import httpx
import pytest
from procs import metric, start_worker, stop_group, wait_healthy

pytestmark = pytest.mark.timeout(600)

INSTRUCTIONS = "You are a careful assistant for a lighthouse keeper. Answer briefly. " * 3


def turn(url: str, text: str, previous: str | None = None) -> httpx.Response:
    body = {"input": text, "instructions": INSTRUCTIONS, "max_output_tokens": 8, "temperature": 0}
    if previous is not None:
        body["previous_response_id"] = previous
    return httpx.post(f"{url}/v1/responses", json=body, timeout=120)


def test_a_chain_goes_on_after_its_worker_restarts_with_its_kv_from_disk(tmp_path):
    args = ["--max-model-len", "1024", "--disk-kv-dir", str(tmp_path / "kv")]
    url, proc = start_worker(args)
    try:
        wait_healthy(url, proc)
        first = turn(url, "When was the lamp last cleaned?")
        assert first.status_code == 200, first.text
        gone = turn(url, "And the other one?").json()["id"]  # deleted before the restart
        assert httpx.delete(f"{url}/v1/responses/{gone}", timeout=30).status_code == 200
    finally:
        stop_group(proc)  # SIGTERM: the disk tier's pending writes land first

    url, proc = start_worker(args)
    try:
        wait_healthy(url, proc)
        rid = first.json()["id"]
        assert httpx.get(f"{url}/v1/responses/{rid}", timeout=30).json() == first.json()
        second = turn(url, "And the lens?", previous=rid)
        assert second.status_code == 200, second.text
        usage = second.json()["usage"]
        context = first.json()["usage"]["total_tokens"]
        # The previous turn's whole blocks, read from the disk tier (nothing on the device).
        assert usage["input_tokens_details"]["cached_tokens"] >= (context - 1) // 16 * 16 > 0
        assert metric(url, 'splitserve:kv_tier_hits_total{tier="disk"}') > 0
        missing = turn(url, "Hm?", previous=gone)
        assert missing.status_code == 400
        assert missing.json()["error"]["code"] == "previous_response_not_found"
        # Erasing the tenant's KV erases its stored conversations, on disk too.
        erased = httpx.delete(f"{url}/v1/tenants/default/kv", timeout=60).json()
        assert erased["responses"] == 2
        assert not [p for p in (tmp_path / "kv" / "responses").rglob("*") if p.is_file()]
        assert httpx.get(f"{url}/v1/responses/{rid}", timeout=30).status_code == 404
    finally:
        stop_group(proc)
