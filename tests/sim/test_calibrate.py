"""Calibration: the fit recovers known factors; the real engine's steps can be measured."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from splitserve.cli import main
from splitserve.engine.model_runner import FUSED_DECODE_MAX_SEQS, NATIVE_STEP_MAX_SEQS
from splitserve.engine.step_log import fused_decode_max_seqs
from splitserve.sim.calibrate import cost_model_of, fit, peak_cost_model
from splitserve.sim.calibration_files import read_samples, write_calibration
from splitserve.sim.cost_model import StepShape
from splitserve.sim.hardware import get_hardware, load_calibration
from splitserve.sim.step_timing import (
    Sample,
    build_engine,
    busy_neighbour,
    co_run_slowdown,
    measure,
    measure_co_run,
    measure_host_load,
    measure_peaks,
    read_step_logs,
    run_samples,
)


def shapes() -> list[StepShape]:
    prefills = [StepShape(n, 1, n * (n + 1) / 2, n, 1) for n in (32, 128, 256, 512)]
    prefills += [StepShape(n, 1, n * 512 + n * (n + 1) / 2, 512 + n, 1) for n in (32, 128)]
    decodes = [StepShape(b, b, b * 129, b * 129, b) for b in (1, 4, 8, 16)]
    return prefills + decodes


TRUTH = {
    "compute_eff": 0.4,
    "memory_eff": 0.55,
    "attention_eff": 0.25,
    "step_overhead_s": 0.012,
    "seq_overhead_s": 0.0015,
    "multi_row_overhead_s": 0.03,
}


def synthetic(truth: dict[str, float], grid: list[StepShape] | None = None) -> list[Sample]:
    """Step times made by the cost model's own form with known factors."""
    cost = cost_model_of(truth)
    return [Sample(s, cost.step_time(s)) for s in grid or shapes()]


def assert_recovered(got: dict[str, float], truth: dict[str, float]) -> None:
    assert got["compute_eff"] == pytest.approx(truth["compute_eff"], abs=0.011)
    assert got["memory_eff"] == pytest.approx(truth["memory_eff"], abs=0.011)
    assert got["attention_eff"] == pytest.approx(truth["attention_eff"], abs=0.011)
    for key in ("step_overhead_s", "seq_overhead_s", "multi_row_overhead_s"):
        assert got[key] == pytest.approx(truth[key], rel=0.15, abs=1e-4), key
    assert got["max_rel_error"] < 0.03


@pytest.mark.parametrize("multi_row", [0.03, 0.0])
def test_fit_recovers_the_factors_that_made_the_times(multi_row):
    truth = {**TRUTH, "multi_row_overhead_s": multi_row}
    assert_recovered(fit(synthetic(truth), peak_cost_model(0)), truth)


def test_fit_recovers_the_factors_with_the_fused_decode_path():
    # Decode steps of 1 and 4 sequences on the fused path (no multi-row overhead), 8 and 16
    # on the torch path: the fit must know which is which to recover the overhead.
    truth = {**TRUTH, "fused_decode_max_seqs": 4}
    right = fit(synthetic(truth), peak_cost_model(4))
    assert_recovered(right, truth)
    assert right["fused_decode_max_seqs"] == 4  # stored with the fit
    # cpu-local's engine runs every decode-only step on its C++ decode step
    assert peak_cost_model().hw.fused_decode_max_seqs == NATIVE_STEP_MAX_SEQS
    # Fitted as if every multi-row step paid it, the same times are fitted worse.
    wrong = fit(synthetic(truth), peak_cost_model(0))
    assert wrong["rms_rel_error"] > 3 * right["rms_rel_error"] + 0.003


