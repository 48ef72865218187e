"""TTFT of returning agent sessions with the KV tier ladder vs recomputing their context.

For each context length, sessions whose KV together is at least 5x the device pool each send
a first turn (``ctx`` tokens, 16 generated); once every session has gone (the pause: by then
the pool has turned over 5 times), each returns with its context plus the reply plus 64 new
tokens. TTFT is the latency of that returning turn as a ``max_tokens=1`` request.

* ``recompute``: a worker without tiers (the returning context is long gone from its pool).
* ``host``: a worker with ``--host-kv-gb`` and a write-through ``--disk-kv-dir``.
* ``disk``: the same worker restarted on its directory (host RAM empty, page cache dropped
  for the block files): every session returns again (other new tokens) from disk.

Every other returning turn is preceded by a prefetch hint (``POST /v1/kv/prefetch``), sent
right before the request, as the router sends it; hinted and unhinted TTFTs are reported
apart. Also measured in the same run: disk-tier load bandwidth (``DiskTier.load``, plain and
AES-GCM) as a fraction of a raw sequential read of a file of the same size, both with the
page cache dropped (``posix_fadvise DONTNEED``; no root needed).

    python benchmarks/kv_tiers.py [--contexts 1024,2048,4096] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from procs import metric, start_worker, stop_group, wait_healthy  # noqa: E402

from splitserve.kvstore import DiskTier, KeyRing, generate_key, load_keyring  # noqa: E402

BS = 16
BLOCK_BYTES = 2 * 30 * 3 * 64 * 4 * BS  # the default model's KV block, float32
FIRST_OUT, NEW_TOKENS = 16, 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--contexts", default="1024,2048,4096")
    p.add_argument("--pool-factor", type=float, default=5.0, help="session KV / device pool")
    p.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    p.add_argument("--bandwidth-mb", type=int, default=256, help="size of the disk read test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p.parse_args()


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}{path}", json=body, timeout=900)
    r.raise_for_status()
    return r.json()


def first_turn(url: str, prompt: list[int]) -> list[int]:
    body = {"prompt": prompt, "max_tokens": FIRST_OUT, "temperature": 0, "ignore_eos": True}
    return post(url, "/v1/completions", {**body, "return_token_ids": True})["choices"][0][
        "token_ids"
    ]


def returning_turn(url: str, prompt: list[int], hint: bool) -> tuple[float, int]:
    """(TTFT in seconds, cached prompt tokens) of one returning turn."""
    start = time.perf_counter()
    if hint:
        post(url, "/v1/kv/prefetch", {"prompt_token_ids": prompt})
    out = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    return time.perf_counter() - start, out["usage"]["prompt_tokens_details"]["cached_tokens"]


def pool_for(ctx: int) -> tuple[int, float]:
    """Device pool (blocks, GiB) just big enough for one returning turn of ``ctx``."""
    blocks = math.ceil((ctx + FIRST_OUT + NEW_TOKENS + BS) / BS)
    return blocks, blocks * BLOCK_BYTES / 2**30


def sessions(ctx: int, pool_blocks: int, rng: random.Random) -> list[list[int]]:
    n = math.ceil(ARGS.pool_factor * pool_blocks * BS / (ctx + FIRST_OUT))
    return [[rng.randrange(100, 49000) for _ in range(ctx)] for _ in range(n)]


def run_turns(url: str, firsts: list[list[int]], rng: random.Random) -> list[list[int]]:
    """Every session's first turn, in order; returns each returning prompt."""
    returns = []
    for prompt in firsts:
        reply = first_turn(url, prompt)
        returns.append(prompt + reply + [rng.randrange(100, 49000) for _ in range(NEW_TOKENS)])
    return returns


def measure_returns(url: str, returns: list[list[int]], hints: bool) -> list[dict]:
    rows = []
    for i, prompt in enumerate(returns):
        ttft, cached = returning_turn(url, prompt, hints and i % 2 == 1)
        rows.append({"ttft_s": ttft, "cached": cached, "hint": hints and i % 2 == 1})
    return rows


def drop_page_cache(directory: Path) -> None:
    for path in directory.rglob("*.kvb"):
        drop_file(path)


