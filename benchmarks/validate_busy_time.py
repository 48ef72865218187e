"""The small validation case (``tests/sim/test_validate.py``: one real worker, 50 random
requests at 1.25/s) run for real, with the worker's engine time as ``splitserve bench``
reports it (its steps' wall time and its engine thread's CPU time in them), against the
same case simulated on a stored calibration: is the real engine busier (slower steps under
load) than the simulated one?

    .venv/bin/python benchmarks/validate_busy_time.py --calibration benchmarks/out/cal-s8.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
from pathlib import Path

from splitserve.bench.client import Endpoint
from splitserve.bench.load import run_load
from splitserve.workload.metrics import SLO
from splitserve.workload.runs import Load

TESTS = Path(__file__).resolve().parents[1] / "tests"


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


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
        real = asyncio.run(run_load(Endpoint(url), case.WORKLOAD, case.LOAD, progress=False))
    finally:
        case.stop_group(proc)
    sim = case.simulated(args.calibration, SLO())
    busy_sim = sim.cluster.workers[0].busy_s
    server = real.summary.server
    print(
        f"real: busy {server['engine_busy_seconds']:.2f} s (engine thread CPU "
        f"{server['engine_cpu_seconds']:.2f} s), p50 TTFT {real.summary.ttft.median:.0f} ms"
    )
    print(f"simulated: busy {busy_sim:.2f} s, p50 TTFT {sim.summary.ttft.median:.0f} ms")


if __name__ == "__main__":
    main()
