"""One OpenMP thread team per worker process: the engine thread's.

torch on CPU runs its parallel regions on libgomp, which gives every thread that opens a
region its own team of helper threads, kept for that thread's life. Once a process's teams
hold more threads than there are cores, libgomp stops letting idle helpers spin between
regions: they sleep, and each of a decode step's hundreds of small regions then waits for
them to wake ([engine.md](../../../docs/engine.md#threads) has the cost).

So the engine thread is the only thread of a worker that opens regions: the engine is built
on a thread that exits, taking its team with it (``build_off_thread``), and the threads that
copy KV blocks while the engine steps copy with numpy (``kv_pages.PagedBytes``), which opens
none. (torch's thread count is process-wide here, so it cannot keep another thread's torch
operations off a team.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def build_off_thread(build: Callable[[], T]) -> T:
    """``build()`` on a short-lived thread: the OpenMP team it opens ends with the thread."""
    box: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            box.append(build())
        except BaseException as e:  # re-raised on the caller's thread
            errors.append(e)

    thread = threading.Thread(target=run, name="engine-build")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return box[0]
