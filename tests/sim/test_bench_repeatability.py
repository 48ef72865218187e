"""``benchmarks/bench_repeatability.py``: two stored real runs of one command, side by side.

``tests/data/bench_repeatability/``: the fields the script reads from the ``--json`` of two
real runs of one agentic ``bench compare`` command (2026-12-02, docs/journal/) and of a
random one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_repeatability.py"
RUNS = ROOT / "tests" / "data" / "bench_repeatability"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )


def test_each_run_is_shown_with_its_ratio_to_the_first():
    out = run(str(RUNS / "agentic-w4.json"), str(RUNS / "agentic-w4-repeat.json"))
    assert out.returncode == 0, out.stderr
    rows = [line.split(" | ") for line in out.stdout.splitlines() if "rate 0.35/s" in line]
    by_run = {(r[0].strip("| "), r[2]): r for r in rows}
    assert len(by_run) == 6  # three deployments, two runs
    first, second = by_run["collocated-rr", "1"], by_run["collocated-rr", "2"]
    assert (first[3], first[4], first[5]) == ("0.083", "1.00", "3684")
    assert (second[3], second[4], second[6]) == ("0.050", "0.60", "1.21")


def test_one_run_or_runs_of_different_commands_are_refused():
    alone = run(str(RUNS / "agentic-w4.json"))
    assert alone.returncode == 2 and "at least two runs" in alone.stderr
    other = run(str(RUNS / "agentic-w4.json"), str(RUNS / "random-pd.json"))
    assert other.returncode == 1 and "not the same command" in other.stderr
