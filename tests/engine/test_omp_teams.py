"""A worker's engine thread holds its process's only OpenMP team (engine/omp_teams.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from splitserve.engine.omp_teams import build_off_thread


def test_build_off_thread_runs_on_a_thread_that_has_ended():
    built_on = build_off_thread(threading.current_thread)
    assert built_on is not threading.current_thread()
    assert built_on.name == "engine-build"
    assert not built_on.is_alive()


def test_build_off_thread_raises_the_builders_error_on_the_caller():
    def fail():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        build_off_thread(fail)


# In a fresh process (this one's threads have teams already): an engine-like thread opens a
# two-thread team and stays; the KV mover then saves and loads blocks of a bfloat16 cache.
# OS threads that are not Python threads are OpenMP (and other native) helpers: the mover
# must add none, and every block must come back byte for byte.
_MOVER_RUN = textwrap.dedent(
    """
    import os, threading
    import torch
    from splitserve.engine.kv_mover import KVMover
    from splitserve.engine.tiering import BlockCopy
    from splitserve.kvstore import TieredStore
    from splitserve.kvstore.host import HostTier

    def native_threads():
        python = {t.native_id for t in threading.enumerate()}
        return len(set(map(int, os.listdir("/proc/self/task"))) - python)

    torch.set_num_threads(2)
    cache = torch.randn(4, 2, 32, 16, 3, 64).to(torch.bfloat16)
    opened, done = threading.Event(), threading.Event()

    def engine_like():
        torch.randn(2048, 2048) @ torch.randn(2048, 2048)  # opens this thread's team
        opened.set()
        done.wait(120)

    engine = threading.Thread(target=engine_like, daemon=True)
    engine.start()
    opened.wait(120)
    before = native_threads()
    store = TieredStore([HostTier(64 * 2**20)], write_through=False)
    mover = KVMover(cache, store, ["host"])
    hashes = [i.to_bytes(8, "big") for i in range(16)]
    original = cache[:, :, :16].clone()
    mover.submit([BlockCopy(1, "save", list(range(16)), hashes)])
    assert mover.drain(60)
    cache[:, :, 16:].zero_()
    mover.submit([BlockCopy(2, "load", list(range(16, 32)), hashes)])
    assert mover.drain(60)
    loaded = [c.num_ok for c in mover.completed()]
    assert loaded == [16, 16], loaded
    assert torch.equal(cache[:, :, 16:], original)
    after = native_threads()
    done.set()
    engine.join()
    mover.close()
    print("native threads", before, after)
    assert after == before, (before, after)
    """
)


def test_kv_mover_copies_without_a_team_of_its_own():
    run = subprocess.run(
        [sys.executable, "-c", _MOVER_RUN], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
