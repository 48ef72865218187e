"""The access log (``--access-log``): a real worker and a real router process writing it, every
line parsed; no prompt or output text and no key in any file; rotation by size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from procs import die_with_parent, free_port, start_worker, stop_group, wait_healthy

from splitserve.common.access_log import FIELDS, AccessLog

pytestmark = pytest.mark.timeout(300)

KEY = "sk-accesslog-test-key"
MARKER = "quokkasaurus"  # in every prompt; must reach no log file
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"


def start_router(worker: str, log: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "router", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--decode", worker, "--log-level", "warning"]
    argv += ["--api-key", KEY, "--worker-api-key", KEY, "--access-log", str(log)]
    proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with_parent)
    return f"http://127.0.0.1:{port}", proc


def read_lines(path: Path) -> list[dict]:
    """Every line of the log and its rotated files, each parsed, oldest file first."""
    files = sorted(path.parent.glob(path.name + "*"), key=lambda p: p.name, reverse=True)
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def chat(url: str, session: str, request_id: str, stream: bool = False, **extra) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": f"Say hello to {MARKER}."}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": stream,
        **extra,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {**AUTH, "X-Session-Id": session, "X-Request-Id": request_id}
    return httpx.post(url + CHAT, json=body, headers=headers, timeout=120)


def streamed_usage(r: httpx.Response) -> dict:
    chunks = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
    return [json.loads(c) for c in chunks if json.loads(c).get("usage")][-1]["usage"]


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> dict:
    """Run the requests through a router and a worker both logging; their lines and usages."""
    root = tmp_path_factory.mktemp("access")
    worker_log, router_log = root / "worker.log", root / "router.log"
    worker, wproc = start_worker(["--api-key", KEY, "--access-log", str(worker_log)])
    router, rproc = None, None
    try:
        wait_healthy(worker, wproc)
        router, rproc = start_router(worker, router_log)
        wait_healthy(router, rproc)
        whole = chat(router, "sess-whole", "req-whole")
        assert whole.status_code == 200, whole.text
        streamed = chat(router, "sess-stream", "req-stream", stream=True)
        assert streamed.status_code == 200, streamed.text
        bad_key = httpx.post(worker + CHAT, json={}, headers={"Authorization": "Bearer no"})
        assert bad_key.status_code == 401
        refused = httpx.post(router + CHAT, json={}, headers={"Authorization": "Bearer no"})
        assert refused.status_code == 401
        bad = chat(router, "sess-bad", "req-bad", max_tokens=-1)
        assert bad.status_code == 400, bad.text
    finally:
        if rproc is not None:
            stop_group(rproc)  # a stopping server writes what is queued
        stop_group(wproc)
    return {
        "worker": worker,
        "files": [root / "worker.log", root / "router.log"],
        "worker_lines": read_lines(worker_log),
        "router_lines": read_lines(router_log),
        "whole": whole.json()["usage"],
        "streamed": streamed_usage(streamed),
    }


def tokens(line: dict) -> dict:
    return {k: line[k] for k in ("prompt_tokens", "cached_tokens", "completion_tokens")}


def usage_tokens(usage: dict) -> dict:
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        "completion_tokens": usage["completion_tokens"],
    }


def test_every_line_has_every_field(logged):
    for line in logged["worker_lines"] + logged["router_lines"]:
        assert tuple(line) == FIELDS
        assert line["latency_s"] > 0
        assert line["time"].endswith("+00:00")


def test_no_prompt_output_or_key_in_any_file(logged):
    for path in logged["files"]:
        text = path.read_text()
        assert MARKER not in text.lower()
        assert KEY not in text
        assert "hello" not in text.lower()


def test_router_lines(logged):
    by_id = {line["request_id"]: line for line in logged["router_lines"]}
    assert [line["status"] for line in logged["router_lines"]] == [200, 200, 401, 400]
    whole, streamed = by_id["req-whole"], by_id["req-stream"]
    assert whole["server"] == "router" and whole["path"] == CHAT
    assert (whole["tenant"], whole["session"]) == ("default", "sess-whole")
    assert whole["workers"] == [logged["worker"]]
    assert tokens(whole) == usage_tokens(logged["whole"])
    assert (streamed["session"], streamed["workers"]) == ("sess-stream", [logged["worker"]])
    assert streamed["prompt_tokens"] is None  # a relayed stream's usage is not parsed
    refused = logged["router_lines"][2]
    assert (refused["tenant"], refused["workers"], refused["session"]) == (None, None, None)
    assert by_id["req-bad"]["tenant"] == "default"


def test_worker_lines(logged):
    lines = [line for line in logged["worker_lines"] if line["path"] == CHAT]
    assert [line["status"] for line in lines] == [200, 200, 401, 400]
    whole, streamed, bad_key, bad = lines
    assert whole["server"] == "worker"
    assert (whole["tenant"], whole["session"], whole["request_id"]) == (
        "default",
        "sess-whole",
        "req-whole",
    )
    assert tokens(whole) == usage_tokens(logged["whole"])
    assert (streamed["session"], streamed["request_id"]) == ("sess-stream", "req-stream")
    assert tokens(streamed) == usage_tokens(logged["streamed"])
    assert bad_key["tenant"] is None and bad["tenant"] == "default"
    assert whole["kv_blocks_received"] is None and whole["workers"] is None


def test_rotation_by_size_keeps_the_backups(tmp_path):
    path = tmp_path / "access.log"
    log = AccessLog(str(path), max_bytes=1000, backups=2)
    for i in range(100):
        log.write(arrived=0.0, server="worker", status=200, request_id=f"r{i}")
    log.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["access.log", "access.log.1", "access.log.2"]
    lines = read_lines(path)
    assert all(path.stat().st_size <= 1000 for path in tmp_path.iterdir())
    # The newest lines are kept, in order; the oldest rotated away.
    ids = [line["request_id"] for line in lines]
    assert ids == [f"r{i}" for i in range(100 - len(ids), 100)]
    assert lines[0]["time"] == "1970-01-01T00:00:00.000+00:00"


def test_serve_gives_each_process_its_own_file():
    from splitserve.cli import build_parser, serve_topology, serve_worker_args
    from splitserve.cluster.local import own_access_log

    argv = ["serve", "--decode", "2", "--access-log", "/logs/a", "--access-log-max-mb", "5"]
    args = build_parser().parse_args(argv)
    router_args = list(serve_topology(args).router_args)
    assert router_args[-4:] == ["--access-log", "/logs/a.router", "--access-log-max-mb", "5.0"]
    worker_args = own_access_log(serve_worker_args(args), "decode-1")
    worker = build_parser().parse_args(["worker", *worker_args])
    assert (worker.access_log, worker.access_log_max_mb) == ("/logs/a.decode-1", 5.0)
