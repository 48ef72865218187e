"""``splitserve sim``, ``sim plan``: the bench summary, the plan table, clear input errors."""

from __future__ import annotations

import json

from splitserve.cli import main


def test_sim_prints_the_bench_summary_and_writes_json(capsys, tmp_path):
    out = tmp_path / "run.json"
    args = ["sim", "--workload", "agentic", "--num-sessions", "20", "--rate", "4"]
    args += [
        "--prefill",
        "1",
        "--decode",
        "2",
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "p.png"),
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "Simulated Serving Result" in text and "Request goodput (req/s):" in text
    assert "deployment: 1P:2D at TP1 (3 GPUs)" in text
    data = json.loads(out.read_text())
    assert data["summary"]["completed"] == len(data["records"]) > 20
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_sim_plan_prints_a_table_with_the_best_first(capsys):
    args = ["sim", "plan", "--gpus", "2", "--workload", "random", "--input-len", "512"]
    args += ["--output-len", "16", "--num-sessions", "40", "--iters", "3", "--slo", "ttft:500"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "2 collocated at TP1 (2 GPUs)" in text and "1P:1D at TP1 (2 GPUs)" in text
    assert "best: " in text


def test_bad_input_is_a_clear_message_not_a_traceback(capsys):
    assert main(["sim", "--workload", "mooncake"]) == 2
    assert "needs --trace" in capsys.readouterr().err
    assert main(["sim", "--model", "llama3-70b", "--hardware", "h100"]) == 2
    assert "does not fit" in capsys.readouterr().err
    assert main(["sim", "--slo", "latency:5"]) == 2
    assert "unknown SLO" in capsys.readouterr().err
    assert main(["sim", "--calibration", "/nonexistent.json", "--hardware", "cpu-local"]) == 2
    assert "cannot read calibration file" in capsys.readouterr().err
    assert main(["sim", "--rate", "0"]) == 2
    assert "--rate must be > 0" in capsys.readouterr().err
    assert main(["sim", "--kv-cache-gb", "0"]) == 2
    assert "kv_cache_gb must be > 0" in capsys.readouterr().err
