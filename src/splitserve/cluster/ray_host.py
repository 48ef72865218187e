"""One splitserve process (a worker or a router replica) on a Ray node, owned by an actor.

The process is the same ``splitserve worker`` / ``splitserve router`` a local deployment
starts; the actor is what Ray schedules (by CPUs, GPUs, node label) and what ties the
process's life to the cluster's: the process runs in its own session, so stopping ends its
whole process group, and it gets SIGTERM when the actor's process dies (a killed actor or a
lost node leaves nothing behind).

Addresses are the node's own: ``{host}`` in the command line becomes the IP Ray knows the
node by, and every ``{name}`` of ``ports`` a port of that address (the one asked for, or a
free one). ``{files}`` becomes a private directory on the node (mode 0700, removed when the
process stops) holding the ``files`` the controller sent: its TLS certificate and key. A host
killed with its node cannot remove its directory; the next host to start on that node removes
every such directory whose host process is gone.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

from splitserve.cluster.local import die_with_parent, free_port

PREFIX = "splitserve-ray-tls-"  # a host's files directory, in the node's temporary directory
OWNER = "owner"  # in it: the pid of the host process that wrote it


class ProcessHost:
    """Starts, watches and stops one process on the node this actor landed on."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.files_dir: str | None = None

    def node(self) -> dict[str, str]:
        """Where this actor runs: ``{"node_id", "ip"}``."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
        }

    def start(
        self,
        argv: list[str],
        env: dict[str, str],
        ports: dict[str, int | None],
        files: dict[str, bytes] | None = None,
    ) -> dict[str, Any]:
        """Start ``argv`` with ``{host}``, each ``{port name}`` and ``{files}`` filled in;
        returns the node, the ports chosen and the pid."""
        where = self.node()
        chosen = {k: v or free_port(where["ip"]) for k, v in ports.items()}
        fill = {"{host}": where["ip"], **{f"{{{k}}}": str(v) for k, v in chosen.items()}}
        if files:
            from splitserve.cluster.tls import write_private

            remove_orphaned_files()
            self.files_dir = write_private({**files, OWNER: str(os.getpid()).encode()}, PREFIX)
            fill["{files}"] = self.files_dir
        filled = []
        for arg in argv:
            for key, value in fill.items():
                arg = arg.replace(key, value)
            filled.append(arg)
        self.proc = subprocess.Popen(
            filled,
            env={**os.environ, **env},
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        return {**where, "ports": chosen, "pid": self.proc.pid, "argv": filled}

    def poll(self) -> int | None:
        """The process's exit code, or None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the process group; SIGKILL it after ``timeout``; remove its files; the
        exit code."""
        try:
            return self._stop(timeout)
        finally:
            if self.files_dir is not None:
                shutil.rmtree(self.files_dir, ignore_errors=True)

    def _stop(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self._signal(signal.SIGKILL)  # the group may hold children even after the leader
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.proc.poll()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # its pgid is its pid: start_new_session
        except ProcessLookupError:
            pass


def remove_orphaned_files() -> None:
    """Remove the files directories of hosts whose process is gone (killed with their node
    or by ``ray.kill``); those of live hosts stay."""
    import psutil

    root = tempfile.gettempdir()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not name.startswith(PREFIX):
            continue
        try:
            with open(os.path.join(path, OWNER)) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            continue  # being written, or not ours
        if not psutil.pid_exists(pid):
            shutil.rmtree(path, ignore_errors=True)
