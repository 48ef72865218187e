"""What sealing costs the host-RAM KV tier: plain vs ``--host-kv-encrypt``, side by side.

Each round stores ``--blocks`` blocks of the default model's KV block size into a fresh
``HostTier`` (``put`` copies the array, as the mover's save does), then loads them all back
into a pool-sized buffer (``load`` plus the copy the mover makes into the device pool), once
plain and once sealed (AES-256-GCM, the tier's own code path), alternating which goes
first. Per round: store and load throughput
(GB of payload per second) and per-block latency; reported as medians over the rounds, with
the sealed/plain ratio. Also in the same run, the per-block cost of the primitives alone:
a copy of the block (what an shm transfer does per block) next to AES-GCM seal and open.

    python benchmarks/kv_tiers_crypto.py [--blocks 256] [--rounds 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from splitserve.kvstore import BlockMeta, HostTier, KeyRing
from splitserve.kvstore.keyring import new_nonce

BS = 16
BLOCK_BYTES = 2 * 30 * 3 * 64 * 4 * BS  # the default model's KV block, float32 (720 KiB)
CPU_FLAGS = ("aes", "vaes", "pclmulqdq", "vpclmulqdq", "avx2", "avx512f", "sha_ni")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", type=int, default=256, help="blocks per round")
    p.add_argument("--rounds", type=int, default=7, help="measured rounds (one warm-up more)")
    p.add_argument("--block-bytes", type=int, default=BLOCK_BYTES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p.parse_args()


def cpu() -> dict:
    """The CPU model and the flags that decide AES-GCM speed."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "flags": [f for f in CPU_FLAGS if f in flags]}


def one_round(blocks: list[np.ndarray], hashes: list[bytes], ring: KeyRing | None) -> dict:
    meta = BlockMeta(blocks[0].dtype.str, blocks[0].shape)
    tier = HostTier(2 * len(blocks) * (blocks[0].nbytes + 64), keyring=ring)
    pool = np.empty(blocks[0].nbytes, dtype=np.uint8)  # a device-pool block, on CPU
    puts, loads = [], []
    for h, b in zip(hashes, blocks, strict=True):
        t0 = time.perf_counter()
        tier.put(h, b, meta)
        puts.append(time.perf_counter() - t0)
    for h in hashes:
        t0 = time.perf_counter()
        block = tier.load(h)
        np.copyto(pool, np.frombuffer(block.data, dtype=np.uint8))  # as the mover does
        loads.append(time.perf_counter() - t0)
    payload = len(blocks) * blocks[0].nbytes
    return {
        "store_gbps": payload / sum(puts) / 1e9,
        "load_gbps": payload / sum(loads) / 1e9,
        "store_us_p50": 1e6 * float(np.percentile(puts, 50)),
        "store_us_p99": 1e6 * float(np.percentile(puts, 99)),
        "load_us_p50": 1e6 * float(np.percentile(loads, 50)),
        "load_us_p99": 1e6 * float(np.percentile(loads, 99)),
    }


def primitives(block: bytes, ring: KeyRing, n: int) -> dict:
    """Median microseconds per block: a copy, an AES-GCM seal, an AES-GCM open."""
    nonce, aad = new_nonce(), b"aad"
    sealed = ring.seal(nonce, block, aad)
    src = np.frombuffer(block, dtype=np.uint8)
    dst = np.empty_like(src)

    def timed(fn) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times)

    return {
        "copy_us": timed(lambda: np.copyto(dst, src)),
        "seal_us": timed(lambda: ring.seal(nonce, block, aad)),
        "open_us": timed(lambda: ring.open(ring.current, nonce, sealed, aad)),
    }


def main(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    n_floats = args.block_bytes // 4
    blocks = [rng.standard_normal(n_floats, dtype=np.float32) for _ in range(args.blocks)]
    hashes = [rng.bytes(16) for _ in range(args.blocks)]
    ring = KeyRing.of(rng.bytes(32))
    runs: dict[str, list[dict]] = {"plain": [], "sealed": []}
    for r in range(args.rounds + 1):
        order = ("plain", "sealed") if r % 2 == 0 else ("sealed", "plain")
        for name in order:
            result = one_round(blocks, hashes, ring if name == "sealed" else None)
            if r > 0:  # round 0 warms up
                runs[name].append(result)
    med = {
        name: {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        for name, rows in runs.items()
    }
    return {"med": med, "primitives": primitives(blocks[0].tobytes(), ring, 200)}


def report(args: argparse.Namespace, out: dict) -> None:
    plain, sealed, prim = out["med"]["plain"], out["med"]["sealed"], out["primitives"]
    kib = args.block_bytes / 1024
    print(f"| host tier, {kib:.0f} KiB blocks | plain | sealed | sealed/plain |")
    print("|---|---:|---:|---:|")
    for key, label, unit in (
        ("store_gbps", "store throughput", "GB/s"),
        ("load_gbps", "load throughput (into the pool)", "GB/s"),
        ("store_us_p50", "store latency p50", "us"),
        ("store_us_p99", "store latency p99", "us"),
        ("load_us_p50", "load latency p50", "us"),
        ("load_us_p99", "load latency p99", "us"),
    ):
        ratio = sealed[key] / plain[key]
        print(f"| {label} | {plain[key]:,.2f} {unit} | {sealed[key]:,.2f} {unit} | {ratio:.2f}x |")
    print(
        f"per block: copy {prim['copy_us']:.0f} us, AES-GCM seal {prim['seal_us']:.0f} us "
        f"({prim['seal_us'] / prim['copy_us']:.1f}x the copy), open {prim['open_us']:.0f} us "
        f"({prim['open_us'] / prim['copy_us']:.1f}x)"
    )


if __name__ == "__main__":
    ARGS = parse_args()
    info = cpu()
    print(f"config: {vars(ARGS)}", flush=True)
    print(f"cpu: {info['model']}, {info['cores']} cores, flags {' '.join(info['flags'])}")
    result = main(ARGS)
    report(ARGS, result)
    if ARGS.json:
        Path(ARGS.json).write_text(json.dumps({"cpu": info, "config": vars(ARGS), **result}))
