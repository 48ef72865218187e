"""Does another tenant's time to first token show what one tenant sent? It must not.

One real worker with a keys file of two tenants. Each round sends a fresh prompt three
times, streaming one token: alice cold (a miss), alice again (her prefix-cache hit), then
bob with the same prompt. If tenants shared blocks, bob's TTFT would look like alice's hit;
isolated, it looks like a miss. Prints the TTFT distributions side by side, the ratio of
bob's median to the miss median and to the hit median, and how many of bob's requests were
faster than the slowest hit, with the ``cached_tokens`` each reported.

    python benchmarks/tenant_isolation.py [--rounds 40] [--prompt-tokens 768] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from router_peer import cpu_description  # noqa: E402

from splitserve.cluster.local import free_port, stop_group  # noqa: E402

KEYS = {"alice": "sk-alice", "bob": "sk-bob"}


def start_worker(keys: Path, threads: int) -> tuple[str, subprocess.Popen]:
    port = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "worker", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--threads", str(threads), "--log-level", "warning"]
    argv += ["--api-keys", str(keys), "--kv-cache-gb", "0.3"]
    env = {**os.environ, "SPLITSERVE_KV_SECRET": secrets.token_hex(16)}
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
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
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the worker did not become healthy in 300 s")


def ttft(client: httpx.Client, url: str, who: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first streamed token, cached_tokens) of one request."""
    body = {
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"authorization": f"Bearer {KEYS[who]}"}
    start, first, cached = time.perf_counter(), None, -1
    with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise SystemExit(f"{who}: HTTP {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - start
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert first is not None, "no token streamed"
    return first, cached


def summary(name: str, xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return (
        f"{name:<12} p10 {q[0] * 1e3:7.1f}  p50 {statistics.median(xs) * 1e3:7.1f}  "
        f"p90 {q[8] * 1e3:7.1f} ms"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--prompt-tokens", type=int, default=768)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    print(f"CPU: {cpu_description()}; worker threads {args.threads}")
    print(f"rounds {args.rounds}, prompt {args.prompt_tokens} tokens, 1 output token")
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.json"
        keys.write_text(json.dumps([{"key": k, "tenant": t} for t, k in KEYS.items()]))
        url, proc = start_worker(keys, args.threads)
        times: dict[str, list[float]] = {"alice miss": [], "alice hit": [], "bob": []}
        cached: dict[str, list[int]] = {name: [] for name in times}
        try:
            with httpx.Client(timeout=120) as client:
                ttft(client, url, "alice", [rng.randrange(100, 40000) for _ in range(64)])
                for _ in range(args.rounds):
                    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
                    for name, who in (
                        ("alice miss", "alice"),
                        ("alice hit", "alice"),
                        ("bob", "bob"),
                    ):
                        t, c = ttft(client, url, who, prompt)
                        times[name].append(t)
                        cached[name].append(c)
        finally:
            stop_group(proc, timeout=60)
    for name, xs in times.items():
        print(summary(name, xs), f"  cached_tokens max {max(cached[name])}")
    bob, miss, hit = (statistics.median(times[n]) for n in ("bob", "alice miss", "alice hit"))
    below = sum(t <= max(times["alice hit"]) for t in times["bob"])
    print(f"bob / miss median: {bob / miss:.2f}x   bob / hit median: {bob / hit:.2f}x")
    print(f"bob's requests no slower than alice's slowest hit: {below} of {args.rounds}")


if __name__ == "__main__":
    main()