def test_fit_recovers_the_fused_paths_compute_efficiency():
    # The fused kernel's loops compute far below BLAS: 1- and 4-sequence decode steps
    # compute-bound at 0.15 of the peak, the rest as before.
    truth = {**TRUTH, "fused_decode_max_seqs": 4, "fused_compute_eff": 0.15}
    decodes = [StepShape(b, b, b * 129, b * 129, b) for b in (1, 2, 4)]
    got = fit(synthetic(truth, shapes() + decodes), peak_cost_model(4))
    assert_recovered(got, truth)
    assert got["fused_compute_eff"] == pytest.approx(0.15, abs=0.011)
    # Without fused steps in the grid there is nothing to fit it from.
    assert "fused_compute_eff" not in fit(synthetic(TRUTH), peak_cost_model(0))


def test_refit_cli_recovers_the_factors_from_a_stored_file(tmp_path, capsys):
    # A file as older `sim calibrate --out` wrote it: tokens and sequences only (prefills
    # from position 0 and decode steps: its grid had no prefill after a context), a host_bw.
    old = tmp_path / "old.json"
    grid = [s for s in shapes() if s.chunks > 1 or s.kv_read == s.tokens]
    rows = [
        {"tokens": s.shape.tokens, "seqs": s.shape.chunks, "seconds": s.seconds}
        for s in synthetic(TRUTH, grid)
    ]
    old.write_text(json.dumps({"fit": {"host_bw": 1.3e9}, "samples": rows}))
    new = tmp_path / "new.json"
    assert main(["sim", "calibrate", "--refit", str(old), "--out", str(new)]) == 0
    assert "rms_rel_error" in capsys.readouterr().out
    stored = json.loads(new.read_text())
    # Its shapes are the ones that made the times, now stored whole; the fit reproduces the
    # times (that grid cannot tell every term apart: the full grid's recovery is above).
    assert [
        StepShape(r["tokens"], r["sampled"], r["attended"], r["kv_read"], r["seqs"])
        for r in stored["samples"]
    ] == grid
    assert stored["fit"]["max_rel_error"] < 0.01
    assert stored["fit"]["host_bw"] == 1.3e9  # measured, not fitted: carried over
    assert stored["fit"]["fused_decode_max_seqs"] == 0  # an older file timed the torch path
    hw = load_calibration(get_hardware("cpu-local"), str(new))
    assert hw.multi_row_overhead_s == stored["fit"]["multi_row_overhead_s"]
    # The new file refits to the same fit; a file with no samples is a clear error.
    again = tmp_path / "again.json"
    assert main(["sim", "calibrate", "--refit", str(new), "--out", str(again)]) == 0
    assert json.loads(again.read_text())["fit"] == stored["fit"]
    old.write_text(json.dumps({"fit": {}}))
    with pytest.raises(SystemExit, match="cannot read calibration samples"):
        main(["sim", "calibrate", "--refit", str(old)])


def test_refit_of_two_files_fits_their_samples_together(tmp_path, capsys):
    # Calibrations taken before and after a run, the machine 20% slower in the second: one fit
    # over both (a median per step over the two files' repeats), between the two alone.
    truth = {**TRUTH, "fused_decode_max_seqs": 4}
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    fast = synthetic(truth)
    slow = [Sample(s.shape, 1.2 * s.seconds) for s in fast]
    cost = peak_cost_model(4)
    write_calibration(
        str(before), {**fit(fast, cost), "host_bw": 2e9, "serving_cpu_per_token_s": 0.001}, fast
    )
    write_calibration(str(after), {**fit(slow, cost), "host_bw": 3e9}, slow)
    both = tmp_path / "both.json"
    assert main(["sim", "calibrate", "--refit", str(before), str(after), "--out", str(both)]) == 0
    capsys.readouterr()
    got = json.loads(both.read_text())["fit"]
    assert got == {
        **fit(fast + slow, cost),
        "host_bw": 2.5e9,  # the mean of the measured ones
        "serving_cpu_per_token_s": 0.001,  # measured elsewhere: kept
    }
    assert got["fused_decode_max_seqs"] == 4
    one = fit(fast, cost)
    assert cost_model_of(one).step_time(fast[0].shape) < cost_model_of(got).step_time(fast[0].shape)
    # Files that timed the fused path and the torch path describe different steps.
    write_calibration(str(after), {**fit(slow, peak_cost_model(0))}, slow)
    with pytest.raises(SystemExit, match="different fused decode limits"):
        main(["sim", "calibrate", "--refit", str(before), str(after)])


