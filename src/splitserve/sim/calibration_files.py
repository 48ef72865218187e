"""Calibration files (``sim calibrate --out``): writing one, and reading back its samples, its
fitted peaks and the figures other benchmarks measured into it."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from splitserve.sim.hardware import fitted_peaks
from splitserve.sim.step_timing import (
    Sample,
    row_shape,
)


def base_figures(path: str) -> tuple[float | None, dict[str, float], tuple[float, float] | None]:
    """What a fit of a run's steps keeps from a grid calibration (``--base``): its measured
    host-tier bandwidth, the figures measured elsewhere (serving CPU; ``co_run_slowdown``)
    and its peaks."""
    try:
        with open(path) as f:
            fit_values = json.load(f)["fit"]
        host_bw = fit_values.get("host_bw")
        host_bw = float(host_bw) if isinstance(host_bw, int | float) and host_bw > 0 else None
        elsewhere = measured_elsewhere(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SystemExit(f"cannot read calibration file {path}: {e!r}") from None
    if isinstance(fit_values.get("co_run_slowdown"), int | float):
        elsewhere["co_run_slowdown"] = float(fit_values["co_run_slowdown"])
    return host_bw, elsewhere, fitted_peaks(fit_values)


def files_peaks(paths: list[str]) -> tuple[float, float] | None:
    """The mean of the peaks calibration files were fitted against (None: none stored)."""
    found = []
    for path in paths:
        with open(path) as f:
            peaks = fitted_peaks(json.load(f).get("fit", {}))
        if peaks is not None:
            found.append(peaks)
    if not found:
        return None
    return (float(np.mean([p[0] for p in found])), float(np.mean([p[1] for p in found])))


def write_calibration(
    path: str, result: dict[str, float], samples: list[Sample], co_run: list[Sample] | None = None
) -> None:
    data = {"fit": result, "samples": _rows(samples)}
    if co_run:
        data["co_run_samples"] = _rows(co_run)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def _rows(samples: list[Sample]) -> list[dict]:
    rows = [{**dataclasses.asdict(s.shape), "seconds": s.seconds} for s in samples]
    for row in rows:
        row["seqs"] = row.pop("chunks")
    return rows


def read_samples(path: str) -> tuple[list[Sample], float | None, list[Sample]]:
    """The samples of a ``sim calibrate --out`` file, its measured ``host_bw`` (if any) and
    its ``--co-run`` samples (none in older files); older files' rows hold less of a shape
    (``step_timing.row_shape``)."""
    try:
        with open(path) as f:
            data = json.load(f)
        samples = [Sample(row_shape(r), float(r["seconds"])) for r in data["samples"]]
        co_run = [Sample(row_shape(r), float(r["seconds"])) for r in data.get("co_run_samples", [])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SystemExit(f"cannot read calibration samples from {path}: {e!r}") from None
    if not samples:
        raise SystemExit(f"{path} holds no samples")
    host_bw = data.get("fit", {}).get("host_bw")
    return samples, float(host_bw) if isinstance(host_bw, int | float) else None, co_run


# Figures a calibration file holds that other benchmarks measured (request_overhead.py,
# serving_cpu.py), not the step grid: a refit keeps them.
MEASURED_ELSEWHERE = (
    "request_overhead_s",
    "serving_cpu_per_request_s",
    "serving_cpu_per_token_s",
    "kv_copy_cpu_per_block_s",
)


def stored_fused_max(path: str) -> int:
    """The fused decode limit of the engine an earlier file timed (0 in files from before the
    fused path, which timed the torch path)."""
    with open(path) as f:
        value = json.load(f).get("fit", {}).get("fused_decode_max_seqs", 0)
    if not isinstance(value, int) or value < 0:
        raise SystemExit(f"{path}: fused_decode_max_seqs must be an integer >= 0, got {value!r}")
    return value


def read_files(
    paths: list[str],
) -> tuple[list[Sample], float | None, list[Sample], int, dict[str, float]]:
    """What ``--refit`` fits: every file's samples and co-run samples together, the mean of
    their measured ``host_bw``, their engines' fused decode limit (which must agree) and the
    figures measured elsewhere (the first file holding each wins)."""
    samples: list[Sample] = []
    co_run: list[Sample] = []
    bandwidths: list[float] = []
    limits: set[int] = set()
    elsewhere: dict[str, float] = {}
    for path in paths:
        got, host_bw, co = read_samples(path)
        samples += got
        co_run += co
        if host_bw is not None:
            bandwidths.append(host_bw)
        limits.add(stored_fused_max(path))
        elsewhere = {**measured_elsewhere(path), **elsewhere}
    if len(limits) > 1:
        raise SystemExit(
            f"{', '.join(paths)} timed engines with different fused decode limits "
            f"({sorted(limits)}): their steps are not the same steps"
        )
    host_bw = sum(bandwidths) / len(bandwidths) if bandwidths else None
    return samples, host_bw, co_run, limits.pop(), elsewhere


def measured_elsewhere(path: str) -> dict[str, float]:
    with open(path) as f:
        fit = json.load(f).get("fit", {})
    return {k: float(fit[k]) for k in MEASURED_ELSEWHERE if isinstance(fit.get(k), int | float)}
