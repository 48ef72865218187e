"""What a request pays outside the engine's steps: a lone request's TTFT through a real
`splitserve worker` (HTTP, streaming) against the engine's own prefill step for the same
prompt length, timed in this process by `sim calibrate`'s measurement. The difference is
the simulator's ``request_overhead_s`` on ``cpu-local``.

    .venv/bin/python benchmarks/request_overhead.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import httpx
import numpy as np

from splitserve.cluster.local import LocalDeployment, WorkerProcess, free_port, worker_argv
from splitserve.sim.step_timing import build_engine, measure


def start_worker() -> tuple[LocalDeployment, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = worker_argv("127.0.0.1", port, None, ["--threads", "1", "--log-level", "warning"])
    deployment = LocalDeployment([WorkerProcess("worker", argv, url)])
    if not deployment.start(ready_timeout=600, stop=threading.Event()):
        deployment.stop()
        sys.exit("the worker did not become healthy")
    return deployment, url


def http_ttfts(url: str, prompt_len: int, repeats: int, rng: np.random.Generator) -> list[float]:
    """Lone streamed requests, one after another (a pause between): time to the first token."""
    out = []
    with httpx.Client(timeout=60, trust_env=False) as client:
        for _ in range(repeats + 3):  # the first three warm up
            prompt = [int(t) for t in rng.integers(1000, 40000, prompt_len)]
            body = {"prompt": prompt, "max_tokens": 2, "stream": True, "temperature": 0}
            start = time.perf_counter()
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data: {"):
                        out.append(time.perf_counter() - start)
                        break
                for _ in lines:
                    pass
            time.sleep(0.3)
    return out[3:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(7)
    deployment, url = start_worker()
    try:
        ttfts = http_ttfts(url, args.prompt_len, args.repeats, rng)
    finally:
        deployment.stop()
    engine = build_engine(None, threads=1)
    grid = dict(prefill_lens=(args.prompt_len,), decode_batches=(), context_prefills=())
    steps = [s.seconds for s in measure(None, 1, args.repeats, engine=engine, **grid)]
    http, step = statistics.median(ttfts), statistics.median(steps)
    print(
        f"lone {args.prompt_len}-token prompt: HTTP TTFT median {1000 * http:.1f} ms "
        f"(min {1000 * min(ttfts):.1f}), engine prefill step median {1000 * step:.1f} ms "
        f"(min {1000 * min(steps):.1f}); outside the step: {1000 * (http - step):.1f} ms"
    )


if __name__ == "__main__":
    main()
