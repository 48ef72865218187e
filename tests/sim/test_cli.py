"""``splitserve sim``, ``sim plan``: the bench summary, the plan table, clear input errors."""

from __future__ import annotations

import json

from splitserve.cli import main


def test_sim_prints_the_bench_summary_and_writes_json(capsys, tmp_path):
    out, png = tmp_path / "run.json", tmp_path / "p.png"
    args = ["sim", "--workload", "agentic", "--duration", "5", "--sweep", "2,4"]
    args += ["--prefill", "1", "--decode", "2", "--json", str(out), "--plot", str(png)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "Simulated: rate 2" in text and "Request goodput (req/s):" in text
    assert "deployment: 1P:2D at TP1 (3 GPUs)" in text
    runs = json.loads(out.read_text())
    assert [r["rate"] for r in runs] == [2.0, 4.0]
    assert runs[1]["summary"]["completed"] == len(runs[1]["requests"]) > 40
    assert png.stat().st_size > 1000


def test_sim_with_a_host_kv_tier_reports_its_loads(capsys, tmp_path):
    out = tmp_path / "run.json"
    args = ["sim", "--workload", "agentic", "--duration", "10", "--rate", "4"]
    args += ["--kv-cache-gb", "0.25", "--host-kv-gb", "2", "--disk-kv-gb", "4", "--json", str(out)]
    assert main(args) == 0
    assert "KV blocks loaded from host RAM:" in capsys.readouterr().out
    server = json.loads(out.read_text())[0]["summary"]["server"]
    assert server["KV tier loads"] > 0 and server["KV blocks saved below the pool"] > 0
    assert main(["sim", "--rate", "1", "--host-kv-gb", "-1"]) == 2
    assert "must be >= 0" in capsys.readouterr().err


def test_sim_takes_the_engine_and_router_settings_of_serve():
    from splitserve.cli import build_parser
    from splitserve.sim.cli import build_config

    argv = ["sim", "--rate", "1", "--scheduling-policy", "shortest-prefill"]
    argv += ["--load-factor", "1.5", "--load-floor", "3", "--kv-peer-fetch", "--host-cores", "2"]
    cfg = build_config(build_parser().parse_args(argv))
    assert (cfg.scheduling_policy, cfg.load_factor, cfg.load_floor) == ("shortest-prefill", 1.5, 3)
    assert (cfg.kv_peer_fetch, cfg.host_cores) == (True, 2)


def test_sim_plan_prints_a_table_with_the_best_first(capsys):
    args = ["sim", "plan", "--gpus", "2", "--workload", "random", "--input-len", "512"]
    args += ["--output-len", "16", "--duration", "4", "--iters", "3", "--slo", "ttft:500"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "2 collocated at TP1 (2 GPUs)" in text and "1P:1D at TP1 (2 GPUs)" in text
    assert "best: " in text


def test_sim_plan_says_when_the_rate_range_is_too_low(capsys):
    args = ["sim", "plan", "--gpus", "1", "--workload", "random", "--input-len", "64"]
    args += ["--output-len", "4", "--duration", "2", "--iters", "2", "--rate-range", "0.5", "1"]
    assert main(args) == 0
    assert "at the top of --rate-range (1); raise it" in capsys.readouterr().out


def test_bad_input_is_a_clear_message_not_a_traceback(capsys):
    assert main(["sim", "--workload", "azure", "--rate", "1"]) == 2
    assert "needs --trace" in capsys.readouterr().err
    assert main(["sim", "--rate", "1", "--model", "llama3-70b", "--hardware", "h100"]) == 2
    assert "does not fit" in capsys.readouterr().err
    assert main(["sim", "--rate", "1", "--slo", "latency:5"]) == 2
    assert "unknown SLO" in capsys.readouterr().err
    cal = ["--calibration", "/nonexistent.json", "--hardware", "cpu-local"]
    assert main(["sim", "--rate", "1", *cal]) == 2
    assert "cannot read calibration file" in capsys.readouterr().err
    assert main(["sim", "--rate", "0"]) == 2
    assert "must be > 0" in capsys.readouterr().err
    assert main(["sim", "--concurrency", "4"]) == 2
    assert "open loops" in capsys.readouterr().err
    assert main(["sim", "--rate", "1", "--kv-cache-gb", "0"]) == 2
    assert "kv_cache_gb must be > 0" in capsys.readouterr().err
    assert main(["sim", "--rate", "1", "--host-cores", "0"]) == 2
    assert "host_cores must be >= 1" in capsys.readouterr().err


def test_calibrate_out_is_not_read_as_a_bench_option():
    # Regression: with abbreviations on, `--out` was ambiguous with `--output-len`.
    from splitserve.cli import build_parser

    args = build_parser().parse_args(["sim", "calibrate", "--out", "cal.json", "--repeats", "2"])
    assert (args.out, args.repeats, args.sim_command) == ("cal.json", 2, "calibrate")
