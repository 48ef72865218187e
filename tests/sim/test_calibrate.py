"""Calibration: the fit recovers known factors; the real engine's steps can be measured."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from splitserve.cli import main
from splitserve.engine.model_runner import FUSED_DECODE_MAX_SEQS
from splitserve.sim.calibrate import (
    cost_model_of,
    fit,
    peak_cost_model,
    read_samples,
    write_calibration,
)
from splitserve.sim.cost_model import StepShape
from splitserve.sim.hardware import get_hardware, load_calibration
from splitserve.sim.step_timing import (
    Sample,
    build_engine,
    busy_neighbour,
    co_run_slowdown,
    fused_decode_max_seqs,
    measure,
    measure_co_run,
    measure_host_load,
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
    assert peak_cost_model().hw.fused_decode_max_seqs == 4  # cpu-local's engine default
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
    # The engine's fused decode path is on by default (numba is installed): the fit is told.
    assert fused_decode_max_seqs(engine) == FUSED_DECODE_MAX_SEQS == 4
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
