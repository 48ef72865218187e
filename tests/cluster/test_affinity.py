"""``cluster.affinity``: threads pinned away from a worker's cores are bound back; threads on
the worker's cores or on what their process started with are left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from procs import die_with_parent

from splitserve.cluster.affinity import rebind_strays, thread_ids

# A parent whose child runs a thread that pins itself to the last core, as NIXL does, and a
# thread that keeps what it inherited; it prints its child's pid once the pin is done.
SCRIPT = """
import os, subprocess, sys, threading, time
if sys.argv[1] == "child":
    def pinned():
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
        time.sleep(60)
    threading.Thread(target=pinned, daemon=True).start()
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    time.sleep(0.2)
    print("ready", flush=True)
    time.sleep(60)
else:
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "child", sys.argv[2]],
                             stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    print(child.pid, flush=True)
    child.wait()
"""


def _allowed(tid: int) -> str:
    with open(f"/proc/{tid}/status") as f:
        return next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_thread_pinned_to_another_core_is_bound_back_and_the_rest_left_alone():
    inherited = os.sched_getaffinity(0)
    cores = {min(inherited)}
    parent = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, "parent", SCRIPT],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    try:
        child = int(parent.stdout.readline())
        tids = thread_ids(parent.pid)
        assert child in tids and len(tids) >= 4  # the parent's and the child's threads
        before = {tid: os.sched_getaffinity(tid) for tid in tids}
        strays = [tid for tid, allowed in before.items() if allowed == {max(inherited)}]
        assert len(strays) == 1
        assert rebind_strays(parent.pid, cores, inherited) == strays
        assert _allowed(strays[0]) == str(min(cores))
        assert all(os.sched_getaffinity(t) == before[t] for t in tids if t not in strays)
        assert rebind_strays(parent.pid, cores, inherited) == []  # nothing left to move
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the child too
        parent.wait()
    assert thread_ids(parent.pid) == []  # gone: no threads, no error
