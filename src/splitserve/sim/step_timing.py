"""The real engine's step times on this machine, for ``sim calibrate``'s fit.

``measure`` runs a small grid of steps on the real ``LLMEngine`` (bundled model, one thread
by default): single prefills of several lengths, prefills after a cached context, decode
steps at several batch sizes, and prefills in the same step as a few decodes (the step that
decides the TTFT of a request reaching a busy worker). ``measure_co_run`` times the same
grid while a second engine computes in another process; ``measure_host_load`` times the
real KV mover loading blocks from a host-RAM tier.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import math
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from splitserve.engine.step_log import plan_stats
from splitserve.sim.cost_model import StepShape

PREFILL_LENS = (32, 128, 256, 512)
DECODE_BATCHES = (1, 2, 4, 8, 16)  # 1, 2 and 4 on the fused path, 8 and 16 not
DECODE_CONTEXT = 128
# Prefills of (new tokens, cached tokens before them): a later turn over its cached context.
CONTEXT_PREFILLS = ((32, 512), (128, 512))
# Prefills of (new tokens) in one step with (decoders) of DECODE_CONTEXT-token prompts: a
# request arriving at a busy worker, the step that decides its TTFT.
MIXED = ((64, 1), (64, 3), (128, 4))
# Each ``measure`` call draws its own prompts and request ids: measuring twice on one engine
# (before and after a run) must neither hit the first call's prompts in the prefix cache nor
# reuse the ids it left behind.
_CALLS = itertools.count()


@dataclass(frozen=True, slots=True)
class Sample:
    shape: StepShape
    seconds: float


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
    context_prefills: tuple[tuple[int, int], ...] = CONTEXT_PREFILLS,
    mixed: tuple[tuple[int, int], ...] = MIXED,
) -> list[Sample]:
    """Step times of the real engine: single prefills, prefills after a cached context,
    decode steps at each batch, then prefills next to decodes."""
    from splitserve.common.sampling_params import SamplingParams

    if engine is None:
        engine = build_engine(model_path, threads)
    call = next(_CALLS)
    rng = np.random.default_rng(call)
    samples: list[Sample] = []
    counter = (f"c{call}-{i}" for i in itertools.count())

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
            engine.add_request(next(counter), prompt(n), one)
            samples.append(timed_step())
    del samples[:repeats]
    for n, cached in context_prefills:
        context = prompt(cached)
        engine.add_request(next(counter), context, one)  # computes and caches it
        while engine.has_unfinished_requests():
            engine.step()
        for _ in range(repeats):
            engine.add_request(next(counter), context + prompt(n), one)
            samples.append(timed_step())

    def start_decoders(b: int, max_tokens: int) -> list[str]:
        """``b`` requests of ``DECODE_CONTEXT``-token prompts, stepped until all decode."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = [next(counter) for _ in range(b)]
        for rid in ids:
            engine.add_request(rid, prompt(DECODE_CONTEXT), params)
        while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or (
            engine.scheduler.waiting
        ):
            engine.step()
        return ids

    for b in decode_batches:
        ids = start_decoders(b, repeats + 2)
        for _ in range(repeats):
            samples.append(timed_step())
        for rid in ids:
            engine.abort_request(rid)
    for n, b in mixed:
        ids = start_decoders(b, 2 * repeats + 2)
        for _ in range(repeats):
            engine.add_request(next(counter), prompt(n), one)  # its prefill joins the decodes
            samples.append(timed_step())
        for rid in ids:
            engine.abort_request(rid)
    return samples


def measure_co_run(engine, threads: int, repeats: int, **grid) -> list[Sample]:
    """``measure`` on ``engine`` while a second engine (another process, the same model and
    threads) runs prefills and decodes of its own without pause."""
    with busy_neighbour(threads):
        return measure(None, threads, repeats, engine=engine, **grid)


@contextlib.contextmanager
def busy_neighbour(
    threads: int, timeout_s: float = 300.0, target: Callable[..., None] | None = None
) -> Iterator[None]:
    """A second engine computing in another process for the duration of the block; the
    process is gone when the block ends, however it ends. (``target(threads, ready, stop)``
    replaces the engine's loop in tests.)"""
    ctx = multiprocessing.get_context("spawn")  # a forked torch process can deadlock
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=target or _keep_busy, args=(threads, ready, stop), daemon=True)
    proc.start()
    try:
        if not ready.wait(timeout_s):
            raise RuntimeError(f"the second engine did not start within {timeout_s:g} s")
        yield
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _keep_busy(threads: int, ready, stop) -> None:
    """Four requests in flight at all times (128-token prompts, 16-token replies), stepped
    until ``stop``: prefills mixed with decode batches, as a worker under load."""
    from splitserve.common.sampling_params import SamplingParams

    engine = build_engine(None, threads)
    rng = np.random.default_rng(1 << 20)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ready.set()
    for i in itertools.count():
        if stop.is_set():
            return
        if len(engine.scheduler.running) + len(engine.scheduler.waiting) < 4:
            prompt = [int(t) for t in rng.integers(1000, 40000, 128)]
            engine.add_request(f"busy-{i}", prompt, params)
        engine.step()


def co_run_slowdown(alone: list[Sample], co_run: list[Sample]) -> float:
    """The median over the grid's steps of (time with a neighbour / time alone) - 1."""
    pairs = zip(medians(alone), medians(co_run), strict=True)
    return float(np.median([b.seconds / a.seconds for a, b in pairs])) - 1.0


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
    return StepShape(*plan_stats(plan))


