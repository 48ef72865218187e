"""``splitserve sim calibrate``: fit ``cpu-local`` to the real engine's step times here.

The real ``LLMEngine`` (bundled model, one thread) runs a small grid of steps: single prefills
of several lengths, prefills after a cached context, and decode steps at several batch sizes.
Each step's shape goes through the cost model with every efficiency at 1, giving its time at
peak in weight products ``G``, attention ``A`` and memory ``M``; the fit finds the
efficiencies and overheads minimising the squared relative error of::

    t = max(G / compute_eff + A / attention_eff, M / memory_eff) + overhead
        + per_seq * sequences + multi_row * [multi-row step]

(a grid over the three efficiencies, non-negative linear least squares for the three
overheads at each point). The efficiencies are fractions of this machine's peaks, measured
first (``measure_peaks``: fp32 GEMM FLOP/s and memory bandwidth) and stored with the fit;
files from before hold none and are fitted and read against ``cpu-local``'s nominal ones.
``multi_row``: a step of one token runs its weight products as GEMV, a larger one as GEMM,
which packs the weights first; a decode-only step of at most ``fused_decode_max_seqs``
sequences runs on the engine's fused path and pays no such cost (the fit records the
engine's limit, 0 when its fused path was off). It also times the real KV mover loading
blocks from a host-RAM tier into the engine's KV cache: the simulated host-tier
loads' bandwidth (``host_bw``). ``--co-run`` times the grid once more while a second engine
computes in another process: ``co_run_slowdown``, how much two workers sharing this machine
slow each other beyond the share of cores (``sim --host-cores``). ``--refit FILE`` fits the
samples of an earlier ``--out`` file again, measuring nothing; ``--refit BEFORE AFTER`` fits
two files' samples together (medians over both), a calibration bracketing a run between
them. ``--from-steps LOG...`` fits the steps real workers logged while serving
(``engine/step_log.py``), each kind of step at its median thread CPU time. The
measurements live in ``step_timing``; this module fits them and reads and writes calibration files.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from splitserve.engine.step_log import fused_decode_max_seqs
from splitserve.sim.calibration_files import (
    base_figures,
    files_peaks,
    read_files,
    write_calibration,
)
from splitserve.sim.cost_model import CostModel, StepShape
from splitserve.sim.hardware import fitted_peaks, get_hardware
from splitserve.sim.models import get_model
from splitserve.sim.step_timing import (
    Sample,
    build_engine,
    co_run_slowdown,
    measure,
    measure_co_run,
    measure_host_load,
    measure_peaks,
    medians,
    read_step_logs,
)


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed steps per grid point")
    p.add_argument("--out", default=None, help="write the samples and the fit (JSON)")
    p.add_argument(
        "--co-run",
        action="store_true",
        help="time the grid again while a second engine computes (co_run_slowdown)",
    )
    p.add_argument(
        "--from-steps",
        default=None,
        nargs="+",
        metavar="LOG",
        help="fit the engine steps real workers logged while serving (files, or directories "
        "of *.jsonl, from `splitserve worker --step-log-dir` or `bench compare --step-logs`); "
        "measures only this machine's peaks, unless --base gives them",
    )
    p.add_argument(
        "--step-time",
        default="cpu",
        choices=["cpu", "wall"],
        help="with --from-steps: a step's time is the engine thread's CPU over its model run "
        "(default; one-thread workers: their share of the cores is the simulator's to model) "
        "or its wall time",
    )
    p.add_argument(
        "--base",
        default=None,
        metavar="FILE",
        help="with --from-steps: a `sim calibrate --out` file whose peaks, host-tier bandwidth "
        "and serving figures the new fit keeps",
    )
    p.add_argument(
        "--refit",
        default=None,
        nargs="+",
        metavar="FILE",
        help="fit the samples of earlier `sim calibrate --out` files again (measures nothing); "
        "two or more: fitted together, e.g. calibrations taken before and after a run",
    )


OVERHEADS = ("step_overhead_s", "seq_overhead_s", "multi_row_overhead_s")


def fit(samples: list[Sample], cost: CostModel) -> dict[str, float]:
    """Efficiencies and overheads for ``cost``'s profile (built with every efficiency 1):
    a coarse grid over the efficiencies (steps of 0.05), then a fine one (0.01) around its
    best point. The fused decode path's compute efficiency is fitted where the grid has
    steps that ran on it."""
    terms = _Terms(medians(samples), cost)
    coarse = np.arange(0.05, 1.0 + 1e-9, 0.05)
    fused_axis = coarse if terms.fused.any() else np.array([1.0])
    best = terms.best((coarse, coarse, coarse, fused_axis))
    fine = tuple(
        np.arange(max(v - 0.05, 0.01), min(v + 0.05, 1.0) + 1e-9, 0.01) if len(axis) > 1 else axis
        for v, axis in zip(best, (coarse, coarse, coarse, fused_axis), strict=True)
    )
    ce, me, ae, fe = terms.best(fine)
    coef, rel = terms.overheads(terms.roofs(*(np.array([v]) for v in (ce, me, ae, fe))))
    result = {
        "compute_eff": float(ce),
        "memory_eff": float(me),
        "attention_eff": float(ae),
        **{name: float(v) for name, v in zip(OVERHEADS, coef[:, 0], strict=True)},
        "max_rel_error": float(np.max(np.abs(rel))),
        "rms_rel_error": float(np.sqrt(np.mean(rel**2))),
        "fused_decode_max_seqs": cost.hw.fused_decode_max_seqs,
        # What the efficiencies are fractions of (measured by the calibration, or nominal).
        "peak_flops_fp32": cost.hw.peak_flops["fp32"],
        "mem_bw": cost.hw.hbm_bw,
    }
    if terms.fused.any():
        result["fused_compute_eff"] = float(fe)
    return result


class _Terms:
    """Each sample's time at peak (weight products, attention, memory) and overhead terms."""

    def __init__(self, samples: list[Sample], cost: CostModel) -> None:
        self.attention = np.array([cost.compute_time(_attention_only(s.shape)) for s in samples])
        self.gemm = np.array([cost.compute_time(s.shape) for s in samples]) - self.attention
        self.memory = np.array([cost.memory_time(s.shape) for s in samples])
        self.fused = np.array([cost.fused(s.shape.tokens, s.shape.chunks) for s in samples])
        self.t = np.array([s.seconds for s in samples])
        # The overheads' terms: 1, sequences, [multi-row step].
        self.x = np.array(
            [
                [1.0, s.shape.chunks, float(cost.multi_row(s.shape.tokens, s.shape.chunks))]
                for s in samples
            ]
        )

    def roofs(self, ce: np.ndarray, me: np.ndarray, ae: np.ndarray, fe: np.ndarray) -> np.ndarray:
        """Each sample's roofline time (rows) for each set of efficiencies (columns): the
        fused path's steps compute at ``fe``, the others' weights at ``ce`` and attention at
        ``ae``; every step reads memory at ``me``."""
        gemm, attention = self.gemm[:, None], self.attention[:, None]
        compute = np.where(self.fused[:, None], (gemm + attention) / fe, gemm / ce + attention / ae)
        return np.maximum(compute, self.memory[:, None] / me)

    def overheads(self, roofs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Non-negative overheads for each column of roof times, and relative errors."""
        t = self.t[:, None]
        coef, _ = _nonnegative_fits(self.x / t, (t - roofs) / t)
        return coef, (roofs + self.x @ coef - t) / t

    def best(self, axes: tuple[np.ndarray, ...]) -> tuple[float, float, float, float]:
        """The (compute, memory, attention, fused compute) efficiencies on the grid ``axes``
        spans with the smallest squared relative error."""
        grid = [g.ravel() for g in np.meshgrid(*axes, indexing="ij")]
        # In slices of the grid: a serving run's few hundred kinds of step over the whole
        # grid would not fit in memory at once.
        size = max(1, 2_000_000 // len(self.t))
        errors = []
        for lo in range(0, len(grid[0]), size):
            _, rel = self.overheads(self.roofs(*(g[lo : lo + size] for g in grid)))
            errors.append(np.sum(rel**2, axis=0))
        i = int(np.argmin(np.concatenate(errors)))
        ce, me, ae, fe = (float(g[i]) for g in grid)
        return ce, me, ae, fe


def _attention_only(shape: StepShape) -> StepShape:
    return StepShape(0, 0, shape.attended, 0, shape.chunks)


def _nonnegative_fits(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each column of ``b``, the least-squares ``x >= 0`` of ``a x = b`` and its squared
    error: every subset of ``a``'s columns solved freely, the best with no negative term (the
    exact answer for the few terms here)."""
    k = a.shape[1]
    best_coef = np.zeros((k, b.shape[1]))
    best_err = np.sum(b**2, axis=0)  # all terms 0
    for mask in range(1, 2**k):
        cols = [i for i in range(k) if mask >> i & 1]
        sol = np.linalg.pinv(a[:, cols]) @ b
        err = np.sum((a[:, cols] @ sol - b) ** 2, axis=0)
        better = (err < best_err) & np.all(sol >= 0, axis=0)
        best_err = np.where(better, err, best_err)
        full = np.zeros_like(best_coef)
        full[cols] = sol
        best_coef = np.where(better, full, best_coef)
    return best_coef, best_err


def peak_cost_model(
    fused_decode_max_seqs: int | None = None, peaks: tuple[float, float] | None = None
) -> CostModel:
    """The bundled model on cpu-local at 100% efficiency and no overhead: what ``fit`` scales
    (``fused_decode_max_seqs``: the measured engine's, default cpu-local's; ``peaks``: this
    machine's measured (fp32 FLOP/s, memory bytes/s), default cpu-local's nominal ones)."""
    hw = get_hardware("cpu-local").with_peaks(peaks)
    hw = hw.with_fit(
        compute_eff=1.0,
        memory_eff=1.0,
        attention_eff=1.0,
        step_overhead_s=0.0,
        seq_overhead_s=0.0,
        multi_row_overhead_s=0.0,
        fused_compute_eff=1.0,
        fused_decode_max_seqs=(
            hw.fused_decode_max_seqs if fused_decode_max_seqs is None else fused_decode_max_seqs
        ),
    )
    return CostModel(get_model("smollm2-135m"), hw, 1, "fp32")


def cmd_calibrate(args: argparse.Namespace) -> int:
    cores = os.cpu_count() or 1
    if args.co_run and not args.refit and 2 * args.threads > cores:
        raise ValueError(
            f"--co-run times two engines of --threads {args.threads} at once, which needs "
            f"{2 * args.threads} cores; this machine has {cores}"
        )
    if args.refit and args.from_steps:
        raise ValueError("--refit and --from-steps are two sources of samples: give one")
    if (args.base or args.step_time != "cpu") and not args.from_steps:
        raise ValueError("--base and --step-time go with --from-steps")
    if args.co_run and (args.refit or args.from_steps):
        raise ValueError("--co-run times the step grid; --refit and --from-steps measure none")
    co_run: list[Sample] = []
    elsewhere: dict[str, float] = {}
    if args.refit:
        samples, host_bw, co_run, fused_max, elsewhere = read_files(args.refit)
        peaks = files_peaks(args.refit)
    elif args.from_steps:
        samples, fused_max = read_step_logs(args.from_steps, args.step_time)
        host_bw, peaks = None, None
        if args.base:
            host_bw, elsewhere, peaks = base_figures(args.base)
        if peaks is None:
            peaks = measure_peaks(args.threads)
    else:
        engine = build_engine(args.model_path, args.threads)
        fused_max = fused_decode_max_seqs(engine)
        peaks = measure_peaks(args.threads)
        samples = measure(args.model_path, args.threads, args.repeats, engine=engine)
        host_bw = measure_host_load(engine, repeats=args.repeats)
        if args.co_run:
            co_run = measure_co_run(engine, args.threads, args.repeats)
    cost = peak_cost_model(fused_max, peaks)
    result = fit(samples, cost)
    if host_bw is not None:
        result["host_bw"] = host_bw
    if co_run:
        result["co_run_slowdown"] = co_run_slowdown(samples, co_run)
    result.update(elsewhere)
    print(f"{'step':<28}{'measured ms':>12}{'fitted ms':>11}")
    fitted = cost_model_of(result)
    for s in medians(samples):
        label = f"{s.shape.chunks} seqs, {s.shape.tokens} tokens"
        print(f"{label:<28}{1000 * s.seconds:>12.1f}{1000 * fitted.step_time(s.shape):>11.1f}")
    for key, value in result.items():
        print(f"{key}: {value:.4g}")
    if args.out:
        write_calibration(args.out, result, samples, co_run)
    return 0


def cost_model_of(result: dict[str, float]) -> CostModel:
    """The bundled model on cpu-local with a fit's factors."""
    keys = ("compute_eff", "memory_eff", "attention_eff", *OVERHEADS)
    hw = (
        get_hardware("cpu-local")
        .with_peaks(fitted_peaks(result))
        .with_fit(
            **{k: result[k] for k in keys},
            fused_decode_max_seqs=int(result.get("fused_decode_max_seqs", 0)),
            fused_compute_eff=result.get("fused_compute_eff"),
        )
    )
    return CostModel(get_model("smollm2-135m"), hw, 1, "fp32")
