"""A real Ray cluster on this machine for tests: a head and worker nodes, each a
``ray start --block`` process group on its own loopback address (127.0.0.2, 127.0.0.3, ...),
so that which node a process runs on shows in its URL. Killing a node's group is losing that
node."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil
from procs import die_with_parent, free_port

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
# A lost node is declared dead in ~3 s instead of Ray's default ~30 s. Ray's memory monitor
# is off: the machine is shared with other tests, and Ray would kill actors (the controller
# among them) on the others' account.
RAY_ENV = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_memory_monitor_refresh_ms": "0",
}


class RayNode:
    """One ``ray start --block`` process group."""

    def __init__(self, argv: list[str], log_path: str) -> None:
        self.argv = argv
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                env={**os.environ, **RAY_ENV},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def kill(self) -> None:
        """Lose the node: SIGKILL every process of its session (its raylet, its actors; the
        processes those started die with them)."""
        if self.proc is None:
            return
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == self.proc.pid:
                    p.kill()
            except (ProcessLookupError, PermissionError, psutil.Error):
                pass
        self.proc.wait(30)


class RayCluster:
    """A head at 127.0.0.2 and ``len(workers)`` nodes at 127.0.0.3 onwards; each entry of
    ``nodes`` is (CPUs, label ``pool=`` value)."""

    def __init__(self, nodes: list[tuple[int, str]]) -> None:
        self.dir = tempfile.mkdtemp(prefix="ssray-", dir="/tmp")  # Ray's socket paths are short
        self.port = free_port("127.0.0.2")
        self.address = f"127.0.0.2:{self.port}"
        self.nodes: list[RayNode] = []
        for i, (cpus, pool) in enumerate(nodes):
            ip = f"127.0.0.{2 + i}"
            argv = [RAY, "start", "--block", "--node-ip-address", ip, "--num-cpus", str(cpus)]
            argv += ["--labels", f"pool={pool}", "--disable-usage-stats"]
            if i == 0:
                argv += ["--head", "--port", str(self.port), "--include-dashboard=false"]
                argv += ["--temp-dir", self.dir]
            else:
                argv += ["--address", self.address]
            self.nodes.append(RayNode(argv, os.path.join(self.dir, f"node-{i}.log")))

    def start(self, timeout: float = 120.0) -> None:
        self.nodes[0].start()
        self.wait_alive(1, timeout)
        for node in self.nodes[1:]:
            node.start()
        self.wait_alive(len(self.nodes), timeout)

    def alive(self) -> list[str]:
        """The IPs of the nodes Ray counts as alive."""
        code = (
            f"import json, ray; ray.init(address={self.address!r}, log_to_driver=False); "
            "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        ).stdout
        return json.loads(out.strip().splitlines()[-1]) if out.strip() else []

    def wait_alive(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.nodes[0].proc.poll() is not None:
                raise RuntimeError(f"the Ray head exited; see {self.nodes[0].log_path}")
            try:
                if len(self.alive()) == count:
                    return
            except (subprocess.TimeoutExpired, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{count} Ray nodes were not alive after {timeout:.0f}s")

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
