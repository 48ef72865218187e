"""``benchmarks/decode_kernels.py --argmax``: one real run of the greedy-pick comparison."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.models import native

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_kernels.py"


@pytest.mark.skipif(native.load("fused_ops") is not None, reason=str(native.load("fused_ops")))
def test_the_argmax_comparison_times_both_picks_at_each_row_count():
    done = subprocess.run(
        [sys.executable, str(_PATH), "--argmax", "--rounds", "1", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = re.findall(
        r"^\s*(\d+) rows: torch ([\d.]+) ms \| C\+\+ ([\d.]+) ms, ([\d.]+)x$", done.stdout, re.M
    )
    assert [int(r[0]) for r in rows] == [1, 16, 64], done.stdout
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
