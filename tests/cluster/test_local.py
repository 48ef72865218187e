"""``splitserve serve`` and its process launcher: start, answer, stop, leave no process behind."""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from procs import free_port, stop_group

from splitserve.cluster.local import (
    LocalDeployment,
    StopFlag,
    WorkerProcess,
    die_with_parent,
    own_disk_dir,
    worker_argv,
)
from splitserve.common.listen import STARTUP_FAILED

# A stand-in worker that starts a child of its own and, optionally, ignores SIGTERM.
_PARENT = """
import signal, subprocess, sys, time
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
time.sleep(300)
"""


def _descendants_when(proc: subprocess.Popen, count: int, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = psutil.Process(proc.pid).children(recursive=True)
        if len(children) >= count:
            return children
        time.sleep(0.05)
    raise AssertionError(f"expected {count} children of {proc.pid}")


def test_stop_ends_each_worker_and_its_children():
    workers = [
        WorkerProcess(mode, [sys.executable, "-c", _PARENT, mode], "http://unused")
        for mode in ("polite", "stubborn")
    ]
    deployment = LocalDeployment(workers)
    for w in workers:
        w.start()
    procs = [psutil.Process(w.proc.pid) for w in workers]
    procs += [c for w in workers for c in _descendants_when(w.proc, 1)]
    deployment.stop(timeout=2.0)
    gone, alive = psutil.wait_procs(procs, timeout=5)
    assert not alive


# A launcher that starts a long-lived child the way the launcher and the tests start workers.
_LAUNCHER = """
import subprocess, sys, time
from splitserve.cluster.local import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                         preexec_fn=die_with_parent)
print(child.pid, flush=True)
time.sleep(300)
"""


def _ended(proc: psutil.Process, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:  # ended; its new parent may never reap it
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_worker_ends_when_its_launcher_is_killed():
    """SIGKILL gives a launcher (or a test) no chance to stop its workers: they must end by
    themselves rather than hold their ports and cores."""
    argv = [sys.executable, "-c", _LAUNCHER]
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = psutil.Process(int(launcher.stdout.readline()))
        assert child.is_running() and not _ended(child, timeout=0.2)
        launcher.kill()
        launcher.wait(10)
        assert _ended(child)
    finally:
        stop_group(launcher)  # the child too, if it outlived its launcher


def _read_lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)


def test_serve_starts_answers_and_exits_cleanly_on_sigterm():
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "splitserve.cli",
        "serve",
        "--port",
        str(port),
        "--max-model-len",
        "256",
        "--ready-timeout",
        "180",
    ]
    launcher = subprocess.Popen(
        argv, stdout=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=die_with_parent
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(launcher.stdout, lines), daemon=True).start()
    try:
        line = lines.get(timeout=180)
        url = f"http://127.0.0.1:{port}"
        assert f"{url}/v1" in line
        r = httpx.post(
            f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
        family = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(True)]
        assert len(family) >= 2  # the launcher and its worker
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, f"orphans left behind: {alive}"
        assert not _port_open(port)
    finally:
        stop_group(launcher)


def _port_open(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
        return True
    except httpx.HTTPError:
        return False


def test_each_pool_worker_gets_its_own_disk_tier_directory():
    args = ["--host-kv-gb", "1", "--disk-kv-dir", "/data/kv", "--threads", "1"]
    assert own_disk_dir(args, "decode-1") == [
        "--host-kv-gb", "1", "--disk-kv-dir", "/data/kv/decode-1", "--threads", "1"
    ]  # fmt: skip
    assert own_disk_dir(["--threads", "1"], "decode-0") == ["--threads", "1"]


def test_regression_a_signal_inside_the_stop_wait_cannot_deadlock_serve():
    # ``serve`` hung on SIGINT then SIGTERM: its handler called threading.Event.set, whose
    # lock the interrupted main thread held inside Event.wait. Signals every 100 us land in
    # every part of the wait; with threading.Event this loop deadlocks (or overflows).
    stop = StopFlag()
    previous = signal.signal(signal.SIGALRM, lambda *_: stop.set())
    signal.setitimer(signal.ITIMER_REAL, 0.0001, 0.0001)
    try:
        for _ in range(100_000):
            stop.wait(0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert stop.is_set()


def test_serve_kv_encrypt_reaches_every_pool_worker():
    from splitserve.cluster.serve import Topology

    plain = Topology(prefill=1, decode=2, kv_peer=True)
    sealed = Topology(prefill=1, decode=2, kv_peer=True, kv_encrypt=True)
    assert "--kv-encrypt" not in plain.role_args("prefill") + plain.role_args("decode")
    assert "--kv-encrypt" in sealed.role_args("prefill")
    assert "--kv-encrypt" in sealed.role_args("decode")
    assert "--kv-encrypt" in Topology(decode=1, kv_encrypt=True).role_args("decode")
    with pytest.raises(ValueError, match="needs pools"):
        Topology(kv_encrypt=True)


def _held_port() -> socket.socket:
    """A port of 127.0.0.1 held by a listening socket, as another process would hold it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def _worker_on(port: int, movable: bool) -> WorkerProcess:
    argv = worker_argv("127.0.0.1", port, None, ["--threads", "1", "--log-level", "warning"])
    return WorkerProcess("decode-0", argv, f"http://127.0.0.1:{port}", movable=movable)


def test_a_movable_worker_whose_port_was_taken_starts_on_another():
    with _held_port() as held:
        taken = held.getsockname()[1]
        worker = _worker_on(taken, movable=True)
        deployment = LocalDeployment([worker])
        try:
            assert deployment.start(ready_timeout=180, stop=StopFlag())
            moved = int(worker.argv[worker.argv.index("--port") + 1])
            assert moved != taken and worker.url == f"http://127.0.0.1:{moved}"
            assert httpx.get(f"{worker.url}/health", timeout=5).status_code == 200
        finally:
            deployment.stop()


def test_a_worker_on_a_port_it_was_given_fails_when_the_port_is_taken():
    with _held_port() as held:
        taken = held.getsockname()[1]
        worker = _worker_on(taken, movable=False)
        deployment = LocalDeployment([worker])
        try:
            start = time.monotonic()
            assert not deployment.start(ready_timeout=180, stop=StopFlag())
            assert time.monotonic() - start < 60  # at its bind, not after loading the model
            assert worker.exited() == STARTUP_FAILED
            assert worker.url == f"http://127.0.0.1:{taken}"
        finally:
            deployment.stop()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_move_points_the_port_and_the_url_at_a_new_free_port(host):
    if ":" in host and not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    netloc = f"[{host}]" if ":" in host else host
    worker = WorkerProcess("decode-0", ["splitserve", "--port", "1", "--x"], f"https://{netloc}:1")
    try:
        port = worker.move()
    except OSError as e:  # an IPv6 stack without a loopback address
        pytest.skip(f"cannot bind {host}: {e}")
    assert worker.argv == ["splitserve", "--port", str(port), "--x"]
    assert worker.url == f"https://{netloc}:{port}" and port != 1
