"""Structured output through a real worker and the official ``openai`` client.

1. Validity: ``--requests`` ``json_schema`` requests over the 20 agent schemas
   (benchmarks/agent_schemas.py, round robin, a different prompt each) and as many
   ``tool_choice: "required"`` requests (each offers three of the schemas as tools), sent
   ``--concurrency`` at a time, greedy. Every reply must parse and validate with
   ``jsonschema`` (the tool call's arguments against its tool's ``parameters``).
2. Overhead: streamed TPOT with and without a ``json_schema`` constraint, at batch 1 and at
   batch 16, the two sides alternating round by round (ABAB) on the same worker so that a
   noisy machine hits both alike. Every request generates exactly 64 tokens (``ignore_eos``),
   so the batch stays full on both sides; TPOT = (last time - first time) / (tokens - 1) over
   a request's token chunks (``return_token_ids``: one chunk per token), for the constrained
   side only the tokens up to the end of its JSON value (after it the grammar allows nothing
   but EOS). Median over requests, printed
   side by side with the ratio (goal <= 1.15).

    PYTHONPATH=src .venv/bin/python benchmarks/structured_output.py \
        [--requests 200] [--concurrency 16] [--rounds 3] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time

import jsonschema
import openai

sys.path.insert(0, os.path.dirname(__file__))
from agent_schemas import SCHEMAS, tool_of  # noqa: E402

from splitserve.cluster.local import LocalDeployment, WorkerProcess, free_port, worker_argv  # noqa: E402

SUBJECTS = [
    "a customer in Berlin",
    "tomorrow's team offsite",
    "a broken login page",
    "a vegan dinner",
    "a flight to Tokyo",
    "a pull request adding caching",
    "an angry email about billing",
    "the quarterly sales report",
    "a Python script that deletes temp files",
    "a new hire",
]
NAMES = list(SCHEMAS)


def schema_request(i: int) -> tuple[str, dict]:
    name = NAMES[i % len(NAMES)]
    subject = SUBJECTS[(i // len(NAMES)) % len(SUBJECTS)]
    return name, {
        "messages": [
            {"role": "system", "content": "You answer with JSON only."},
            {"role": "user", "content": f"Fill in a {name.replace('_', ' ')} for {subject}."},
        ],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
        },
    }


def tool_request(i: int) -> tuple[list[str], dict]:
    names = [NAMES[(i + k) % len(NAMES)] for k in range(3)]
    subject = SUBJECTS[(i // len(NAMES)) % len(SUBJECTS)]
    return names, {
        "messages": [{"role": "user", "content": f"Take care of {subject}."}],
        "tools": [tool_of(n) for n in names],
        "tool_choice": "required",
    }


async def check_schema(client, model: str, i: int) -> str | None:
    name, body = schema_request(i)
    r = await client.chat.completions.create(model=model, temperature=0, max_tokens=400, **body)
    try:
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{name}: {type(e).__name__}: {str(e)[:120]}"
    return None


async def check_tool(client, model: str, i: int) -> str | None:
    names, body = tool_request(i)
    r = await client.chat.completions.create(model=model, temperature=0, max_tokens=400, **body)
    calls = r.choices[0].message.tool_calls or []
    if not calls:
        reply = r.choices[0]
        return f"{names}: no tool call ({reply.finish_reason}): {reply.message.content!r:.120}"
    try:
        for call in calls:
            assert call.function.name in names, call.function.name
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    except (AssertionError, ValueError, jsonschema.ValidationError) as e:
        return f"{names}: {type(e).__name__}: {str(e)[:120]}"
    return None


async def bounded(n: int, concurrency: int, fn) -> list:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int):
        async with sem:
            return await fn(i)

    return await asyncio.gather(*(one(i) for i in range(n)))


async def stream_tpot(client, model: str, i: int, constrained: bool) -> float | None:
    _, body = schema_request(i)
    if not constrained:
        del body["response_format"]
    times, text = [], ""
    stream = await client.chat.completions.create(
        model=model,
        temperature=0,
        max_tokens=64,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        **body,
    )
    async for chunk in stream:
        # With return_token_ids every token has its chunk, even one whose text is held back.
        if chunk.choices and (chunk.choices[0].model_extra or {}).get("token_ids"):
            text += chunk.choices[0].delta.content or ""
            times.append((time.perf_counter(), len(text)))
    if constrained:
        try:
            end = json.JSONDecoder().raw_decode(text)[1]
        except ValueError:
            end = len(text)
        times = [(t, n) for t, n in times if n <= end]
    return (times[-1][0] - times[0][0]) / (len(times) - 1) if len(times) > 2 else None


async def tpot(client, model: str, batch: int, rounds: int) -> dict[str, float]:
    out: dict[str, list[float]] = {"plain": [], "json_schema": []}
    for r in range(rounds):
        for side in ("plain", "json_schema") if r % 2 == 0 else ("json_schema", "plain"):
            base = r * batch
            got = await asyncio.gather(
                *(stream_tpot(client, model, base + k, side != "plain") for k in range(batch))
            )
            out[side] += [t for t in got if t is not None]
    return {side: statistics.median(v) for side, v in out.items()}


async def run(url: str, args: argparse.Namespace) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=1800, max_retries=0)
    model = (await client.models.list()).data[0].id
    await bounded(
        2, 2, lambda i: check_schema(client, model, i)
    )  # warm-up (builds matchers' vocabulary)
    checks = (("json_schema", check_schema), ("tool_choice=required", check_tool))
    for label, fn in checks if args.requests else ():
        start = time.perf_counter()
        failures = [
            f
            for f in await bounded(
                args.requests, args.concurrency, lambda i, fn=fn: fn(client, model, i)
            )
            if f
        ]
        ok = args.requests - len(failures)
        print(
            f"{label:22s} {ok}/{args.requests} parse and validate "
            f"({time.perf_counter() - start:.0f} s at concurrency {args.concurrency})"
        )
        for f in failures[:5]:
            print("   ", f)
    for batch in args.batches:
        t = await tpot(client, model, batch, args.rounds)
        plain, constrained = t["plain"], t["json_schema"]
        print(
            f"TPOT batch {batch:2d}: plain {plain * 1e3:7.1f} ms, json_schema "
            f"{constrained * 1e3:7.1f} ms, ratio {constrained / plain:.3f} (goal <= 1.15)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="per kind; 0: only TPOT")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="TPOT rounds per side and batch")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    print(
        "config:",
        json.dumps(vars(args)),
        f"cpus={os.cpu_count()}",
        f"load={os.getloadavg()[0]:.1f}",
    )
    port = free_port()
    extra = ["--max-model-len", "1024", "--log-level", "warning"]
    if args.threads is not None:
        extra += ["--threads", str(args.threads)]
    worker = WorkerProcess(
        "worker", worker_argv("127.0.0.1", port, args.model, extra), f"http://127.0.0.1:{port}"
    )
    deployment = LocalDeployment([worker])
    try:
        if not deployment.start(ready_timeout=600, stop=threading.Event()):
            sys.exit("the worker did not become healthy")
        asyncio.run(run(worker.url, args))
    finally:
        deployment.stop()


if __name__ == "__main__":
    main()
