"""What the HTTP server costs: streamed output tokens/s over HTTP vs the offline engine.

The same requests (random token-id prompts, fixed output length with ``ignore_eos``, greedy)
run on both sides, in rounds of ``--clients`` requests:

1. offline: ``LLM.generate`` on one round's requests at once, in this process;
2. HTTP: a ``splitserve worker`` subprocess, ``--clients`` concurrent streaming clients per
   round (one request each), on the same machine, with the same engine options.

Rounds alternate between the sides so that background load hits both alike. The first round
is a warm-up; no prompt repeats, so neither side gets prefix-cache hits. Reports output
tokens/s of both and HTTP as a fraction of offline. The clients run in this process and
share the CPU with the worker, as they would on one box.

    python benchmarks/server_overhead.py [--clients 32] [--rounds 3] [--output-len 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402

from splitserve import LLM, SamplingParams  # noqa: E402
from splitserve.cluster.local import LocalDeployment, WorkerProcess, free_port, worker_argv  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="measured rounds of --clients requests")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=None, help="engine CPU threads (both sides)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_rounds(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """Warm-up round first; every prompt distinct, so no prefix-cache hits on either side."""
    rng = random.Random(args.seed)

    def prompt() -> list[int]:
        return [
            rng.randrange(100, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))
        ]

    return [[prompt() for _ in range(args.clients)] for _ in range(args.rounds + 1)]


def engine_options(args: argparse.Namespace) -> dict:
    # Everything else stays at the defaults, which the worker uses too.
    return {"threads": args.threads, "max_model_len": args.max_model_len}


def run_offline(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[int, float]:
    """One round offline: (output tokens, seconds)."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start


@dataclass
class StreamResult:
    tokens: int
    ttft: float


async def stream_one(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> StreamResult:
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            if '"usage":{' in line:  # parse only the last chunk: the clients share this CPU
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return StreamResult(tokens, ttft or 0.0)


async def run_http(
    client: httpx.AsyncClient, prompts: list[list[int]], output_len: int
) -> tuple[int, float, list[float]]:
    """One round over HTTP, a client per prompt: (output tokens, seconds, TTFTs)."""
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_one(client, p, output_len) for p in prompts))
    elapsed = time.perf_counter() - start
    return sum(r.tokens for r in results), elapsed, [r.ttft for r in results]


async def bench(llm: LLM, url: str, rounds: list[list[list[int]]], output_len: int) -> dict:
    """Alternate offline and HTTP rounds so that background load hits both sides alike."""
    totals = {"offline": [0, 0.0], "http": [0, 0.0]}
    ttfts: list[float] = []
    limits = httpx.Limits(max_connections=len(rounds[0]) * 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        for i, prompts in enumerate(rounds):
            off = run_offline(llm, prompts, output_len)
            tokens, elapsed, round_ttfts = await run_http(client, prompts, output_len)
            if i == 0:
                continue  # warm-up
            off_rate, http_rate = off[0] / off[1], tokens / elapsed
            print(
                f"round {i}: offline {off_rate:.1f} tok/s, http {http_rate:.1f} tok/s, "
                f"ratio {http_rate / off_rate:.3f}"
            )
            for side, (t, e) in (("offline", off), ("http", (tokens, elapsed))):
                totals[side][0] += t
                totals[side][1] += e
            ttfts += round_ttfts
    result = {side: t / e for side, (t, e) in totals.items()}
    result["median_ttft_s"] = statistics.median(ttfts)
    return result


def start_worker(args: argparse.Namespace) -> LocalDeployment:
    port = free_port()
    extra = ["--max-model-len", str(args.max_model_len), "--log-level", "warning"]
    if args.threads is not None:
        extra += ["--threads", str(args.threads)]
    worker = WorkerProcess(
        "worker", worker_argv("127.0.0.1", port, args.model, extra), f"http://127.0.0.1:{port}"
    )
    deployment = LocalDeployment([worker])
    if not deployment.start(ready_timeout=600, stop=threading.Event()):
        deployment.stop()
        sys.exit("the worker did not become healthy")
    return deployment


def main() -> None:
    args = parse_args()
    print("config:", json.dumps(vars(args)), f"cpus={os.cpu_count()}")
    llm = LLM(model=args.model, **engine_options(args))
    rounds = make_rounds(args, llm.engine.model_config.vocab_size)
    n = args.clients * args.rounds
    print(
        f"requests: {n} measured (+{args.clients} warm-up) per side, "
        f"prompt {args.min_prompt}-{args.max_prompt} tokens, {args.output_len} output tokens"
    )
    deployment = start_worker(args)
    try:
        r = asyncio.run(bench(llm, deployment.workers[0].url, rounds, args.output_len))
    finally:
        deployment.stop()
    print(f"offline engine:            {r['offline']:8.1f} output tok/s")
    print(
        f"HTTP, {args.clients} streaming clients: {r['http']:8.1f} output tok/s "
        f"(median TTFT {r['median_ttft_s'] * 1000:.0f} ms)"
    )
    print(f"ratio HTTP / offline: {r['http'] / r['offline']:.3f} (goal >= 0.85)")


if __name__ == "__main__":
    main()
