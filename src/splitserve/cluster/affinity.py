"""Threads' CPU affinity across a process tree: bind back the threads someone pinned away.

vLLM's NIXL worker keeps a core for KV transfers by pinning the thread that creates it, the
engine's compute thread, to the last core of each NUMA node (``nixl/base_worker.py``). On a
machine split into one core per worker that is another worker's core. The fix runs once the
worker is ready: every thread whose affinity is neither what its process started with (the
API server's and engine loop's threads, which vLLM leaves unbound) nor the worker's cores
(its OpenMP threads) was moved by someone else, and is bound to the worker's cores.
"""

from __future__ import annotations

import os

import psutil


def rebind_strays(pid: int, cores: set[int], inherited: set[int]) -> list[int]:
    """Bind to ``cores`` every thread of ``pid`` and its descendants whose affinity is
    neither ``cores`` nor ``inherited``; the ids of the threads bound."""
    moved = []
    for tid in thread_ids(pid):
        try:
            if os.sched_getaffinity(tid) not in (cores, inherited):
                os.sched_setaffinity(tid, cores)
                moved.append(tid)
        except (ProcessLookupError, PermissionError):  # the thread ended meanwhile
            continue
    return moved


def thread_ids(pid: int) -> list[int]:
    """The threads of ``pid`` and of all its descendants (none once it is gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    tids = []
    for proc in procs:
        try:
            tids += [t.id for t in proc.threads()]
        except psutil.NoSuchProcess:
            continue
    return tids
