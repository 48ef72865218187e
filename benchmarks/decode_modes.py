"""Batch-1 decode step times of the engine in each small-step mode, alternating rounds.

Modes: ``torch`` (the model's torch ops), ``auto`` (the fused kernel on the threads CoreShare
picks, the default), ``fused`` (the fused kernel always on all threads), ``fused1`` (one
thread). Run it next to a load to see how each copes, e.g.::

    nice -n 10 python3 -c "while True: pass" & .venv/bin/python benchmarks/decode_modes.py; kill %1
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from splitserve import LLM, SamplingParams  # noqa: E402
from splitserve.engine.core_share import CoreShare  # noqa: E402


def run(llm: LLM, mode: str, prompt: list[int], steps: int) -> list[float]:
    engine, runner = llm.engine, llm.engine.runner
    runner.use_fused_decode(mode != "torch")
    runner.threads = 1 if mode == "fused1" else llm.engine.config.threads
    runner.core_share = CoreShare(interval_s=1e9 if mode != "auto" else 0.25)
    engine.block_manager.reset_prefix_cache()
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    engine.add_request(f"{mode}-{time.monotonic()}", prompt, params)
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--modes", default="torch,auto,fused,fused1")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    llm = LLM(threads=args.threads)
    vocab = llm.engine.model_config.vocab_size
    prompt = [random.Random(1).randrange(100, vocab) for _ in range(args.context)]
    modes = args.modes.split(",")
    for mode in modes:
        run(llm, mode, prompt, 4)  # warm-up (and the kernel's compile, once)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            times[mode] += run(llm, mode, prompt, args.steps)
    print(f"config: {vars(args)}  load average at the end: {os.getloadavg()}")
    for mode, t in times.items():
        p90 = sorted(t)[int(0.9 * len(t))]
        print(f"{mode:7s} median {statistics.median(t) * 1e3:6.1f} ms  p90 {p90 * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
