"""``splitserve bench`` against a live worker (a real process, the bundled model): the JSON
holds every figure, and the client's counts agree with the server's own ``/metrics``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from procs import (
    copy_checkout,
    env_for_checkout,
    metric,
    start_worker,
    stop_group,
    wait_healthy,
)

from splitserve.cli import build_parser, main
from splitserve.workload.args import workload_from_args
from splitserve.workload.sessions import within

AGENTIC = [
    *("--workload", "agentic", "--agent-types", "2", "--system-tokens", "32"),
    *("--task-tokens", "8", "--tool-calls", "1,1", "--tool-call-tokens", "4"),
    *("--answer-tokens", "6", "--tool-result-tokens", "8", "--tool-pause", "0.05"),
    *("--rate", "3", "--duration", "1", "--seed", "11"),
    *("--slo", "ttft:60000,tpot:60000", "--session-slo", "jct:600000", "--no-progress"),
]
# hash ids: B shares two leading blocks with A, C one; arrivals 1 s apart, so each request
# finds the previous ones' blocks cached.
TRACE = [
    {"timestamp": 0, "input_length": 1536, "output_length": 128, "hash_ids": [0, 1, 2]},
    {"timestamp": 1000, "input_length": 2048, "output_length": 128, "hash_ids": [0, 1, 3, 4]},
    {"timestamp": 2000, "input_length": 1024, "output_length": 128, "hash_ids": [0, 7]},
]


@pytest.fixture(scope="module")
def worker():
    url, proc = start_worker([])
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        stop_group(proc)


def _bench(url, args, tmp_path, capsys):
    out = tmp_path / "run.json"
    assert main(["bench", "--url", url, *args, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_agentic_run_matches_the_servers_metrics(worker, tmp_path, capsys):
    before = {k: metric(worker, k) for k in ("splitserve:prompt_tokens_total",)}
    (run,), printed = _bench(worker, AGENTIC, tmp_path, capsys)
    s, reqs = run["summary"], run["requests"]
    specs = list(
        within(workload_from_args(build_parser().parse_args(["bench", *AGENTIC])).sessions(3), 1)
    )
    assert len(specs) >= 2 and s["sessions"] == len(specs) == s["sessions_ok"]
    assert s["completed"] == len(reqs) == sum(len(x.turns) for x in specs) and s["failed"] == 0
    assert s["total_output_tokens"] == sum(t.output_len for x in specs for t in x.turns)
    # The server saw exactly what the client counted (ignore_eos: exact lengths).
    server = s["server"]
    assert server["prompt_tokens"] == s["total_input_tokens"]
    assert server["generation_tokens"] == s["total_output_tokens"]
    assert server["cached_prompt_tokens"] == s["cached_tokens"] > 0  # shared system prompts
    assert server["requests_finished"] == s["completed"]
    # Where the CPU went: the engine thread's steps within the worker process's CPU and
    # within the steps' wall time; the load generator's own.
    assert 0 < server["engine_cpu_seconds"] <= server["engine_busy_seconds"] + 0.01
    assert server["engine_cpu_seconds"] < server["worker_cpu_seconds"]
    assert server["client_cpu_seconds"] > 0
    after = metric(worker, "splitserve:prompt_tokens_total")
    assert after - before["splitserve:prompt_tokens_total"] >= server["prompt_tokens"]
    # One token per synthetic word: turn 0's prompt is the spec's plus a constant template.
    by_id = {x.session_id: x for x in specs}
    overhead = {
        r["prompt_tokens"] - by_id[r["session_id"]].input_len(0) for r in reqs if r["turn"] == 0
    }
    assert len(overhead) == 1 and 0 < overhead.pop() < 32
    for r in reqs:
        assert r["ok"] and r["ttft_s"] > 0 and len(r["itl_s"]) == r["output_tokens"] - 1
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])  # generous SLO
    assert s["session_goodput"] > 0 and s["ttft"]["percentiles"]["99"] > 0
    assert "Request goodput (req/s):" in printed and "prefix_cache_hit_rate:" in printed


def test_trace_replay_reuses_exactly_the_traces_blocks(worker, tmp_path, capsys):
    trace = tmp_path / "tiny.jsonl"
    trace.write_text("".join(json.dumps(t) + "\n" for t in TRACE))
    args = ["--workload", "mooncake", "--trace", str(trace), "--rate", "1", "--duration", "5"]
    (run,), _ = _bench(worker, [*args, "--no-progress"], tmp_path, capsys)
    reqs = sorted(run["requests"], key=lambda r: r["start_s"])
    assert [r["prompt_tokens"] for r in reqs] == [48, 64, 32]
    assert [r["cached_tokens"] for r in reqs] == [0, 32, 16]
    assert [r["output_tokens"] for r in reqs] == [4, 4, 4]
    assert run["summary"]["server"]["cached_prompt_tokens"] == 48


def test_the_shipped_mooncake_trace_replays_from_a_lone_copy(worker, tmp_path):
    """``splitserve bench --workload mooncake`` run from a copy of the project in a directory
    with nothing beside it: the trace is the one inside the package."""
    copy = copy_checkout(tmp_path / "lone")
    out = tmp_path / "run.json"
    argv = [sys.executable, "-m", "splitserve.cli", "bench", "--url", worker]
    argv += ["--workload", "mooncake", "--max-input-len", "128", "--rate", "4"]
    argv += ["--duration", "0.5", "--drain", "60", "--no-progress", "--json", str(out)]
    run = subprocess.run(
        argv, env=env_for_checkout(copy), cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "mooncake trace mooncake_conversation_trace.jsonl: 12031 requests" in run.stdout
    (result,) = json.loads(out.read_text())
    assert result["summary"]["completed"] >= 1 and result["summary"]["failed"] == 0


def test_closed_loop_random(worker, tmp_path, capsys):
    args = ["--workload", "random", "--input-len", "20", "--output-len", "3"]
    args += ["--concurrency", "2", "--duration", "0.5", "--no-progress"]
    (run,), printed = _bench(worker, args, tmp_path, capsys)
    s = run["summary"]
    assert (
        s["completed"] >= 2 and s["failed"] == 0 and s["total_output_tokens"] == 3 * s["completed"]
    )
    assert "concurrency 2" in printed


def test_errors_are_counted_not_fatal(tmp_path, capsys):
    from splitserve.cluster.local import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    args = ["--workload", "random", "--input-len", "8", "--output-len", "2", "--rate", "5"]
    (run,), _ = _bench(dead, [*args, "--duration", "0.5", "--no-progress"], tmp_path, capsys)
    s = run["summary"]
    assert s["completed"] == 0 and s["failed"] >= 1 and s["errors"] == {"ConnectError": s["failed"]}
