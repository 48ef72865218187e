"""The calibrated simulator against a real worker on this machine: issue 8's small case.

One real ``splitserve worker`` (the bundled model, float32, one thread) on loopback serves a
small seeded workload, driven by ``splitserve bench``'s own client at Poisson arrivals.
Right before and right after it, the real engine's steps of the shapes that workload makes
are timed in this process and fitted (both together) as ``splitserve sim calibrate`` fits
them, so the calibration sees the machine as the run does. The same workload then runs
through the simulator on that ``cpu-local`` fit: its goodput and p50 TTFT must be within 15%
of the real ones. On a machine whose speed moves during the case the test is skipped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest
from procs import start_worker, stop_group, wait_healthy

from splitserve.bench.client import Endpoint
from splitserve.bench.load import run_load
from splitserve.common.sampling_params import SamplingParams
from splitserve.config import EngineConfig
from splitserve.sim.calibrate import fit, peak_cost_model
from splitserve.sim.calibration_files import write_calibration
from splitserve.sim.cost_model import StepShape
from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.hardware import get_hardware, load_calibration
from splitserve.sim.models import get_model
from splitserve.sim.run import SimResult, simulate
from splitserve.sim.step_timing import Sample, build_engine, measure, measure_peaks, medians
from splitserve.workload.metrics import SLO, Summary, summarize
from splitserve.workload.runs import Load, RunResult
from splitserve.workload.sessions import RandomConfig

# Timing against timing on a shared 2-core machine (docs/simulator.md, "A test of the 15%"):
# it runs in `make test-timing`, not `make test`.
pytestmark = pytest.mark.timing

# About 0.7 of the worker's capacity: requests queue behind each other now and then. Fifty
# requests, not the 21 of 16 s: one request that crosses an objective moves goodput 2%.
WORKLOAD = RandomConfig(input_len=64, output_len=8, seed=1)
LOAD = Load(rate=1.25, duration_s=48.0, drain_s=60.0)
# The step shapes the workload makes: prefills of one or two prompts (alone or next to
# decodes), decode batches of 1-3 over ~70-token contexts.
GRID = dict(prefill_lens=(32, 64, 128), decode_batches=(1, 2, 4), context_prefills=((64, 64),))
TOLERANCE = 0.15  # the goal
# The machine is shared: a case whose calibrations before and after the run differ by more
# than this (median over the grid's steps) was measured while the machine's speed changed,
# too much for a 15% comparison, and the test is skipped.
MAX_DRIFT = 0.15


@dataclasses.dataclass
class Case:
    real: RunResult
    sim: RunResult
    fit: dict[str, float]
    drift: float  # the step times after the run over those before it

    def ratio(self, figure: Callable[[Summary], float]) -> float:
        sim, real = figure(self.sim.summary), figure(self.real.summary)
        if real == 0:  # a real run that met no objective: no ratio is within 15% of it
            return math.inf if sim else math.nan
        return sim / real


def goodput(s: Summary) -> float:
    return s.request_goodput


def p50_ttft(s: Summary) -> float:
    return s.ttft.median


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Case:
    result = run_case(str(tmp_path_factory.mktemp("validate") / "cal.json"))
    rms = result.fit["rms_rel_error"]
    print(
        f"sim/real: goodput {result.ratio(goodput):.3f}, p50 TTFT {result.ratio(p50_ttft):.3f}; "
        f"fit rms {rms:.3f}, drift {result.drift:.3f}"
    )
    if abs(result.drift - 1) > MAX_DRIFT:
        pytest.skip(
            f"the machine is too unsteady to compare timings within 15%: its step times moved "
            f"{result.drift:.2f}x during the run"
        )
    return result


def run_case(calibration: str) -> Case:
    """The real run between two calibrations, then the simulated run of the same workload on
    one fit of both."""
    url, proc = start_worker([])
    try:
        engine = build_engine(None, threads=1)  # loads while the worker loads
        wait_healthy(url, proc)
        warm_up(url, engine)
        before = measure_steps(engine)
        real = asyncio.run(run_load(Endpoint(url), WORKLOAD, LOAD, progress=False))
        after = measure_steps(engine)
    finally:
        stop_group(proc)
    samples = before + after  # one median per step over both
    # Against this machine's measured peaks, as `sim calibrate` fits.
    cost_fit = fit(samples, peak_cost_model(peaks=measure_peaks(threads=1)))
    write_calibration(calibration, cost_fit, samples)  # as `sim calibrate --out` writes it
    slo = slo_of(samples)
    real = RunResult(summarize(real.records, real.summary.duration_s, slo), real.records)
    sim = simulated(calibration, slo).run
    return Case(real, sim, cost_fit, speed_change(before, after))


def warm_up(url: str, engine) -> None:
    """The workload's shapes through the worker and the calibrating engine (another seed:
    nothing of it is cached for the run)."""
    workload = dataclasses.replace(WORKLOAD, seed=99)
    load = Load(concurrency=2, duration_s=3.0, drain_s=30.0)
    asyncio.run(run_load(Endpoint(url), workload, load, progress=False))
    params = SamplingParams(max_tokens=WORKLOAD.output_len, temperature=0.0, ignore_eos=True)
    for session in itertools.islice(workload.sessions(1.0), 2):
        engine.add_request(f"warm-{session.session_id}", session.prompt_token_ids(0), params)
    while engine.has_unfinished_requests():
        engine.step()


def measure_steps(engine) -> list[Sample]:
    """``sim calibrate``'s measurement on the grid of the workload's step shapes."""
    return measure(None, threads=1, repeats=3, engine=engine, **GRID)


def speed_change(before: list[Sample], after: list[Sample]) -> float:
    """The median over the grid's steps of their median time after over before."""
    pairs = zip(medians(before), medians(after), strict=True)
    return float(np.median([b.seconds / a.seconds for a, b in pairs]))


