"""The Mooncake traces ship inside the package: a checkout copied anywhere, with nothing
beside it, and a built wheel or sdist all carry them (``splitserve bench --workload
mooncake`` from such a copy: ``test_e2e.py``)."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from procs import copy_checkout, env_for_checkout

TRACES = ("mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl")
SHIPPED = (*TRACES, "LICENSE-mooncake-traces.txt", "README.md")
DATA = "splitserve/workload/data/traces"


@pytest.fixture(scope="module")
def lone_copy(tmp_path_factory) -> Path:
    copy = copy_checkout(tmp_path_factory.mktemp("lone"))
    assert [p.name for p in copy.parent.iterdir()] == ["splitserve"]  # no siblings
    return copy


@pytest.mark.parametrize("name", ["conversation", "synthetic"])
def test_a_lone_copy_finds_the_traces_by_name(lone_copy, tmp_path, name):
    where = subprocess.run(
        [sys.executable, "-c", "import sys; from splitserve.workload.traces import resolve_trace; "
         "print(resolve_trace(sys.argv[1]))", name],
        env=env_for_checkout(lone_copy), cwd=tmp_path, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()) == lone_copy / "src" / DATA / f"mooncake_{name}_trace.jsonl"


def test_the_wheel_and_the_sdist_carry_the_traces(lone_copy, tmp_path):
    build = (
        "import sys, pathlib; from setuptools import build_meta as b; out = sys.argv[1]; "
        "pathlib.Path(out, 'names').write_text(b.build_wheel(out) + ' ' + b.build_sdist(out))"
    )
    done = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path)],
        cwd=lone_copy, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    wheel_name, sdist_name = (tmp_path / "names").read_text().split()
    with zipfile.ZipFile(tmp_path / wheel_name) as whl:
        sizes = {i.filename: i.file_size for i in whl.infolist()}
    with tarfile.open(tmp_path / sdist_name) as sdist:
        in_sdist = {m.name.partition("/")[2] for m in sdist.getmembers()}
    for name in SHIPPED:
        assert f"src/{DATA}/{name}" in in_sdist
        assert sizes[f"{DATA}/{name}"] == (lone_copy / "src" / DATA / name).stat().st_size