def test_a_calibration_file_sets_the_profile(tmp_path):
    path = tmp_path / "cal.json"
    fitted = {"compute_eff": 0.3, "memory_eff": 0.4, "step_overhead_s": 0.01, "seq_overhead_s": 0.0}
    path.write_text(json.dumps({"fit": fitted}))
    hw = load_calibration(get_hardware("cpu-local"), str(path))
    assert (hw.compute_eff, hw.memory_eff, hw.step_overhead_s) == (0.3, 0.4, 0.01)
    assert hw.host_bw == get_hardware("cpu-local").host_bw  # a file without it: the profile's
    # Fitted before these terms existed: without them.
    assert hw.multi_row_overhead_s == 0.0 and hw.attention_eff is None
    assert hw.fused_decode_max_seqs == 0 and hw.fused_compute_eff is None
    path.write_text(json.dumps({"fit": {**fitted, "fused_compute_eff": 0.16}}))
    assert load_calibration(get_hardware("cpu-local"), str(path)).fused_compute_eff == 0.16
    path.write_text(json.dumps({"fit": {**fitted, "fused_decode_max_seqs": 4}}))
    assert load_calibration(get_hardware("cpu-local"), str(path)).fused_decode_max_seqs == 4
    for bad in (-1, 2.5, "4"):
        path.write_text(json.dumps({"fit": {**fitted, "fused_decode_max_seqs": bad}}))
        with pytest.raises(ValueError, match="fused_decode_max_seqs"):
            load_calibration(get_hardware("cpu-local"), str(path))
    path.write_text(json.dumps({"fit": {**fitted, "host_bw": 5e9}}))
    assert load_calibration(get_hardware("cpu-local"), str(path)).host_bw == 5e9
    assert get_hardware("cpu-local").co_run_slowdown == 0.0  # a file without it: none
    path.write_text(json.dumps({"fit": {**fitted, "request_overhead_s": 0.04}}))
    assert load_calibration(get_hardware("cpu-local"), str(path)).request_overhead_s == 0.04
    for measured, used in ((0.15, 0.15), (-0.02, 0.0)):  # a neighbour never speeds a step up
        path.write_text(json.dumps({"fit": {**fitted, "co_run_slowdown": measured}}))
        assert load_calibration(get_hardware("cpu-local"), str(path)).co_run_slowdown == used
    path.write_text("{}")
    with pytest.raises(ValueError, match="has no fit"):
        load_calibration(get_hardware("cpu-local"), str(path))


def test_the_real_engine_steps_and_host_tier_loads_are_measured():
    engine = build_engine(None, threads=1)
    # The engine's fused decode path is on by default (the C++ step where it builds, else
    # numba's): the fit is told how far it reaches.
    native = getattr(engine.runner.fused, "exact", False)
    expected = NATIVE_STEP_MAX_SEQS if native else FUSED_DECODE_MAX_SEQS
    assert fused_decode_max_seqs(engine) == expected > 0
    samples = measure(
        None,
        threads=1,
        repeats=1,
        prefill_lens=(16, 48),
        decode_batches=(1, 3),
        engine=engine,
        context_prefills=((16, 32),),
        mixed=((16, 2),),
    )
    prefill = [s.shape for s in samples[:3]]
    assert prefill == [
        StepShape(16, 1, 16 * 17 / 2, 16, 1),
        StepShape(48, 1, 48 * 49 / 2, 48, 1),
        StepShape(16, 1, 16 * 32 + 16 * 17 / 2, 48, 1),  # 16 new tokens after 32 cached
    ]
    decode = [s.shape for s in samples[3:5]]
    assert [(s.tokens, s.chunks) for s in decode] == [(1, 1), (3, 3)]
    # A 16-token prefill in the step of two decoders, each reading its 128-token prompt and
    # the token it decodes: 18 tokens, 3 sampled, 3 chunks.
    (mixed,) = [s.shape for s in samples[5:]]
    assert (mixed.tokens, mixed.sampled, mixed.chunks, mixed.kv_read) == (18, 3, 3, 16 + 2 * 129)
    assert all(s.seconds > 0 for s in samples)
    # Regression: a second measurement on the same engine reused the first one's request ids
    # and prompts (its prefills then hit the prefix cache and measured shorter steps).
    again = measure(None, 1, 1, (16, 48), (1,), engine=engine, context_prefills=(), mixed=())
    assert [s.shape for s in again[:2]] == prefill[:2]
    # The real KV mover, host RAM -> the engine's KV cache: some bytes per second, at most
    # what this machine's memory moves (a copy reads and writes; 100 GB/s is far above it).
    assert 1e7 < measure_host_load(engine, blocks=16, repeats=1) < 1e11
    # --co-run: the same grid beside a second engine computing in another process, which is
    # gone afterwards.
    grid = dict(prefill_lens=(16,), decode_batches=(1,), context_prefills=(), mixed=())
    beside = measure_co_run(engine, 1, 1, **grid)
    assert [(s.shape.tokens, s.shape.chunks) for s in beside] == [(16, 1), (1, 1)]
    assert all(s.seconds > 0 for s in beside)
    assert multiprocessing.active_children() == []


