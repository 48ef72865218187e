"""``benchmarks/detokenize.py``: one real run of the windowed-against-whole comparison."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "detokenize.py"


def test_the_comparison_times_both_ways_at_each_length():
    done = subprocess.run(
        [sys.executable, str(_PATH), "--lengths", "50,300", "--window", "20"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = re.findall(
        r"^\s*(\d+) tokens: whole\s+([\d.]+) µs \| windowed\s+([\d.]+) µs,\s+([\d.]+)x$",
        done.stdout,
        re.M,
    )
    assert [int(r[0]) for r in rows] == [50, 300], done.stdout
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
