"""Shared-memory files a killed process group leaves behind.

Python's multiprocessing makes POSIX shared memory (``psm_*``) and semaphores (``sem.mp-*``)
under /dev/shm and unlinks them when its processes shut down; vLLM's message queues and caches
are among them (hundreds of MB). A group ended by SIGKILL never unlinks them, and they hold RAM
until the machine restarts. ``mapped(pgid)`` lists such files the group's processes have mapped;
once the group is gone, ``remove`` unlinks them. Files of other names, or still mapped by a live
process of the group, are left alone, and so is a semaphore no process maps (32 bytes; vLLM
leaves one).
"""

from __future__ import annotations

import os
import time

SHM_DIR = "/dev/shm"
PREFIXES = ("psm_", "sem.mp-")  # multiprocessing's default names


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) == pgid:
                pids.append(int(entry))
        except OSError:  # gone meanwhile
            continue
    return pids


def mapped(pgid: int) -> set[str]:
    """The multiprocessing shared-memory files (``PREFIXES``) the group's processes map."""
    paths = set()
    for pid in group_pids(pgid):
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.readlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) < 6:
                continue
            path = fields[5].strip()
            if path.endswith(" (deleted)"):
                continue
            head, name = os.path.split(path)
            if head == SHM_DIR and name.startswith(PREFIXES):
                paths.add(path)
    return paths


def remove(paths: set[str], pgid: int, timeout: float = 5.0) -> list[str]:
    """Unlink ``paths`` once group ``pgid`` has no process left (waiting up to ``timeout``
    seconds for its killed processes to go); returns those removed. Nothing is removed while
    the group lives."""
    deadline = time.monotonic() + timeout
    while group_pids(pgid):
        if time.monotonic() > deadline:
            return []
        time.sleep(0.05)
    removed = []
    for path in sorted(paths):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:  # unlinked by its owner on a clean exit
            continue
    return removed