def medians(samples: list[Sample]) -> list[Sample]:
    """One sample per step (tokens, sequences, context before them in 16-token blocks), its
    median time: the machine is shared and noisy. A decode step's context grows by one per
    repeat; the first one's shape stands for them."""
    by_step: dict[tuple[int, int, int], list[Sample]] = {}
    for s in samples:
        before = (s.shape.kv_read - s.shape.tokens) // s.shape.chunks
        by_step.setdefault((s.shape.tokens, s.shape.chunks, before // 16), []).append(s)
    return [Sample(g[0].shape, float(np.median([s.seconds for s in g]))) for g in by_step.values()]


def measure_peaks(threads: int, repeats: int = 5) -> tuple[float, float]:
    """This machine's fp32 GEMM FLOP/s at ``threads`` threads (square 1024 products) and its
    memory bandwidth (bytes read per second summing 256 MiB: a step's weights and KV are read,
    and a read stream runs faster than a copy): the best of ``repeats``. The fit's efficiencies
    are fractions of these, so that a faster machine than ``cpu-local``'s nominal one does not
    push them past 1."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n, products = 1024, 8
        a, b = torch.randn(n, n), torch.randn(n, n)
        src = torch.ones(64 * 2**20)
        flops, read = [], []
        for _ in range(repeats + 1):  # the first of each warms up
            start = time.perf_counter()
            for _ in range(products):
                torch.mm(a, b)
            flops.append(products * 2 * n**3 / (time.perf_counter() - start))
            start = time.perf_counter()
            src.sum()
            read.append(src.numel() * 4 / (time.perf_counter() - start))
        return max(flops[1:]), max(read[1:])
    finally:
        torch.set_num_threads(before)


def read_step_logs(paths: list[str], step_time: str = "cpu") -> tuple[list[Sample], int]:
    """The steps of workers' step logs (``engine/step_log.py``; a directory stands for the
    ``*.jsonl`` files in it and its subdirectories) as one sample per kind of step
    (``run_samples``), and their engines' fused decode limit, which must agree. ``step_time``
    "cpu" takes the engine thread's CPU time over the model run, which holds the whole run
    only on a one-thread engine."""
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(glob.glob(os.path.join(path, "**", "*.jsonl"), recursive=True))
        else:
            files.append(path)
    if not files:
        raise SystemExit(f"no step logs (*.jsonl) in {', '.join(paths)}")
    key = "cpu_seconds" if step_time == "cpu" else "seconds"
    steps: list[Sample] = []
    limits: set[int] = set()
    for path in files:
        try:
            with open(path) as f:
                for line in f:
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    if "engine" in row:
                        engine = row["engine"]
                        limits.add(int(engine["fused_decode_max_seqs"]))
                        if step_time == "cpu" and engine["threads"] != 1:
                            raise SystemExit(
                                f"{path}: an engine of {engine['threads']} threads; the engine "
                                "thread's CPU time misses the others' (use --step-time wall)"
                            )
                        continue
                    seconds = float(row[key])
                    if seconds > 0:
                        steps.append(Sample(row_shape(row), seconds))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"cannot read step log {path}: {e!r}") from None
    if not steps:
        raise SystemExit(f"no steps in {', '.join(files)}")
    if len(limits) != 1:
        raise SystemExit(
            f"step logs from engines with fused decode limits {sorted(limits)}: one kind of "
            "engine per fit"
        )
    return run_samples(steps), limits.pop()


def row_shape(row: dict) -> StepShape:
    """A stored step's shape: a row of a step log or of a ``sim calibrate --out`` file's
    samples. Calibration files from before the whole shapes were stored hold tokens and
    sequences only: a single sequence of several tokens is a prefill from position 0, the
    rest decode steps over ``DECODE_CONTEXT``-token prompts, as ``measure`` takes them."""
    tokens, seqs = int(row["tokens"]), int(row["seqs"])
    if seqs < 1 or tokens < seqs:
        raise ValueError(f"a step of {tokens} tokens over {seqs} sequences")
    if "attended" in row:
        return StepShape(
            tokens, int(row["sampled"]), float(row["attended"]), int(row["kv_read"]), seqs
        )
    if seqs == 1 and tokens > 1:
        return StepShape(tokens, 1, tokens * (tokens + 1) / 2, tokens, 1)
    context = DECODE_CONTEXT + 1
    return StepShape(tokens, seqs, seqs * context, seqs * context, seqs)


def run_samples(steps: list[Sample]) -> list[Sample]:
    """A serving run's steps grouped by kind: the sequences in the step, its tokens beyond
    one per sequence (in half-octaves), and its mean context per sequence (in 128-token
    bins). Each kind is the step of median time among its own (a real shape and time); a run
    holds thousands of steps of a few hundred kinds, and the fit weighs kinds, not counts."""
    groups: dict[tuple[int, int, int], list[Sample]] = {}
    for s in steps:
        extra = s.shape.tokens - s.shape.chunks
        band = 0 if extra <= 0 else 1 + round(2 * math.log2(extra))
        context = (s.shape.kv_read - s.shape.tokens) // s.shape.chunks
        groups.setdefault((s.shape.chunks, band, context // 128), []).append(s)
    out = []
    for group in groups.values():
        group.sort(key=lambda s: s.seconds)
        out.append(group[(len(group) - 1) // 2])
    return out
