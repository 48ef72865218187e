"""``benchmarks/serve_startup.py``: its options, the baseline's source, and one real start."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import psutil
import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_startup.py"
_spec = importlib.util.spec_from_file_location("serve_startup", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["serve_startup"] = bench
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--timeout", "0"]])
def test_bad_options_are_rejected(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_an_unknown_baseline_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no-such-rev"):
        bench.extract_src("no-such-rev", tmp_path)


def test_the_baseline_is_a_source_tree_of_that_commit(tmp_path):
    src = bench.extract_src("HEAD", tmp_path)
    assert (src / "splitserve" / "cli.py").read_text() == (
        bench.ROOT / "src" / "splitserve" / "cli.py"
    ).read_text()


def test_a_start_times_readiness_then_the_answer_and_its_stop_leaves_nothing(tmp_path):
    port = bench.free_port()
    start = bench.time.perf_counter()
    proc = bench.launch(bench.ROOT / "src", port, tmp_path / "serve.log")
    try:
        times = bench.first_answer(proc, f"http://127.0.0.1:{port}", start, 300.0)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        assert len(tree) >= 2  # serve and its worker
    finally:
        bench.stop_group(proc)
    assert 0 < times["ready"] <= times["answer"] < 300
    assert [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
