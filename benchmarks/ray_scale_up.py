"""How long `splitserve cluster scale` takes to put a new decode worker into service on a
Ray cluster (issue goal: at most 30 s on this machine once the model cache is warm).

Starts a one-node Ray cluster of its own (`ray start --head --block`, at 127.0.0.2), serves
`--decode 1` on it with `serve --ray`, then `--rounds` times: scales decode to 2, and times
from the `scale` command until a request routed by the router is answered by the new
worker (sessions are tried in turn until the ring places one there), then scales back to 1
and waits until the removed worker is gone.

    .venv/bin/python benchmarks/ray_scale_up.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from router_peer import cpu_description  # noqa: E402

from splitserve.cluster.local import die_with_parent, free_port  # noqa: E402

SPLITSERVE = [sys.executable, "-m", "splitserve.cli"]


def status(address: str, name: str = "splitserve") -> dict:
    out = subprocess.run(
        [*SPLITSERVE, "cluster", "status", "--json", "--ray", address, "--ray-name", name],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return json.JSONDecoder().raw_decode(out.stdout)[0]


def decode_urls(address: str) -> set[str]:
    return {w["url"] for w in status(address)["workers"] if w["state"] == "ready"}


def first_answer_from(router: str, url: str, timeout: float = 300.0) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    deadline, i = time.monotonic() + timeout, 0
    with httpx.Client(timeout=60) as http:
        while time.monotonic() < deadline:
            i += 1
            r = http.post(
                f"{router}/v1/chat/completions", json=body, headers={"x-session-id": f"s{i}"}
            )
            if r.status_code == 200 and r.headers.get("x-splitserve-decode-worker") == url:
                return
    raise TimeoutError(f"{url} answered nothing in {timeout:.0f}s")


def wait_for_port(address: str, timeout: float = 120.0) -> None:
    host, port = address.split(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"no Ray head at {address} after {timeout:.0f}s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="ssray-", dir="/tmp")
    address = f"127.0.0.2:{free_port('127.0.0.2')}"
    ray = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--block", "--head"]
    ray += ["--node-ip-address", "127.0.0.2", "--port", address.split(":")[1], "--num-cpus", "4"]
    ray += ["--include-dashboard=false", "--disable-usage-stats", "--temp-dir", tmp]
    procs = [subprocess.Popen(ray, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True, preexec_fn=die_with_parent)]  # fmt: skip
    try:
        wait_for_port(address)
        serve = [*SPLITSERVE, "serve", "--ray", address, "--decode", "1", "--port", "0"]
        serve += ["--threads-per-worker", "1", "--kv-cache-gb", "0.25"]
        launcher = subprocess.Popen(serve, stdout=subprocess.PIPE, text=True,
                                    start_new_session=True, preexec_fn=die_with_parent)  # fmt: skip
        procs.append(launcher)
        router = next(
            line.split(" at ")[1].split("/v1")[0]
            for line in launcher.stdout
            if "serving the OpenAI API at" in line
        )
        print(f"CPU: {cpu_description()}; load average {os.getloadavg()[0]:.1f}")
        times = []
        for _ in range(args.rounds):
            before = decode_urls(address)
            t0 = time.monotonic()
            subprocess.run([*SPLITSERVE, "cluster", "scale", "--decode", "2", "--ray", address],
                           capture_output=True, check=True, timeout=120)  # fmt: skip
            while len(new := decode_urls(address) - before) != 1:
                time.sleep(0.2)
            first_answer_from(router, new.pop())
            times.append(time.monotonic() - t0)
            print(f"scale-up to first request: {times[-1]:.1f} s", flush=True)
            subprocess.run([*SPLITSERVE, "cluster", "scale", "--decode", "1", "--ray", address],
                           capture_output=True, check=True, timeout=120)  # fmt: skip
            while len(status(address)["workers"]) != 1:
                time.sleep(0.5)
        print(f"median {statistics.median(times):.1f} s, max {max(times):.1f} s (goal <= 30 s)")
        return 0
    finally:
        for proc in reversed(procs):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        subprocess.run(f"pkill -9 -s {procs[0].pid}", shell=True)  # the head's raylet, actors
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