def test_the_co_run_slowdown_and_serving_cpu_are_stored_and_kept_by_refit(tmp_path):
    alone = [Sample(shape, 0.01 * (i + 1)) for i, shape in enumerate(shapes())]
    beside = [Sample(s.shape, 1.2 * s.seconds) for s in alone]
    assert co_run_slowdown(alone, beside) == pytest.approx(0.2)
    path, out = tmp_path / "cal.json", tmp_path / "refit.json"
    serving = {"serving_cpu_per_request_s": 0.012, "serving_cpu_per_token_s": 0.0014}
    write_calibration(str(path), {"co_run_slowdown": 0.2, **serving}, alone, beside)
    assert read_samples(str(path))[2] == beside
    assert main(["sim", "calibrate", "--refit", str(path), "--out", str(out)]) == 0
    refit = json.loads(out.read_text())
    assert refit["fit"]["co_run_slowdown"] == pytest.approx(0.2)
    # What benchmarks/serving_cpu.py measured stays in the refitted file, and is read.
    assert {k: refit["fit"][k] for k in serving} == serving
    hw = load_calibration(get_hardware("cpu-local"), str(out))
    assert (hw.serving_cpu_per_request_s, hw.serving_cpu_per_token_s) == (0.012, 0.0014)
    assert load_calibration(get_hardware("cpu-local"), str(out)).co_run_slowdown == pytest.approx(
        0.2
    )


def test_co_run_needs_a_core_for_each_engine_thread(capsys):
    assert main(["sim", "calibrate", "--co-run", "--threads", "64"]) == 2
    assert "needs 128 cores" in capsys.readouterr().err


def _idle(threads: int, ready, stop) -> None:
    ready.set()
    stop.wait(60)


def test_the_second_process_stops_however_the_block_ends():
    with pytest.raises(KeyError), busy_neighbour(threads=1, target=_idle):
        raise KeyError("boom")
    assert multiprocessing.active_children() == []


def test_a_machine_faster_than_the_nominal_peak_is_fitted_against_its_measured_peaks():
    # A machine with twice cpu-local's nominal peaks, the engine at 0.7 of its compute peak:
    # 1.4x the nominal one. Against the nominal peaks the compute efficiency would have to
    # pass 1, where the grid ends, and the fit is poor; against the measured ones it is
    # recovered.
    hw = get_hardware("cpu-local")
    peaks = (2 * hw.peak_flops["fp32"], 2 * hw.hbm_bw)
    truth = {**TRUTH, "compute_eff": 0.7, "attention_eff": 0.45, "fused_decode_max_seqs": 4}
    times = synthetic({**truth, "peak_flops_fp32": peaks[0], "mem_bw": peaks[1]})
    got = fit(times, peak_cost_model(4, peaks))
    assert_recovered(got, truth)
    assert (got["peak_flops_fp32"], got["mem_bw"]) == peaks  # stored with the fit
    nominal = fit(times, peak_cost_model(4))
    assert nominal["compute_eff"] == 1.0 and nominal["rms_rel_error"] > 0.05
    # The stored peaks travel with the fit: it predicts the times it was fitted to.
    model = cost_model_of(got)
    for s in times:
        assert model.step_time(s.shape) == pytest.approx(s.seconds, rel=0.03)


