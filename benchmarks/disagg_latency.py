"""What the remote prefill leg costs: TTFT of a prompt prefilled on the decode worker itself
vs prefilled on a prefill worker and pulled (tcp, tcp + AES-GCM, shm), same run, same box.

Every prompt is fresh random tokens (no prefix-cache hits). TTFT here is the latency of a
``max_tokens=1`` request, summed over both legs when disaggregated. The prompt length at
which the remote leg starts to save the decode worker more time than it adds to the
request's TTFT is the break-even used for ``--remote-prefill-threshold``.

    python benchmarks/disagg_latency.py [--lengths 16,256,1000,4000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from procs import metric, start_worker, stop_group, wait_healthy  # noqa: E402

SECRET = "benchmark-secret"
PREFILL_WORKERS = {
    "tcp": ["--kv-transport", "tcp"],
    "tcp+aes": ["--kv-transport", "tcp", "--kv-encrypt"],
    "shm": ["--kv-transport", "shm"],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default="16,256,1000,4000")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p.parse_args()


def post(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def local_ttft(d: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    post(d, {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    return time.perf_counter() - start


def remote_ttft(p: str, d: str, prompt: list[int]) -> tuple[float, float]:
    """(TTFT over both legs, seconds of the pull itself as the decode worker measured it)."""
    start = time.perf_counter()
    params = post(p, {**_one(prompt), "kv_transfer_params": {"do_remote_decode": True}})
    pull_before = metric(d, "splitserve:kv_transfer_seconds_sum")
    post(d, {**_one(prompt), "kv_transfer_params": params["kv_transfer_params"]})
    ttft = time.perf_counter() - start
    return ttft, metric(d, "splitserve:kv_transfer_seconds_sum") - pull_before


def _one(prompt: list[int]) -> dict:
    return {"prompt": prompt, "max_tokens": 1, "temperature": 0}


def measure(urls: dict[str, str], length: int, rng: random.Random) -> dict:
    fresh = lambda: [rng.randrange(100, 49000) for _ in range(length)]  # noqa: E731
    row: dict = {
        "tokens": length,
        "local_s": statistics.median(local_ttft(urls["d"], fresh()) for _ in range(ARGS.repeats)),
    }
    for name in PREFILL_WORKERS:
        runs = [remote_ttft(urls[name], urls["d"], fresh()) for _ in range(ARGS.repeats)]
        row[f"{name}_s"] = statistics.median(t for t, _ in runs)
        row[f"{name}_pull_s"] = statistics.median(p for _, p in runs)
    return row


def print_table(rows: list[dict]) -> None:
    head = "| prompt tokens | local prefill TTFT |"
    head += "".join(f" {n}: TTFT / added / pull |" for n in PREFILL_WORKERS)
    print(head)
    print("|---:|---:|" + "---:|" * len(PREFILL_WORKERS))
    for r in rows:
        cells = [f"{r['tokens']}", f"{r['local_s'] * 1e3:.0f} ms"]
        for n in PREFILL_WORKERS:
            added = r[f"{n}_s"] - r["local_s"]
            cells.append(
                f"{r[f'{n}_s'] * 1e3:.0f} / {added * 1e3:+.0f} / {r[f'{n}_pull_s'] * 1e3:.1f} ms"
            )
        print("| " + " | ".join(cells) + " |")


def break_even(rows: list[dict]) -> float | None:
    """Shortest prompt for which a remote prefill pays: the decode-worker time it saves (the
    local prefill, which would stall every other decode there) is at least the latency it
    adds to this request (two-leg TTFT minus local TTFT). Interpolated between lengths."""
    margin = [(r["tokens"], r["local_s"] - (r["tcp_s"] - r["local_s"])) for r in rows]
    for (n0, m0), (n1, m1) in zip(margin, margin[1:], strict=False):
        if m0 < 0 <= m1:
            return n0 + (n1 - n0) * -m0 / (m1 - m0)
    return None if margin[-1][1] < 0 else margin[0][0]


def main() -> None:
    rows = []
    procs = {"d": start_worker(["--role", "decode"], SECRET, ARGS.threads)}
    for name, args in PREFILL_WORKERS.items():
        procs[name] = start_worker(["--role", "prefill", *args], SECRET, ARGS.threads)
    try:
        for url, proc in procs.values():
            wait_healthy(url, proc)
        urls = {name: url for name, (url, _) in procs.items()}
        rng = random.Random(ARGS.seed)
        measure(urls, 32, rng)  # warm-up
        for length in map(int, ARGS.lengths.split(",")):
            rows.append(measure(urls, length, rng))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        for _, proc in procs.values():
            stop_group(proc)
    print_table(rows)
    print(f"break-even uncached prompt length (tcp): {break_even(rows)} tokens")
    if ARGS.json:
        Path(ARGS.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    ARGS = parse_args()
    print(f"config: {vars(ARGS)}")
    main()
