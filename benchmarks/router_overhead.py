"""What the router costs, and what session stickiness buys, measured in the same run.

1. Overhead: ``--clients`` concurrent streaming clients, each sending requests back to back,
   straight to one worker and then through the router in front of that same worker
   (alternating ``--rounds`` times to cancel drift). Reports end-to-end latency p50/p99 of
   both, the router's added latency at each percentile (goal: p99 at most 5 ms) and the
   throughput ratio. By default the worker is the echo worker of the router tests (canned SSE
   chunks, no model), which isolates the router; ``--worker-url`` measures a real worker.
2. Stickiness (``--ttft``): growing sessions of ``--turns`` turns over ``--real-workers``
   real model workers, through a router with ``--policy session`` and one with
   ``round-robin``. Reports mean TTFT of the last turn over the first (goal for sticky:
   at most 1.5).

    python benchmarks/router_overhead.py [--clients 64] [--requests 20] [--ttft]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from splitserve.cluster.local import free_port

ROOT = Path(__file__).resolve().parent.parent
ECHO_WORKER = ROOT / "tests" / "router" / "fake_worker.py"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=20, help="per client and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--worker-url", default=None, help="an existing worker (default: echo worker)")
    p.add_argument("--max-tokens", type=int, default=8, help="for a real --worker-url")
    p.add_argument("--ttft", action="store_true", help="also run part 2 (real model workers)")
    p.add_argument("--real-workers", type=int, default=2)
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


# ---- processes -------------------------------------------------------------------------------


class Proc:
    """A child process serving HTTP on ``port``; stopped (its whole group) on ``stop``."""

    def __init__(self, argv: list[str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(argv, start_new_session=True, cwd=ROOT)

    def wait_ready(self, timeout_s: float = 180.0) -> Proc:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.url} not ready after {timeout_s}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)


def echo_worker() -> Proc:
    port = free_port()
    return Proc([sys.executable, str(ECHO_WORKER), "--port", str(port), "--name", "echo"], port)


def real_worker(threads: int) -> Proc:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "splitserve.cli",
        "worker",
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--kv-cache-gb",
        "0.3",
        "--log-level",
        "warning",
    ]
    return Proc(argv, port)


def router(workers: list[str], policy: str = "session") -> Proc:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "splitserve.router.cli",
        "--port",
        str(port),
        "--workers",
        *workers,
        "--policy",
        policy,
        "--log-level",
        "warning",
    ]
    return Proc(argv, port)


# ---- part 1: overhead ------------------------------------------------------------------------


async def one_stream(client: httpx.AsyncClient, url: str, body: dict) -> float:
    start = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for _ in r.aiter_raw():
            pass
    return time.perf_counter() - start


async def load_run(url: str, clients: int, requests: int, body: dict) -> tuple[list[float], float]:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=120.0) as client:
        await asyncio.gather(*(one_stream(client, url, body) for _ in range(clients)))  # warm-up

        async def client_loop(i: int) -> list[float]:
            b = {**body, "user": f"client-{i}"}
            return [await one_stream(client, url, b) for _ in range(requests)]

        start = time.perf_counter()
        results = await asyncio.gather(*(client_loop(i) for i in range(clients)))
        elapsed = time.perf_counter() - start
    latencies = [x for r in results for x in r]
    return latencies, len(latencies) / elapsed


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if q < 100 else max(xs)


def overhead(args: argparse.Namespace) -> None:
    worker = None if args.worker_url else echo_worker().wait_ready()
    worker_url = args.worker_url or worker.url
    front = router([worker_url]).wait_ready()
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
        "max_tokens": args.max_tokens,
        "temperature": 0,
    }
    try:
        runs: dict[str, tuple[list[float], list[float]]] = {"direct": ([], []), "router": ([], [])}
        for _ in range(args.rounds):
            for name, url in (("direct", worker_url), ("router", front.url)):
                lat, rps = asyncio.run(load_run(url, args.clients, args.requests, body))
                runs[name][0].extend(lat)
                runs[name][1].append(rps)
    finally:
        front.stop()
        if worker is not None:
            worker.stop()
    report_overhead(runs)


def report_overhead(runs: dict[str, tuple[list[float], list[float]]]) -> None:
    print(f"{'':<10}{'requests':>10}{'p50 ms':>10}{'p99 ms':>10}{'req/s':>10}")
    for name, (lat, rps) in runs.items():
        print(
            f"{name:<10}{len(lat):>10}{pct(lat, 50) * 1e3:>10.2f}{pct(lat, 99) * 1e3:>10.2f}"
            f"{statistics.mean(rps):>10.1f}"
        )
    (d, drps), (r, rrps) = runs["direct"], runs["router"]
    added50, added99 = (pct(r, 50) - pct(d, 50)) * 1e3, (pct(r, 99) - pct(d, 99)) * 1e3
    ratio = statistics.mean(rrps) / statistics.mean(drps)
    print(
        f"added latency: p50 {added50:.2f} ms, p99 {added99:.2f} ms "
        f"(goal p99 <= 5 ms: {'met' if added99 <= 5 else 'NOT met'})"
    )
    print(f"throughput ratio router/direct: {ratio:.3f}")


# ---- part 2: TTFT over growing sessions ------------------------------------------------------


async def ttft(
    client: httpx.AsyncClient, url: str, messages: list[dict], key: str
) -> tuple[float, str]:
    body = {"messages": messages, "stream": True, "max_tokens": 16, "temperature": 0}
    start, first, text = time.perf_counter(), None, []
    async with client.stream(
        "POST", url + "/v1/chat/completions", json=body, headers={"X-Session-Id": key}
    ) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and first is None:
                first = time.perf_counter() - start
            if line.startswith("data: {") and '"content"' in line:
                import json

                delta = json.loads(line[6:])["choices"][0].get("delta", {})
                text.append(delta.get("content") or "")
    return first or 0.0, "".join(text)


async def sessions_run(url: str, args: argparse.Namespace, tag: str) -> list[list[float]]:
    rng = random.Random(args.seed)
    words = "agent tool call result file test patch error trace branch commit log".split()

    async def session(i: int) -> list[float]:
        messages = [{"role": "system", "content": f"You are coding agent {i}. Be brief."}]
        times = []
        async with httpx.AsyncClient(timeout=300.0) as client:
            for t in range(args.turns):
                observation = " ".join(rng.choice(words) for _ in range(60))
                messages.append({"role": "user", "content": f"Turn {t}: {observation}"})
                took, reply = await ttft(client, url, messages, f"{tag}-{i}")
                messages.append({"role": "assistant", "content": reply})
                times.append(took)
        return times

    return await asyncio.gather(*(session(i) for i in range(args.sessions)))


def stickiness(args: argparse.Namespace) -> None:
    workers = [real_worker(args.threads_per_worker) for _ in range(args.real_workers)]
    fronts: list[Proc] = []
    try:
        for w in workers:
            w.wait_ready()
        urls = [w.url for w in workers]
        fronts = [router(urls, "session").wait_ready(), router(urls, "round-robin").wait_ready()]
        print(f"\n{'policy':<14}{'TTFT turn 1 ms':>16}{'TTFT turn N ms':>16}{'ratio':>8}")
        for name, front in zip(("session", "round-robin"), fronts, strict=True):
            per_session = asyncio.run(sessions_run(front.url, args, name))
            first = statistics.mean(s[0] for s in per_session)
            last = statistics.mean(s[-1] for s in per_session)
            print(f"{name:<14}{first * 1e3:>16.1f}{last * 1e3:>16.1f}{last / first:>8.2f}")
        print("goal for session: ratio <= 1.5")
    finally:
        for p in [*fronts, *workers]:
            p.stop()


def main() -> None:
    args = parse_args()
    print(f"config: {vars(args)}  cpus={os.cpu_count()}")
    overhead(args)
    if args.ttft:
        stickiness(args)


if __name__ == "__main__":
    main()
