"""A killed process group's multiprocessing shared memory is removed after it (``group_shm``),
as ``VllmProcess`` does for vLLM: a real group of processes that make and map segments, killed
with SIGKILL so that none of them unlinks anything."""

from __future__ import annotations

import os
import signal
import sys
import time
from multiprocessing import shared_memory

import pytest

from splitserve.cluster import group_shm
from splitserve.cluster.vllm_worker import VllmProcess

# A parent that makes a segment and a child that maps it (as vLLM's API server and engine core
# share message queues), then both wait to be killed. The parent prints the segment's name.
GROUP = """
import multiprocessing as mp, sys, time
from multiprocessing import shared_memory

def child(name):
    seg = shared_memory.SharedMemory(name=name)
    time.sleep(600)

if __name__ == "__main__":
    seg = shared_memory.SharedMemory(create=True, size=1 << 20)
    mp.get_context("fork").Process(target=child, args=(seg.name,)).start()
    print(seg.name, flush=True)
    time.sleep(600)
"""


def _segment(name: str) -> str:
    return os.path.join(group_shm.SHM_DIR, name)


def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def group(tmp_path):
    out = tmp_path / "name"
    proc = VllmProcess(
        ["sh", "-c", f'exec {sys.executable} -c "$0" > {out}', GROUP], dict(os.environ)
    )
    proc.start()
    _wait(lambda: out.exists() and out.read_text().strip())
    name = out.read_text().strip()
    _wait(lambda: len(group_shm.group_pids(proc.proc.pid)) >= 2)
    yield proc, name
    proc.stop(timeout=5)
    try:
        os.unlink(_segment(name))
    except FileNotFoundError:
        pass


def test_a_killed_groups_segments_are_removed_after_it_and_no_others(group):
    proc, name = group
    other = shared_memory.SharedMemory(create=True, size=4096)  # this process's own: kept
    try:
        proc.note_shm()
        assert _segment(name) in proc.shm and _segment(other.name) not in proc.shm
        os.killpg(proc.proc.pid, signal.SIGKILL)  # as a crash or an outside kill would
        proc.proc.wait()
        assert os.path.exists(_segment(name))  # nothing in the group unlinked it
        proc.stop(timeout=5)
        assert not os.path.exists(_segment(name))
        assert os.path.exists(_segment(other.name))
        assert group_shm.group_pids(proc.proc.pid) == []
    finally:
        other.close()
        other.unlink()


def test_nothing_is_removed_while_the_group_lives(group):
    proc, name = group
    paths = group_shm.mapped(proc.proc.pid)
    assert _segment(name) in paths
    assert group_shm.remove(paths, proc.proc.pid, timeout=0.2) == []
    assert os.path.exists(_segment(name))
