"""A scripted 10-turn tool-using agent over ``/v1/responses`` with ``previous_response_id``:
does each turn find the chain's KV cached, and does time to first token stay flat as the
context grows?

The agent asks about a city, the model calls a tool (Hermes format, shown by few-shot turns
in the first input), the script answers the call with a ``function_call_output``; a turn
that calls no tool is answered with the next question. Every turn is one streamed
``responses.create`` through the official ``openai`` client.

Per turn it records ``cached_tokens`` against the previous turn's context (its input plus
its output) and the server's time to first token: the delta of the worker's
``splitserve:time_to_first_token_seconds`` histogram over the turn (turns are sequential, so
the delta is that turn's own figure; the client cannot see a token that may open a tool call,
since it is held back). Each run's instructions begin with the run number, so no run finds
another's KV and turn 1 is computed whole. Goals: from turn 2 on cached_tokens >= 90% of the
previous turn's context, and TTFT of turn 10 <= 1.5x turn 1 (medians over the runs).

    python benchmarks/responses_agent.py                  # starts a worker on loopback
    python benchmarks/responses_agent.py --url http://127.0.0.1:8000 --metrics-url ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).parent))
from router_peer import cpu_description  # noqa: E402

from splitserve.cluster.local import free_port  # noqa: E402

TTFT_SUM = "splitserve:time_to_first_token_seconds_sum"
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
INSTRUCTIONS = (
    "You are a travel assistant that plans trips for a user who is about to visit several "
    "cities. You have one tool, get_weather, which returns the current weather of a city. "
    "When the user asks about a city, call the tool before you answer. To call a tool, reply "
    'with <tool_call>{"name": NAME, "arguments": ARGS}</tool_call> and nothing else. When '
    "the tool's result comes back, answer the user in one short sentence that names the "
    "city and the weather, and suggest one thing to pack. Never invent weather that the tool "
    "did not report. Keep every answer short, friendly and precise; do not repeat the "
    "question; do not apologise; do not explain how the tool works. "
)
CITIES = ["Paris", "Lisbon", "Vienna", "Prague", "Madrid", "Dublin", "Athens", "Berlin"]
WEATHER = ["sunny, 24 C", "light rain, 14 C", "cloudy, 18 C", "windy, 11 C", "clear, 27 C"]


def first_input() -> list[dict]:
    """Two worked examples (question, call, result, answer) as items, then the first question."""
    items: list[dict] = []
    for city, weather, item in (
        ("Rome", "sunny, 25 C", "sunglasses"),
        ("Oslo", "snow, -3 C", "boots"),
    ):
        call_id = f"call_example_{city.lower()}"
        arguments = json.dumps({"city": city})
        items.append({"role": "user", "content": f"What is the weather in {city}?"})
        items.append(
            {
                "type": "function_call",
                "call_id": call_id,
                "name": "get_weather",
                "arguments": arguments,
            }
        )
        items.append({"type": "function_call_output", "call_id": call_id, "output": weather})
        answer = f"{city} is {weather.split(',')[0]} today; pack {item}."
        items.append({"role": "assistant", "content": answer})
    items.append({"role": "user", "content": f"What is the weather in {CITIES[0]}?"})
    return items


class Agent:
    """The script: answer each tool call with a result, else ask about the next city."""

    def __init__(self) -> None:
        self.city = 0
        self.result = 0

    def next_input(self, response) -> list[dict]:
        calls = [item for item in response.output if item.type == "function_call"]
        if calls:
            self.result += 1
            weather = WEATHER[self.result % len(WEATHER)]
            return [
                {"type": "function_call_output", "call_id": c.call_id, "output": weather}
                for c in calls
            ]
        self.city += 1
        city = CITIES[self.city % len(CITIES)]
        return [{"role": "user", "content": f"What is the weather in {city}?"}]


def ttft_sum(metrics: httpx.Client) -> float:
    for line in metrics.get("/metrics").text.splitlines():
        if line.startswith(TTFT_SUM):
            return float(line.split()[-1])
    raise SystemExit(f"the server's /metrics has no {TTFT_SUM}")


def run_chain(client, metrics, run: int, turns: int, max_tokens: int) -> list[dict]:
    agent, previous, rows = Agent(), None, []
    instructions = f"Run {run}. {INSTRUCTIONS}"
    for turn in range(turns):
        before = ttft_sum(metrics)
        events = client.responses.create(
            input=first_input() if previous is None else agent.next_input(previous),
            previous_response_id=None if previous is None else previous.id,
            instructions=instructions,
            tools=TOOLS,
            temperature=0,
            max_output_tokens=max_tokens,
            stream=True,
        )
        response = [e for e in events][-1].response
        usage = response.usage
        row = {
            "turn": turn + 1,
            "input": usage.input_tokens,
            "cached": usage.input_tokens_details.cached_tokens,
            "output": usage.output_tokens,
            "calls": sum(item.type == "function_call" for item in response.output),
            "ttft_s": ttft_sum(metrics) - before,
        }
        if rows:
            row["reuse"] = row["cached"] / (rows[-1]["input"] + rows[-1]["output"])
        rows.append(row)
        previous = response
    return rows


def cold_ttft(metrics: httpx.Client, tokens: int) -> float:
    """TTFT of a prompt as long as ``tokens`` that finds nothing cached (its own
    ``cache_salt``): what the last turn would cost without the chain's KV."""
    before = ttft_sum(metrics)
    body = {
        "prompt": [100 + (7 * i) % 5000 for i in range(tokens)],
        "max_tokens": 1,
        "temperature": 0,
        "cache_salt": os.urandom(8).hex(),
    }
    r = metrics.post("/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return ttft_sum(metrics) - before


def start_worker(args) -> tuple[str, subprocess.Popen]:
    port = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "worker", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--threads", str(args.threads), "--log-level", "warning"]
    argv += ["--max-model-len", str(args.max_model_len)]
    proc = subprocess.Popen(argv, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the worker exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the worker was not healthy within 300 s")


def report(runs: list[list[dict]], cold: list[float]) -> bool:
    print(
        f"{'turn':>4} {'input':>6} {'cached':>6} {'output':>6} {'calls':>5} "
        f"{'reuse':>6} {'ttft_ms':>8}   (medians over {len(runs)} runs)"
    )
    turns = len(runs[0])
    med = []
    for t in range(turns):
        rows = [r[t] for r in runs]
        m = {k: statistics.median(row[k] for row in rows) for k in rows[0] if k != "turn"}
        med.append(m)
        reuse = f"{m['reuse']:.3f}" if "reuse" in m else "-"
        print(
            f"{t + 1:>4} {m['input']:>6.0f} {m['cached']:>6.0f} {m['output']:>6.0f} "
            f"{m['calls']:>5.0f} {reuse:>6} {1000 * m['ttft_s']:>8.1f}"
        )
    worst = min(r[t]["reuse"] for r in runs for t in range(1, turns))
    ratio = med[-1]["ttft_s"] / med[0]["ttft_s"]
    reuse_ok, ttft_ok = worst >= 0.9, ratio <= 1.5
    cold_ms = 1000 * statistics.median(cold)
    print(
        f"cold prefill of turn {turns}'s {med[-1]['input']:.0f} tokens (nothing cached): "
        f"{cold_ms:.1f} ms; chained turn {turns} / cold: {med[-1]['ttft_s'] * 1000 / cold_ms:.3f}"
    )
    print(
        f"lowest reuse from turn 2 on, any run: {worst:.3f} (goal >= 0.90: "
        f"{'met' if reuse_ok else 'NOT met'})"
    )
    print(
        f"TTFT turn {turns} / turn 1: {ratio:.3f} (goal <= 1.5: {'met' if ttft_ok else 'NOT met'})"
    )
    return reuse_ok and ttft_ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running worker or router (default: start a worker)")
    p.add_argument("--metrics-url", help="the worker whose /metrics to read (default: --url)")
    p.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY", "none"))
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="chains run first and not counted")
    p.add_argument("--max-output-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=2048)
    args = p.parse_args()
    proc = None
    url = args.url
    if url is None:
        url, proc = start_worker(args)
    started = f" (started here, threads={args.threads})" if proc else ""
    print(
        f"config: turns={args.turns} runs={args.runs} warmup={args.warmup} "
        f"max_output_tokens={args.max_output_tokens} url={url}{started}"
    )
    print(f"CPU: {cpu_description()}")
    try:
        headers = {"authorization": f"Bearer {args.api_key}"}
        metrics = httpx.Client(base_url=args.metrics_url or url, headers=headers, timeout=30)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=args.api_key, timeout=300)
        for w in range(args.warmup):
            run_chain(client, metrics, -1 - w, 2, args.max_output_tokens)
        runs, cold = [], []
        for r in range(args.runs):
            runs.append(run_chain(client, metrics, r, args.turns, args.max_output_tokens))
            cold.append(cold_ttft(metrics, runs[-1][-1]["input"]))
        met = report(runs, cold)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    main()
