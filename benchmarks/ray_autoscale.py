"""Autoscaling against fixed splits: agentic sessions whose prompts grow long halfway through,
played at one rate against each fixed prefill:decode split of N workers and against an
autoscaled deployment started at a given split; session SLO attainment of each, and the
autoscaled one's distance from the best fixed split (issue goal: within 5 points).

One Ray head of its own at 127.0.0.2 (`ray start --block`); each deployment is
`serve --ray` on it, started and stopped in turn. The workload: `AgenticConfig` sessions,
tool results of ~48 tokens before the shift and ~`--long-tokens` after it.

    .venv/bin/python benchmarks/ray_autoscale.py --workers 2 --rate 0.1 --duration 300
        [--calibration cal.json]   # `splitserve sim calibrate --out cal.json`
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(__file__))
from ray_scale_up import SPLITSERVE, status, wait_for_port  # noqa: E402
from router_peer import cpu_description  # noqa: E402

from splitserve.bench.client import Endpoint  # noqa: E402
from splitserve.bench.load import run_load  # noqa: E402
from splitserve.cluster.local import die_with_parent, free_port  # noqa: E402
from splitserve.workload.metrics import SLO  # noqa: E402
from splitserve.workload.runs import Load  # noqa: E402
from splitserve.workload.sessions import AgenticConfig, LogNormal, SessionSpec  # noqa: E402


@dataclass(frozen=True, slots=True)
class Shifted:
    """``first``'s sessions until ``shift_s``, ``second``'s after (same rate)."""

    first: AgenticConfig
    second: AgenticConfig
    shift_s: float
    seed: int = 0
    name: str = "agentic-shifted"

    def sessions(self, rate: float | None) -> Iterator[SessionSpec]:
        for s in self.first.sessions(rate):
            if s.arrival_s >= self.shift_s:
                break
            yield s
        for s in self.second.sessions(rate):
            yield dataclasses.replace(s, session_id=f"late-{s.session_id}").at(
                s.arrival_s + self.shift_s
            )

    def describe(self) -> str:
        return f"{self.first.describe()}; after {self.shift_s:g} s: {self.second.describe()}"


def serve(
    address: str, name: str, split: tuple[int, int], extra: list[str]
) -> tuple[subprocess.Popen, str]:
    argv = [*SPLITSERVE, "serve", "--ray", address, "--ray-name", name, "--port", "0"]
    argv += ["--threads-per-worker", "1"]
    argv += ["--prefill", str(split[0]), "--decode", str(split[1]), "--kv-cache-gb", "0.5"]
    argv += ["--host-kv-gb", "1", "--remote-prefill-threshold", "64", *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=die_with_parent)  # fmt: skip
    for line in proc.stdout:
        if "serving the OpenAI API at" in line:
            return proc, line.split(" at ")[1].split("/v1")[0]
    raise RuntimeError("serve --ray exited before serving")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--start", default="1:1", help="the autoscaled deployment's first split")
    p.add_argument("--rate", type=float, default=0.1, help="sessions/s")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals")
    p.add_argument("--long-tokens", type=int, default=512)
    p.add_argument("--slo", default="ttft:3000,tpot:250")
    p.add_argument("--interval", type=float, default=20.0, help="--autoscale-interval")
    p.add_argument("--patience", type=int, default=2, help="--autoscale-patience")
    p.add_argument("--calibration", default=None, help="a `sim calibrate` file for the planner")
    p.add_argument(
        "--dtype",
        default=None,
        help="the workers' --dtype (default: serve's, as sim calibrate times)",
    )
    args = p.parse_args()
    slo = SLO.parse(args.slo)
    short = AgenticConfig(tool_result_tokens=LogNormal(48, 0.3), min_tool_calls=2, max_tool_calls=3)
    long = dataclasses.replace(short, tool_result_tokens=LogNormal(args.long_tokens, 0.3), seed=1)
    workload = Shifted(short, long, args.duration / 2)
    address = f"127.0.0.2:{free_port('127.0.0.2')}"
    ray = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--block", "--head"]
    ray += ["--node-ip-address", "127.0.0.2", "--port", address.split(":")[1]]
    ray += ["--num-cpus", str(2 * args.workers), "--include-dashboard=false"]
    head = subprocess.Popen([*ray, "--disable-usage-stats"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    runs = [
        (f"fixed {p}:{args.workers - p}", (p, args.workers - p), []) for p in range(args.workers)
    ]
    if args.dtype is not None:
        runs = [(name, split, ["--dtype", args.dtype, *extra]) for name, split, extra in runs]
    first = tuple(int(x) for x in args.start.split(":"))
    scale = ["--autoscale", "--autoscale-slo", args.slo, "--autoscale-interval", str(args.interval)]
    scale += ["--autoscale-host-cores", str(os.cpu_count()), "--autoscale-patience"]
    scale += [str(args.patience)]
    if args.calibration is not None:
        scale += ["--autoscale-calibration", args.calibration]
    dtype = [] if args.dtype is None else ["--dtype", args.dtype]
    runs.append((f"autoscaled from {args.start}", first, [*dtype, *scale]))
    print(f"CPU: {cpu_description()}; {workload.describe()}; {args.rate:g} sessions/s")
    results = {}
    try:
        wait_for_port(address)
        for i, (name, split, extra) in enumerate(runs):
            proc, url = serve(address, f"run-{i}", split, extra)
            try:
                result = asyncio.run(
                    run_load(
                        Endpoint(url),
                        workload,
                        Load(rate=args.rate, duration_s=args.duration),
                        slo,
                        progress=False,
                    )  # fmt: skip
                )
                final = status(address, f"run-{i}")
                decisions = [d["reason"] for d in final["decisions"] if d["action"] == "scale"]
            finally:
                stop(proc)
            s = result.summary
            results[name] = s.session_attainment
            print(f"{name:<24} sessions in SLO {100 * s.session_attainment:5.1f}%  requests "
                  f"{100 * s.slo_attainment:5.1f}%  completed {s.completed} failed {s.failed}",
                  flush=True)  # fmt: skip
            for reason in decisions:
                print(f"    scaled: {reason}")
        best = max(v for k, v in results.items() if k.startswith("fixed"))
        auto = results[runs[-1][0]]
        print(f"autoscaled - best fixed: {100 * (auto - best):+.1f} points (goal >= -5)")
        return 0
    finally:
        stop(head)
        subprocess.run(f"pkill -9 -s {head.pid}", shell=True)


if __name__ == "__main__":
    sys.exit(main())