def slo_of(samples: list[Sample]) -> SLO:
    """Objectives in units of this machine's speed now, so that the case means the same on a
    slower or busier machine: TTFT 1.75 lone prefills of the prompt (a request that waited
    for most of another prefill misses it), TPOT 4 lone decode steps.

    Where they sit decides how much goodput moves when the whole machine is a few percent
    faster or slower than the calibration says. Simulated with every step 5% slower or
    faster, the old objectives (TTFT 2.5 prefills, TPOT 3 decode steps, where requests'
    TPOTs crowd: each prefill of another request inside a reply adds several decode steps)
    moved goodput by 7-11% at 50 requests and 12-31% at 21; these move it by 2% (4-7% at
    10%), with 46 of 50 requests meeting both (docs/simulator.md)."""
    n = WORKLOAD.input_len
    prefill = median_time(samples, lambda s: (s.tokens, s.chunks, s.kv_read) == (n, 1, n))
    decode = median_time(samples, lambda s: s.tokens == 1)
    return SLO(ttft_ms=1750 * prefill, tpot_ms=4000 * decode)


def median_time(samples: list[Sample], keep: Callable[[StepShape], bool]) -> float:
    return float(np.median([s.seconds for s in samples if keep(s.shape)]))


def simulated(calibration: str, slo: SLO) -> SimResult:
    """The workload on one cpu-local worker with the calibration and the real engine's
    settings, as ``splitserve sim --calibration`` runs it."""
    engine = EngineConfig()
    cfg = SimConfig(
        get_model("smollm2-135m"),
        load_calibration(get_hardware("cpu-local"), calibration),
        dtype="fp32",
        block_size=engine.block_size,
        kv_cache_gb=engine.kv_cache_gb,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
    )
    return simulate(cfg, Deployment(collocated=1), WORKLOAD, LOAD.rate, LOAD.duration_s, slo)


def test_the_case_ran_with_some_queueing(case):
    # Every request completed on both sides; not an idle system (some TTFTs wait for a step
    # in progress or another prefill) and not a saturated one.
    real, sim = case.real.summary, case.sim.summary
    assert real.completed == sim.completed >= 12
    assert real.failed == sim.failed == 0
    assert real.ttft.percentiles[99] > 1.3 * real.ttft.median


def test_simulated_goodput_is_within_15_percent_of_the_real(case):
    assert case.ratio(goodput) == pytest.approx(1.0, abs=TOLERANCE)


def test_simulated_p50_ttft_is_within_15_percent_of_the_real(case):
    assert case.ratio(p50_ttft) == pytest.approx(1.0, abs=TOLERANCE)
