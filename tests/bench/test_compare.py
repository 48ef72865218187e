"""``splitserve bench compare`` starts a real deployment, runs the workload, reads the
router's and workers' counters, writes the tables and stops every process it started."""

from __future__ import annotations

import json

import psutil
import pytest

from splitserve.cli import main

TINY_AGENTIC = [
    *("--workload", "agentic", "--agent-types", "1", "--system-tokens", "96"),
    *("--task-tokens", "8", "--tool-calls", "1,1", "--tool-call-tokens", "4"),
    *("--answer-tokens", "4", "--tool-result-tokens", "8", "--tool-pause", "0.05"),
    *("--rate", "2", "--duration", "1", "--slo", "ttft:60000", "--no-progress"),
]


@pytest.mark.slow
def test_compare_runs_a_disaggregated_deployment(tmp_path, capsys):
    md, out = tmp_path / "table.md", tmp_path / "runs.json"
    argv = ["bench", "compare", "--deployments", "disagg", "--cores", "2", *TINY_AGENTIC]
    before = set(psutil.Process().children(recursive=True))  # other tests' session fixtures
    steps = tmp_path / "steps"
    assert main([*argv, "--markdown", str(md), "--json", str(out), "--step-logs", str(steps)]) == 0
    printed = capsys.readouterr().out
    (run,) = json.loads(out.read_text())
    s = run["summary"]
    assert run["deployment"] == "disagg" and s["completed"] >= 2 and s["failed"] == 0
    # Turn 0 (a 96-word system prompt) goes through the prefill worker; its KV is pulled.
    assert s["server"]["remote_prefills"] >= 1 and s["server"]["kv_bytes_transferred"] > 0
    assert s["server"]["prompt_tokens"] >= s["total_input_tokens"]
    # Every turn carries its session id; with one decode worker no turn can move.
    assert s["server"]["session_turns"] >= s["completed"]
    assert s["server"]["turns_moved"] == s["server"]["turns_moved_fraction"] == 0
    assert s["server"]["router_cpu_seconds"] > 0 and s["server"]["worker_cpu_seconds"] > 0
    assert "--prefill 1 --decode 1" in s["info"]["deployment"]
    # The router's workers, by URL and role: the simulator names its workers after them.
    listed = s["info"]["workers"]
    assert sorted(w["role"] for w in listed) == ["decode", "prefill"]
    assert all(w["url"].startswith("http://127.0.0.1:") for w in listed)
    # --step-logs: every worker logged its steps, under the deployment's name, as
    # <role>-<port>.jsonl; `sim calibrate --from-steps` fits them.
    logs = sorted(p.name for p in (steps / "disagg").iterdir())
    assert logs == sorted(f"{w['role']}-{w['url'].rsplit(':', 1)[1]}.jsonl" for w in listed)
    for name in logs:
        lines = (steps / "disagg" / name).read_text().splitlines()
        assert json.loads(lines[0])["engine"]["role"] == name.split("-")[0] and len(lines) > 1
    cal = tmp_path / "from-run.json"
    assert main(["sim", "calibrate", "--from-steps", str(steps), "--out", str(cal)]) == 0
    assert json.loads(cal.read_text())["fit"]["peak_flops_fp32"] > 1e9  # measured here
    assert "goodput req/s" in printed and "(1.00x)" in printed and "turns moved %" in printed
    assert md.read_text().startswith("| deployment | load | goodput req/s")
    assert set(psutil.Process().children(recursive=True)) <= before


@pytest.mark.slow
def test_repeats_interleave_the_deployments_and_add_a_table_of_means(tmp_path, capsys):
    md, out = tmp_path / "table.md", tmp_path / "runs.json"
    argv = ["bench", "compare", "--deployments", "collocated-rr", "--cores", "1", *TINY_AGENTIC]
    assert main([*argv, "--repeats", "2", "--markdown", str(md), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    runs = json.loads(out.read_text())
    assert [r["repeat"] for r in runs] == [1, 2]
    assert {r["deployment"] for r in runs} == {"collocated-rr"}
    # The same seed both times: the same sessions, so the same requests.
    assert runs[0]["summary"]["completed"] == runs[1]["summary"]["completed"] >= 2
    assert "rate 2/s, 1 s, run 1" in printed and "rate 2/s, 1 s, run 2" in printed
    per_run, means = md.read_text().split("\n\n")
    assert per_run.count("| collocated-rr |") == 2
    assert means.startswith("| deployment | load | runs | goodput mean req/s | min | max |")
    (row,) = means.splitlines()[2:]
    assert row.startswith("| collocated-rr | rate 2/s, 1 s | 2 |") and "| 1.00x |" in row
