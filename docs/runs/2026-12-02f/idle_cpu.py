"""An idle ``splitserve serve --decode 4`` (one-thread workers, the validation runs' pool):
the CPU each process spends per second over 30 s with no request in flight
(docs/simulator.md, fourth sitting). Run from the repository root:

    .venv/bin/python docs/runs/2026-12-02f/idle_cpu.py
"""

from __future__ import annotations

import sys
import threading
import time

import psutil

from splitserve.cluster.local import LocalDeployment, WorkerProcess, free_port


def main() -> None:
    port = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "serve", "--port", str(port)]
    argv += ["--decode", "4", "--threads-per-worker", "1", "--kv-cache-gb", "0.06"]
    argv += ["--policy", "round-robin"]
    serve = WorkerProcess("serve", argv, f"http://127.0.0.1:{port}")
    group = LocalDeployment([serve])
    try:
        if not group.start(300.0, threading.Event()):
            raise RuntimeError("the deployment did not become healthy")
        time.sleep(5)  # past the start-up work
        assert serve.proc is not None
        children = psutil.Process(serve.proc.pid).children(recursive=True)
        before, start = cpu(children), time.monotonic()
        time.sleep(30)
        after, elapsed = cpu(children), time.monotonic() - start
        for pid, (name, seconds) in after.items():
            rate = 1000 * (seconds - before[pid][1]) / elapsed
            print(f"{name:<40} {rate:6.1f} ms CPU per s")
    finally:
        group.stop()


def cpu(procs: list[psutil.Process]) -> dict[int, tuple[str, float]]:
    """Each process's command (its subcommand and first flags) and CPU seconds so far."""
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = (" ".join(p.cmdline()[3:6]), t.user + t.system)
        except psutil.Error:
            pass
    return out


if __name__ == "__main__":
    main()