def test_a_calibration_files_peaks_set_the_profiles(tmp_path):
    path = tmp_path / "cal.json"
    fitted = {"compute_eff": 0.3, "memory_eff": 0.4, "step_overhead_s": 0.01, "seq_overhead_s": 0.0}
    path.write_text(json.dumps({"fit": {**fitted, "peak_flops_fp32": 150e9, "mem_bw": 30e9}}))
    hw = load_calibration(get_hardware("cpu-local"), str(path))
    assert (hw.peak_flops["fp32"], hw.hbm_bw) == (150e9, 30e9)
    path.write_text(json.dumps({"fit": fitted}))  # an older file: the nominal peaks
    hw = load_calibration(get_hardware("cpu-local"), str(path))
    assert hw.peak_flops == get_hardware("cpu-local").peak_flops


def test_this_machines_peaks_are_measured():
    flops, mem_bw = measure_peaks(threads=1, repeats=1)
    # Some GFLOP/s at one thread, some GB/s read; far below
    # what any one core reaches (a TFLOP/s, 1 TB/s).
    assert 1e9 < flops < 1e12 and 1e9 < mem_bw < 1e12


def _run_steps(truth: dict[str, float], repeats: int = 5) -> list[dict]:
    """Step-log lines of a serving run on an engine with ``truth``'s factors: decode steps of
    1-8 sequences over growing contexts, later turns' prefills after a cached context, and
    prefills beside decodes; each kind of step ``repeats`` times, its times spread +-4%."""
    cost = cost_model_of(truth)
    shapes = []
    for b in (1, 2, 3, 4, 6, 8):
        for context in (200, 450, 900):
            shapes.append(StepShape(b, b, b * (context + 1), b * (context + 1), b))
    for n, cached in ((40, 0), (90, 300), (200, 600), (350, 0), (60, 800)):
        shapes.append(StepShape(n, 1, n * cached + n * (n + 1) / 2, cached + n, 1))
    for n, b in ((48, 1), (100, 3), (70, 5)):
        ctx = 500
        shapes.append(StepShape(n + b, b + 1, n * (n + 1) / 2 + b * ctx, n + b * ctx, b + 1))
    rows = []
    for i in range(repeats):
        spread = 1 + 0.04 * (2 * i / (repeats - 1) - 1)  # -4% .. +4%, the middle one exact
        for shape in shapes:
            seconds = cost.step_time(shape) * spread
            rows.append(
                {
                    "tokens": shape.tokens,
                    "sampled": shape.sampled,
                    "attended": shape.attended,
                    "kv_read": shape.kv_read,
                    "seqs": shape.chunks,
                    "seconds": 1.7 * seconds,  # wall: waiting for a core as well
                    "cpu_seconds": seconds,
                    "t": 1e9 + i,
                }
            )
    return rows


