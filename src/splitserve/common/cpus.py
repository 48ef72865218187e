"""The cores a worker runs on: ``--cpus`` ("0", "0-1,4")."""

from __future__ import annotations

import os


def parse_cpus(text: str) -> list[int]:
    """``"0,2-3"`` -> ``[0, 2, 3]``; a clear ``ValueError`` for anything else."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise ValueError(f"--cpus takes core ids like '0' or '0-1,4', got {text!r}") from None
    if not cpus or min(cpus) < 0:
        raise ValueError(f"--cpus takes core ids like '0' or '0-1,4', got {text!r}")
    return cpus


def bind_to(cpus: list[int]) -> None:
    """Keep this process on ``cpus``: every thread it has, and (they inherit it) every thread
    started from now on. Call it before the engine starts."""
    allowed = sorted(os.sched_getaffinity(0))
    missing = sorted(set(cpus) - set(allowed))
    if missing:
        raise ValueError(
            f"--cpus: core(s) {', '.join(map(str, missing))} are not available here "
            f"(this process may run on {', '.join(map(str, allowed))})"
        )
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
