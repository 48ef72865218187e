"""Failed requests while a worker, a node and a router replica die under agentic load (issue
goal: 0).

A Ray cluster on this machine (tests/ray_nodes.py: a head at 127.0.0.2 and a worker node at
127.0.0.3, each a ``ray start --block`` process group); ``serve --ray`` with decode workers on
both nodes and two router replicas; ``splitserve bench``'s agentic sessions (``run_load``)
through router replica 0 for ``--duration`` seconds. A quarter of the way in, a decode worker
on the head is SIGKILLed; halfway, the whole worker node; at three quarters, router replica 1.
Prints the requests completed and failed, and whether each casualty came back.

    .venv/bin/python benchmarks/ray_failover.py [--duration 160] [--rate 0.3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from ray_autoscale import stop  # noqa: E402
from ray_nodes import RayCluster  # noqa: E402
from ray_scale_up import SPLITSERVE, status  # noqa: E402
from router_peer import cpu_description  # noqa: E402

from splitserve.bench.client import Endpoint  # noqa: E402
from splitserve.bench.load import run_load  # noqa: E402
from splitserve.cluster.local import die_with_parent  # noqa: E402
from splitserve.workload.metrics import SLO  # noqa: E402
from splitserve.workload.runs import Load  # noqa: E402
from splitserve.workload.sessions import AgenticConfig, LogNormal  # noqa: E402

HEAD, NODE_B = "127.0.0.2", "127.0.0.3"


def serve(address: str, decode: int) -> tuple[subprocess.Popen, list[str]]:
    argv = [*SPLITSERVE, "serve", "--ray", address, "--port", "0", "--routers", "2"]
    argv += ["--decode", str(decode), "--threads-per-worker", "1", "--kv-cache-gb", "0.25"]
    argv += ["--host-kv-gb", "0.25", "--ready-timeout", "400"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=die_with_parent)  # fmt: skip
    routers: list[str] = []
    for line in proc.stdout:
        if "serving the OpenAI API at" in line:
            routers.append(line.split(" at ")[1].split("/v1")[0])
            if len(routers) == 2:
                return proc, routers
    raise RuntimeError("serve --ray exited before serving")


class Killer(threading.Thread):
    """Kills a decode worker, then node B, then router replica 1, at fractions of the run, and
    records for each whether its slot was ready again before the run ended."""

    def __init__(self, cluster: RayCluster, routers: list[str], duration: float) -> None:
        super().__init__(daemon=True)
        self.cluster, self.routers, self.duration = cluster, routers, duration
        self.events: list[str] = []
        self.victims: list[tuple[str, str, int]] = []  # (what, slot name, restarts before)

    def procs(self) -> list[dict]:
        data = status(self.cluster.address)
        return [*data["workers"], *data["routers"]]

    def run(self) -> None:
        start = time.monotonic()
        for fraction, what in ((0.25, "worker"), (0.5, "node"), (0.75, "router")):
            time.sleep(max(0.0, start + fraction * self.duration - time.monotonic()))
            procs = self.procs()
            if what == "worker":
                victim = next(p for p in procs if p["role"] == "decode" and p["node_ip"] == HEAD)
                os.kill(victim["pid"], signal.SIGKILL)
                self.victims.append((what, victim["name"], victim["restarts"]))
            elif what == "node":
                on_b = [p for p in procs if p["node_ip"] == NODE_B]
                self.cluster.nodes[1].kill()
                self.victims += [("node", p["name"], p["restarts"]) for p in on_b]
            else:
                victim = next(p for p in procs if p["url"] == self.routers[1])
                os.kill(victim["pid"], signal.SIGKILL)
                self.victims.append((what, victim["name"], victim["restarts"]))
            self.events.append(f"{time.monotonic() - start:6.1f} s: killed the {what}")

    def healed(self) -> list[str]:
        now = {p["name"]: p for p in self.procs()}
        lines = []
        for what, name, restarts in self.victims:
            p = now.get(name)
            back = p is not None and p["state"] == "ready" and p["restarts"] > restarts
            where = f" on {p['node_ip']}" if p is not None else ""
            lines.append(f"{what} casualty {name}: {'back' + where if back else 'NOT back'}")
        return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=160.0, help="seconds of arrivals")
    p.add_argument("--rate", type=float, default=0.3, help="sessions/s")
    p.add_argument("--decode", type=int, default=3, help="decode workers over the two nodes")
    p.add_argument("--slo", default="ttft:3000,tpot:250")
    args = p.parse_args()
    workload = AgenticConfig(
        tool_result_tokens=LogNormal(48, 0.3), min_tool_calls=2, max_tool_calls=4
    )
    print(f"CPU: {cpu_description()}; {workload.describe()}; {args.rate:g} sessions/s")
    cluster = RayCluster([(4, "a"), (2, "b")])
    launcher = None
    try:
        cluster.start()
        launcher, routers = serve(cluster.address, args.decode)
        placed = [(w["name"], w["node_ip"]) for w in status(cluster.address)["workers"]]
        print(f"routers {routers}; workers {placed}", flush=True)
        killer = Killer(cluster, routers, args.duration)
        killer.start()
        result = asyncio.run(
            run_load(
                Endpoint(routers[0]),
                workload,
                Load(rate=args.rate, duration_s=args.duration),
                SLO.parse(args.slo),
                progress=False,
            )
        )
        killer.join(30)
        for event in killer.events:
            print(event)
        time.sleep(20)  # a replaced process may still be starting
        for line in killer.healed():
            print(line)
        s = result.summary
        print(f"requests completed {s.completed}, failed {s.failed} (goal 0); sessions in SLO "
              f"{100 * s.session_attainment:.1f}%")  # fmt: skip
        return 0 if s.failed == 0 else 1
    finally:
        if launcher is not None:
            stop(launcher)
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
