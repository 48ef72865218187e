"""``benchmarks/sim_validate.py``: which simulated system and which seed a stored real run gets."""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from splitserve.sim.deployment import Deployment
from splitserve.sim.run import simulate
from splitserve.workload.metrics import SLO, RequestRecord, summarize
from splitserve.workload.report import run_dict, write_json
from splitserve.workload.sessions import RandomConfig

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_validate.py"


def load_script():
    spec = importlib.util.spec_from_file_location("sim_validate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repeats_replay_the_same_seeds_and_a_sweep_the_next_ones():
    sv = load_script()
    repeats = [{"deployment": d, "repeat": k} for k in (1, 2) for d in ("rr", "tiers")]
    assert sv.load_indices(repeats) == [0, 0, 0, 0]
    sweep = [{"deployment": d} for d in ("rr", "rr", "tiers", "tiers")]
    assert sv.load_indices(sweep) == [0, 1, 0, 1]


def test_the_stored_serve_command_line_sets_the_simulated_system():
    sv = load_script()
    argv = "--port 1 --prefill 0 --decode 4 --threads-per-worker 1 --policy session "
    argv += "--host-kv-gb 2 --kv-cache-gb 0.06 --load-floor 3 --kv-peer-fetch"
    info = {"deployment": f"collocated-session-tiers-peer: collocated; {argv}"}
    run = {"deployment": "collocated-session-tiers-peer", "summary": {"info": info}}
    dep, settings = sv.simulated_system(run)
    assert dep == Deployment(collocated=4)
    assert settings["kv_peer_fetch"] is True and settings["load_floor"] == 3
    assert (settings["host_kv_gb"], settings["kv_cache_gb"]) == (2.0, 0.06)
    info["deployment"] = info["deployment"].replace(" --kv-peer-fetch", "")
    assert sv.simulated_system(run)[1]["kv_peer_fetch"] is False
    # A run without its command line: the named deployment's flags, at two workers.
    run = {"deployment": "collocated-session-tiers-peer", "summary": {}}
    dep, settings = sv.simulated_system(run)
    assert dep == Deployment(collocated=2) and settings["kv_peer_fetch"] is True


def test_a_simulated_run_validated_against_itself_gives_ratios_of_one(tmp_path, capsys):
    # The plumbing end to end: a bench-shaped JSON of a simulated run (same deployment,
    # seed, rate and engine settings as sim_validate rebuilds) compares at 1.00; with
    # --jitter the simulated side is the median of five runs a little faster and slower.
    sv = load_script()
    fit = {"compute_eff": 0.9, "memory_eff": 1.0, "step_overhead_s": 0.005, "seq_overhead_s": 0.0}
    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps({"fit": fit}))
    workload, slo = RandomConfig(input_len=64, output_len=8, seed=3), SLO(ttft_ms=400)
    dep, argv = Deployment(collocated=2), "--prefill 0 --decode 2 --policy round-robin"
    cfg = sv.cpu_local(str(calibration), policy="round-robin", chat_template=False)
    run = simulate(cfg, dep, workload, 2.0, 6.0, slo).run
    run.summary.info.update(workload=workload.describe(), deployment=f"collocated-rr: x; {argv}")
    bench_json = tmp_path / "runs.json"
    write_json(bench_json, [run_dict(run, deployment="collocated-rr", rate=2.0)])
    args = argparse.Namespace(
        bench_json=str(bench_json), calibration=str(calibration), no_chat_template=False,
        host_cores=None, jitter=0.0, speed_from_run=False,
    )  # fmt: skip
    sv.against_bench(args, workload, slo)
    assert "| collocated-rr | 2/s |" in (out := capsys.readouterr().out)
    assert out.count("**1.00**") == 2 and "range" not in out
    args.jitter = 5.0
    sv.against_bench(args, workload, slo)
    out = capsys.readouterr().out
    assert "range" in out and "| collocated-rr | 2/s |" in out
    assert sv.jitter_scales(2.0) == pytest.approx([0.98, 0.99, 1.0, 1.01, 1.02])
    assert sv.jitter_scales(0.0) == [1.0]


def test_speed_from_run_scales_the_steps_to_the_runs_engine_cpu(tmp_path, capsys):
    # A "real" run whose engine threads took 1.1x the simulated engine seconds: the machine
    # ran 10% slower than calibrated, and the simulation is redone at that speed.
    sv = load_script()
    calibration = tmp_path / "cal.json"
    fit = {"compute_eff": 0.9, "memory_eff": 1.0, "step_overhead_s": 0.005, "seq_overhead_s": 0.0}
    calibration.write_text(json.dumps({"fit": fit}))
    workload, slo = RandomConfig(input_len=64, output_len=8, seed=3), SLO(ttft_ms=400)
    dep, argv = Deployment(collocated=2), "--prefill 0 --decode 2 --policy round-robin"
    cfg = sv.cpu_local(str(calibration), policy="round-robin", chat_template=False, host_cores=2)
    run = simulate(cfg, dep, workload, 2.0, 6.0, slo).run
    run.summary.info.update(workload=workload.describe(), deployment=f"collocated-rr: x; {argv}")
    engine_s = run.summary.server["engine compute (s)"]
    run.summary.server.clear()
    run.summary.server["engine_cpu_seconds"] = 1.1 * engine_s
    bench_json = tmp_path / "runs.json"
    write_json(bench_json, [run_dict(run, deployment="collocated-rr", rate=2.0)])
    args = argparse.Namespace(
        bench_json=str(bench_json), calibration=str(calibration), no_chat_template=False,
        host_cores=2, jitter=0.0, speed_from_run=True,
    )  # fmt: skip
    sv.against_bench(args, workload, slo)
    out = capsys.readouterr().out
    assert "collocated-rr: steps scaled by 1.100 (the run's engine CPU)" in out
    args.host_cores = None
    with pytest.raises(SystemExit, match="needs a bench run with CPU figures and --host-cores"):
        sv.against_bench(args, workload, slo)


def test_a_real_run_past_saturation_is_flagged():
    sv = load_script()
    # Three deployments' request records from two real `bench compare` runs of 2026-12-02
    # (docs/journal/2026-12-02.md), kept as they were written.
    stored = (
        Path(__file__).resolve().parents[1] / "data" / "sim_validate" / "saturation-runs.json.gz"
    )
    runs = json.loads(gzip.decompress(stored.read_bytes()))
    slo = SLO.parse("ttft:1000,tpot:250", "jct:40000")

    def real(name: str, deployment: str):
        run = next(r for r in runs[name] if r["deployment"] == deployment)
        records = [RequestRecord(**r) for r in run["requests"]]
        return summarize(records, run["summary"]["duration_s"], slo)

    assert sv.saturated(real("agentic-w4.json", "collocated-rr")) == "8 requests unfinished"
    assert sv.saturated(real("agentic-w4-rate0.2.json", "collocated-rr")) == (
        "32% of requests met the SLOs"
    )
    assert sv.saturated(real("agentic-w4-rate0.2.json", "collocated-session-tiers")) is None
