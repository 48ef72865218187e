"""The small validation case (``tests/sim/test_validate.py``: one real worker, 50 random
requests at 1.25/s) run for real, reading the worker's ``splitserve:engine_step_seconds``
histogram before and after, against the same case simulated on a stored calibration: is
the real engine busier (slower steps under load) than the simulated one?

    .venv/bin/python benchmarks/validate_busy_time.py --calibration benchmarks/out/cal-s8.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import re
import sys
from pathlib import Path

import httpx

from splitserve.bench.client import Endpoint
from splitserve.bench.load import Load, run_load
from splitserve.bench.metrics import SLO

TESTS = Path(__file__).resolve().parents[1] / "tests"


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def step_histogram(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", trust_env=False).text
    count = float(re.search(r"splitserve:engine_step_seconds_count (\S+)", text).group(1))
    total = float(re.search(r"splitserve:engine_step_seconds_sum (\S+)", text).group(1))
    return count, total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibration", required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(TESTS))  # the case's module imports tests/procs.py
    case = load("validate_case", TESTS / "sim" / "test_validate.py")
    url, proc = case.start_worker([])
    try:
        case.wait_healthy(url, proc)
        warm = case.RandomConfig(input_len=64, output_len=8, seed=99)
        asyncio.run(
            run_load(Endpoint(url), warm, Load(concurrency=2, duration_s=3.0), progress=False)
        )
        count0, busy0 = step_histogram(url)
        real = asyncio.run(run_load(Endpoint(url), case.WORKLOAD, case.LOAD, progress=False))
        count1, busy1 = step_histogram(url)
    finally:
        case.stop_group(proc)
    sim = case.simulated(args.calibration, SLO())
    busy_sim = sim.cluster.workers[0].busy_s
    print(
        f"real: {count1 - count0:.0f} engine steps, busy {busy1 - busy0:.2f} s, "
        f"p50 TTFT {real.summary.ttft.median:.0f} ms"
    )
    print(f"simulated: busy {busy_sim:.2f} s, p50 TTFT {sim.summary.ttft.median:.0f} ms")


if __name__ == "__main__":
    main()
