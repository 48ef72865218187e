"""Calibration: the fit recovers known factors; the real engine's steps can be measured."""

from __future__ import annotations

import json

import pytest

from splitserve.sim.calibrate import (
    Sample,
    build_engine,
    fit,
    measure,
    measure_host_load,
    peak_cost_model,
)
from splitserve.sim.cost_model import StepShape
from splitserve.sim.hardware import get_hardware, load_calibration


def shapes() -> list[StepShape]:
    prefills = [StepShape(n, 1, n * (n + 1) / 2, n, 1) for n in (32, 128, 256, 512)]
    decodes = [StepShape(b, b, b * 129, b * 129, b) for b in (1, 4, 8, 16)]
    return prefills + decodes


def test_fit_recovers_the_factors_that_made_the_times():
    cost = peak_cost_model()
    truth = dict(ce=0.4, me=0.55, o=0.012, so=0.0015)
    samples = [
        Sample(
            s,
            max(cost.compute_time(s) / truth["ce"], cost.memory_time(s) / truth["me"])
            + truth["o"]
            + truth["so"] * s.chunks,
        )
        for s in shapes()
    ]
    got = fit(samples, cost)
    assert got["compute_eff"] == pytest.approx(0.4, abs=0.011)
    assert got["memory_eff"] == pytest.approx(0.55, abs=0.011)
    assert got["step_overhead_s"] == pytest.approx(0.012, rel=0.15)
    assert got["seq_overhead_s"] == pytest.approx(0.0015, rel=0.15)
    assert got["max_rel_error"] < 0.03


def test_a_calibration_file_sets_the_profile(tmp_path):
    path = tmp_path / "cal.json"
    fitted = {"compute_eff": 0.3, "memory_eff": 0.4, "step_overhead_s": 0.01, "seq_overhead_s": 0.0}
    path.write_text(json.dumps({"fit": fitted}))
    hw = load_calibration(get_hardware("cpu-local"), str(path))
    assert (hw.compute_eff, hw.memory_eff, hw.step_overhead_s) == (0.3, 0.4, 0.01)
    assert hw.host_bw == get_hardware("cpu-local").host_bw  # a file without it: the profile's
    path.write_text(json.dumps({"fit": {**fitted, "host_bw": 5e9}}))
    assert load_calibration(get_hardware("cpu-local"), str(path)).host_bw == 5e9
    path.write_text("{}")
    with pytest.raises(ValueError, match="has no fit"):
        load_calibration(get_hardware("cpu-local"), str(path))


def test_the_real_engine_steps_and_host_tier_loads_are_measured():
    engine = build_engine(None, threads=1)
    samples = measure(
        None, threads=1, repeats=1, prefill_lens=(16, 48), decode_batches=(1, 3), engine=engine
    )
    prefill = [s.shape for s in samples[:2]]
    assert prefill == [StepShape(16, 1, 16 * 17 / 2, 16, 1), StepShape(48, 1, 48 * 49 / 2, 48, 1)]
    decode = [s.shape for s in samples[2:]]
    assert [(s.tokens, s.chunks) for s in decode] == [(1, 1), (3, 3)]
    assert all(s.seconds > 0 for s in samples)
    # The real KV mover, host RAM -> the engine's KV cache: some bytes per second, at most
    # what this machine's memory moves (a copy reads and writes; 100 GB/s is far above it).
    assert 1e7 < measure_host_load(engine, blocks=16, repeats=1) < 1e11
