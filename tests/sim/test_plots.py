"""The goodput-ratio heat map used by benchmarks/sim_questions.py."""

from __future__ import annotations

import math

from splitserve.sim.plots import ratio_map


def test_ratio_map_writes_a_png_with_undefined_cells(tmp_path):
    path = tmp_path / "map.png"
    grid = [[1.0, 0.5], [2.5, math.nan]]
    ratio_map(str(path), "a title long enough to wrap " * 3, ["a", "b"], ["x", "y"], grid, "X", "Y")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