def drop_file(path: Path) -> None:
    """Evict a file's (clean, fsynced) pages from the page cache: the next read hits disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def start(args: list[str]) -> tuple[str, object]:
    url, proc = start_worker(args, threads=ARGS.threads)
    wait_healthy(url, proc, timeout=600)
    post(url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})  # warm-up
    return url, proc


def context_run(ctx: int, rng: random.Random, tmp: Path) -> dict:
    pool_blocks, pool_gb = pool_for(ctx)
    firsts = sessions(ctx, pool_blocks, rng)
    pool = ["--kv-cache-gb", f"{pool_gb + 1e-6:.6f}"]  # rounded up: never a block short
    tiers = pool + ["--host-kv-gb", "3", "--disk-kv-dir", str(tmp / f"ctx{ctx}")]
    tiers += ["--disk-kv-gb", "8"]
    row: dict = {"ctx": ctx, "sessions": len(firsts), "pool_blocks": pool_blocks}
    url, proc = start(pool)
    try:
        row["recompute"] = measure_returns(url, run_turns(url, firsts, rng), hints=False)
    finally:
        stop_group(proc)
    url, proc = start(tiers)
    try:
        returns = run_turns(url, firsts, rng)
        row["host"] = measure_returns(url, returns, hints=True)
    finally:
        stop_group(proc)  # SIGTERM: pending disk writes land first
    drop_page_cache(tmp / f"ctx{ctx}")
    url, proc = start(tiers)
    try:
        # New last messages: what the host pass left on disk past the first turn is not reused.
        again = [
            r[:-NEW_TOKENS] + [rng.randrange(100, 49000) for _ in range(NEW_TOKENS)]
            for r in returns
        ]
        row["disk"] = measure_returns(url, again, hints=True)
        loaded = metric(url, 'splitserve:kv_tier_loaded_blocks_total{tier="disk"}')
        seconds = metric(url, 'splitserve:kv_tier_load_seconds_sum{tier="disk"}')
        row["worker_disk_load_gbps"] = loaded * BLOCK_BYTES / seconds / 1e9 if seconds else None
    finally:
        stop_group(proc)
    return row


# ---- disk-tier bandwidth vs a raw sequential read --------------------------------------------


def raw_read_gbps(path: Path) -> float:
    drop_file(path)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass
    return path.stat().st_size / (time.perf_counter() - start) / 1e9


def tier_load_gbps(directory: Path, key: KeyRing | None, n: int) -> float:
    rng = np.random.default_rng(0)
    tier = DiskTier(directory, (n + 1) * (BLOCK_BYTES + 4096), "bench-model", key=key)
    hashes = [rng.bytes(16) for _ in range(n)]
    for h in hashes:
        tier.put(h, rng.standard_normal(BLOCK_BYTES // 4, dtype=np.float32))
    drop_page_cache(directory)
    start = time.perf_counter()
    assert all(tier.load(h) is not None for h in hashes)
    return n * BLOCK_BYTES / (time.perf_counter() - start) / 1e9


def bandwidth(tmp: Path) -> dict:
    n = ARGS.bandwidth_mb * 2**20 // BLOCK_BYTES
    raw = tmp / "raw.bin"
    with open(raw, "wb") as f:
        f.write(os.urandom(n * BLOCK_BYTES))
        f.flush()
        os.fsync(f.fileno())
    out = {"blocks": n, "raw_gbps": raw_read_gbps(raw)}
    out["plain_gbps"] = tier_load_gbps(tmp / "bw-plain", None, n)
    key = load_keyring(generate_key(tmp / "bw-key"))
    out["aes_gbps"] = tier_load_gbps(tmp / "bw-aes", key, n)
    out["raw_again_gbps"] = raw_read_gbps(raw)  # the peer, measured on both sides of the tier
    return out


# ---- report ----------------------------------------------------------------------------------


def pct(rows: list[dict], q: float, **match) -> float:
    vals = [r["ttft_s"] for r in rows if all(r[k] == v for k, v in match.items())]
    return float(np.percentile(vals, q)) if vals else float("nan")


def print_table(results: list[dict]) -> None:
    print("| context | sessions (KV / pool) | recompute p50 / p99 | host p50 / p99 | "
          "disk p50 / p99 | p50 speed-up host / disk | cached tokens (host) | "
          "hint p50 host: with / without | disk tier load (worker) |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        rec, host, disk = r["recompute"], r["host"], r["disk"]
        kv_ratio = r["sessions"] * (r["ctx"] + FIRST_OUT) / (r["pool_blocks"] * BS)
        cells = [
            f"{r['ctx']}",
            f"{r['sessions']} ({kv_ratio:.1f}x)",
            f"{pct(rec, 50) * 1e3:,.0f} / {pct(rec, 99) * 1e3:,.0f} ms",
            f"{pct(host, 50) * 1e3:,.0f} / {pct(host, 99) * 1e3:,.0f} ms",
            f"{pct(disk, 50) * 1e3:,.0f} / {pct(disk, 99) * 1e3:,.0f} ms",
            f"{pct(rec, 50) / pct(host, 50):.1f}x / {pct(rec, 50) / pct(disk, 50):.1f}x",
            f"{np.mean([x['cached'] for x in host]):.0f}",
            f"{pct(host, 50, hint=True) * 1e3:,.0f} / {pct(host, 50, hint=False) * 1e3:,.0f} ms",
            f"{(r['worker_disk_load_gbps'] or 0):.2f} GB/s",
        ]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    rng = random.Random(ARGS.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="kv-tiers-bench-") as d:
        tmp = Path(d)
        bw = bandwidth(tmp)
        print(json.dumps({"disk_bandwidth": bw}), flush=True)
        for ctx in map(int, ARGS.contexts.split(",")):
            results.append(context_run(ctx, rng, tmp))
            print(json.dumps(results[-1]), flush=True)
    print_table(results)
    raw = (bw["raw_gbps"] + bw["raw_again_gbps"]) / 2
    print(
        f"disk tier load bandwidth ({bw['blocks']} blocks, page cache dropped): plain "
        f"{bw['plain_gbps']:.2f} GB/s = {bw['plain_gbps'] / raw:.0%} of a raw sequential read "
        f"({raw:.2f} GB/s); AES-GCM {bw['aes_gbps']:.2f} GB/s = {bw['aes_gbps'] / raw:.0%}"
    )
    if ARGS.json:
        Path(ARGS.json).write_text(json.dumps({"bandwidth": bw, "contexts": results}, indent=2))


if __name__ == "__main__":
    ARGS = parse_args()
    print(f"config: {vars(ARGS)}", flush=True)
    main()
