"""``splitserve sim calibrate``: fit ``cpu-local`` to the real engine's step times here.

The real ``LLMEngine`` (bundled model, one thread) runs a small grid of steps: single prefills
of several lengths and decode steps at several batch sizes. Each step's shape goes through
the cost model with both efficiencies at 1, giving its compute time ``C`` and memory time
``M`` at peak; the fit finds the efficiencies and overheads minimising the squared relative
error of::

    t = max(C / compute_eff, M / memory_eff) + overhead + per_seq * sequences

(a grid over the two efficiencies, linear least squares for the two overheads at each).
It also times the real KV mover loading blocks from a host-RAM tier into the engine's KV
cache: the simulated host-tier loads' bandwidth (``host_bw``).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import numpy as np

from splitserve.sim.cost_model import CostModel, StepShape
from splitserve.sim.hardware import get_hardware
from splitserve.sim.models import get_model

PREFILL_LENS = (32, 128, 256, 512)
DECODE_BATCHES = (1, 4, 8, 16)
DECODE_CONTEXT = 128


@dataclass(frozen=True, slots=True)
class Sample:
    shape: StepShape
    seconds: float


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed steps per grid point")
    p.add_argument("--out", default=None, help="write the samples and the fit (JSON)")


def build_engine(model_path: str | None, threads: int):
    from splitserve.config import EngineConfig
    from splitserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model_path, threads=threads))


def measure(
    model_path: str | None,
    threads: int,
    repeats: int,
    prefill_lens: tuple[int, ...] = PREFILL_LENS,
    decode_batches: tuple[int, ...] = DECODE_BATCHES,
    engine=None,
) -> list[Sample]:
    """Step times of the real engine: single prefills, then decode steps at each batch."""
    from splitserve.common.sampling_params import SamplingParams

    if engine is None:
        engine = build_engine(model_path, threads)
    rng = np.random.default_rng(0)
    samples: list[Sample] = []
    counter = iter(range(10**9))

    def prompt(n: int) -> list[int]:
        return [int(t) for t in rng.integers(1000, 40000, n)]

    def timed_step() -> Sample:
        plan = engine.scheduler.schedule()
        start = time.perf_counter()
        result = engine.runner.execute(plan)
        seconds = time.perf_counter() - start
        engine.scheduler.update(plan, result)
        return Sample(_shape(plan), seconds)

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for n in (*prefill_lens[:1], *prefill_lens):  # the first one warms up
        for _ in range(repeats):
            engine.add_request(f"c{next(counter)}", prompt(n), one)
            samples.append(timed_step())
    del samples[:repeats]
    for b in decode_batches:
        params = SamplingParams(max_tokens=repeats + 2, temperature=0.0, ignore_eos=True)
        ids = [f"c{next(counter)}" for _ in range(b)]
        for rid in ids:
            engine.add_request(rid, prompt(DECODE_CONTEXT), params)
        while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or (
            engine.scheduler.waiting
        ):
            engine.step()
        for _ in range(repeats):
            samples.append(timed_step())
        for rid in ids:
            engine.abort_request(rid)
    return samples


def measure_host_load(engine, blocks: int = 128, repeats: int = 3) -> float:
    """Bytes per second at which the real KV mover loads ``blocks`` blocks from a host-RAM
    tier into ``engine``'s KV cache (read, copy, scatter: the median of ``repeats`` loads)."""
    from splitserve.engine.kv_mover import KVMover
    from splitserve.engine.tiering import BlockCopy
    from splitserve.kvstore import HostTier, TieredStore

    blocks = min(blocks, engine.block_manager.num_blocks)
    ids = list(range(blocks))
    hashes = [i.to_bytes(16, "little") for i in ids]
    store = TieredStore([HostTier(2**40)])
    seconds: list[float] = []
    mover = KVMover(engine.runner.kv_cache, store, ["host"], lambda _t, s, _n: seconds.append(s))
    try:
        for i in range(repeats + 1):  # the first copy saves the blocks into host RAM
            mover.submit([BlockCopy(i, "load" if i else "save", ids, hashes)])
            while not mover.completed():
                mover.wait(0.1)
    finally:
        mover.close()
        store.close()
    return blocks * mover.block_nbytes / float(np.median(seconds))