def _write_log(path, rows: list[dict], fused: int = 4, threads: int = 1) -> None:
    engine = {"threads": threads, "fused_decode_max_seqs": fused, "role": "both"}
    lines = [{"engine": engine}, *rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_a_serving_runs_step_logs_are_fitted(tmp_path, capsys):
    # Two workers' logs of one run (each holds half the steps): the fit recovers the engine's
    # factors from the steps' thread CPU times, against the peaks of a base calibration, and
    # keeps that file's measured figures.
    truth = {**TRUTH, "fused_decode_max_seqs": 4, "fused_compute_eff": 0.15}
    rows = _run_steps(truth)
    logs = tmp_path / "run" / "collocated-rr"
    logs.mkdir(parents=True)
    _write_log(logs / "both-1.jsonl", rows[::2])
    _write_log(logs / "both-2.jsonl", rows[1::2])
    samples, fused = read_step_logs([str(tmp_path / "run")])
    assert fused == 4
    assert len(samples) == len(rows) // 5  # one per kind of step: its median, the exact one
    got = fit(samples, peak_cost_model(4))
    assert_recovered(got, truth)
    assert got["fused_compute_eff"] == pytest.approx(0.15, abs=0.011)
    base = tmp_path / "base.json"
    measured = {"host_bw": 2.5e9, "serving_cpu_per_token_s": 0.0013}
    write_calibration(str(base), {**fit(synthetic(truth), peak_cost_model(4)), **measured}, [])
    out = tmp_path / "from-run.json"
    argv = ["sim", "calibrate", "--from-steps", str(tmp_path / "run"), "--base", str(base)]
    assert main([*argv, "--out", str(out)]) == 0
    assert "rms_rel_error" in capsys.readouterr().out
    stored = json.loads(out.read_text())["fit"]
    assert {k: stored[k] for k in got} == got
    assert {k: stored[k] for k in measured} == measured
    # Wall times instead (a core's wait included) are other figures: slower steps.
    samples, _ = read_step_logs([str(logs / "both-1.jsonl")], step_time="wall")
    wall = fit(samples, peak_cost_model(4))
    assert cost_model_of(wall).step_time(samples[0].shape) == pytest.approx(
        1.7 * cost_model_of(got).step_time(samples[0].shape), rel=0.05
    )


def test_run_samples_group_steps_by_kind_and_take_the_median():
    def decode(b: int, context: int, seconds: float) -> Sample:
        return Sample(StepShape(b, b, b * context, b * context, b), seconds)

    steps = [decode(2, 300, t) for t in (0.03, 0.01, 0.02)]  # one kind: median 0.02
    steps += [decode(2, 310, 0.5)]  # the same 128-token context bin: the same kind
    steps += [decode(2, 700, 0.04), decode(3, 300, 0.05)]  # other contexts, other batches
    steps += [Sample(StepShape(66, 3, 0.0, 66 + 600, 3), 0.2)]  # 63 tokens over one each
    got = run_samples(steps)
    assert sorted(s.seconds for s in got) == [0.02, 0.04, 0.05, 0.2]


def test_step_logs_that_cannot_be_fitted_are_clear_errors(tmp_path, capsys):
    with pytest.raises(SystemExit, match="no step logs"):
        read_step_logs([str(tmp_path)])
    rows = _run_steps(TRUTH, repeats=2)
    _write_log(tmp_path / "a.jsonl", rows, threads=2)
    with pytest.raises(SystemExit, match="--step-time wall"):
        read_step_logs([str(tmp_path / "a.jsonl")])
    assert read_step_logs([str(tmp_path / "a.jsonl")], step_time="wall")[1] == 4
    _write_log(tmp_path / "a.jsonl", rows, fused=4)
    _write_log(tmp_path / "b.jsonl", rows, fused=0)
    with pytest.raises(SystemExit, match="fused decode limits"):
        read_step_logs([str(tmp_path)])
    (tmp_path / "b.jsonl").write_text(
        '{"engine": {"threads": 1, "fused_decode_max_seqs": 4}}\n{"tokens": 3}\n'
    )
    with pytest.raises(SystemExit, match="cannot read step log"):
        read_step_logs([str(tmp_path)])
    assert main(["sim", "calibrate", "--refit", "x.json", "--from-steps", str(tmp_path)]) == 2
    assert "two sources" in capsys.readouterr().err
    # Flags that only mean something with another are refused without it, not ignored.
    for argv, message in (
        (["--base", "x.json"], "go with --from-steps"),
        (["--step-time", "wall"], "go with --from-steps"),
        (["--from-steps", str(tmp_path), "--co-run"], "--co-run times the step grid"),
        (["--refit", "x.json", "--co-run"], "--co-run times the step grid"),
    ):
        assert main(["sim", "calibrate", *argv]) == 2
        assert message in capsys.readouterr().err