def _shape(plan) -> StepShape:
    tokens = sum(c.num_tokens for c in plan.chunks)
    attended = sum(
        c.num_tokens * c.start_pos + c.num_tokens * (c.num_tokens + 1) / 2 for c in plan.chunks
    )
    kv_read = sum(c.context_len for c in plan.chunks)
    sampled = sum(c.sample for c in plan.chunks)
    return StepShape(tokens, sampled, attended, kv_read, len(plan.chunks))


def medians(samples: list[Sample]) -> list[Sample]:
    """One sample per step shape, its median time: the machine is shared and noisy."""
    by_shape: dict[StepShape, list[float]] = {}
    for s in samples:
        by_shape.setdefault(s.shape, []).append(s.seconds)
    return [Sample(shape, float(np.median(ts))) for shape, ts in by_shape.items()]


def fit(samples: list[Sample], cost: CostModel) -> dict[str, float]:
    """Efficiencies and overheads for ``cost``'s profile (built with both efficiencies 1)."""
    samples = medians(samples)
    c = np.array([cost.compute_time(s.shape) for s in samples])
    m = np.array([cost.memory_time(s.shape) for s in samples])
    n = np.array([s.shape.chunks for s in samples], dtype=float)
    t = np.array([s.seconds for s in samples])
    best = (np.inf, 1.0, 1.0, 0.0, 0.0)
    for ce in np.linspace(0.05, 1.0, 96):
        for me in np.linspace(0.05, 1.0, 96):
            roof = np.maximum(c / ce, m / me)
            a = np.stack([np.ones_like(t), n], axis=1) / t[:, None]
            (o, so), *_ = np.linalg.lstsq(a, (t - roof) / t, rcond=None)
            o, so = max(o, 0.0), max(so, 0.0)
            err = float(np.sum(((roof + o + so * n) - t) ** 2 / t**2))
            if err < best[0]:
                best = (err, ce, me, o, so)
    err, ce, me, o, so = best
    pred = np.maximum(c / ce, m / me) + o + so * n
    return {
        "compute_eff": float(ce),
        "memory_eff": float(me),
        "step_overhead_s": float(o),
        "seq_overhead_s": float(so),
        "max_rel_error": float(np.max(np.abs(pred - t) / t)),
        "rms_rel_error": float(np.sqrt(err / len(t))),
    }


def peak_cost_model() -> CostModel:
    """The bundled model on cpu-local at 100% efficiency and no overhead: what ``fit`` scales."""
    hw = get_hardware("cpu-local").with_fit(
        compute_eff=1.0, memory_eff=1.0, step_overhead_s=0.0, seq_overhead_s=0.0
    )
    return CostModel(get_model("smollm2-135m"), hw, 1, "fp32")


def cmd_calibrate(args: argparse.Namespace) -> int:
    cost = peak_cost_model()
    engine = build_engine(args.model_path, args.threads)
    samples = measure(args.model_path, args.threads, args.repeats, engine=engine)
    result = fit(samples, cost)
    result["host_bw"] = measure_host_load(engine, repeats=args.repeats)
    print(f"{'step':<28}{'measured ms':>12}")
    for s in samples:
        label = f"{s.shape.chunks} seqs, {s.shape.tokens} tokens"
        print(f"{label:<28}{1000 * s.seconds:>12.1f}")
    for key, value in result.items():
        print(f"{key}: {value:.4g}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "fit": result,
                    "samples": [
                        {"tokens": s.shape.tokens, "seqs": s.shape.chunks, "seconds": s.seconds}
                        for s in samples
                    ],
                },
                f,
                indent=1,
            )
    return 0
