"""KV transfer throughput against its physical peers, measured in the same run.

A prefill-side process serves blocks of a KV cache shaped like the default model's
(SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, float32, 16-token blocks = 737,280 bytes
per block); this process pulls them into its own cache, for prompts of 256, 1,000 and 4,000
tokens (16, 63 and 250 blocks), scattered over random block ids. Reported per size:

* ``tcp`` (checksums on, encryption off and on) vs a raw loopback socket moving the same
  number of bytes between the same two processes (goal: >= 70%).
* ``shm`` vs an in-memory copy of the same bytes in one process (goal: >= 50%): a plain
  ``memcpy`` of one contiguous buffer, and ``block copy``, the same blocks copied from one
  cache into the other in one process, one pass per block (no checksums). The serving cache
  lives in shared memory, as a prefill worker's on this transport does, so ``shm`` copies
  each block once, straight out of it (no checksums: the lease keeps the blocks still);
  ``shm+checksums`` adds the optional per-block checksums (``--kv-shm-checksums``).
  ``shm staged`` serves a private copy of the cache (the fallback: each block is copied
  into a staging segment first, two copies).

Every figure is the median of ``--repeats`` timed runs after ``--warmup`` untimed ones, with
each method run in turn inside a repetition so that machine load hits them alike. The added
latency of the remote leg end to end (HTTP, engine) needs the integrated workers and is not
measured here.

    python benchmarks/kv_transfer.py [--blocks 16,63,250] [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import struct
import time
from collections.abc import Callable

import torch

from splitserve.engine.kv_pages import KVCacheBlocks, gather_blocks
from splitserve.engine.shm_cache import SharedKVCache
from splitserve.transfer import (
    KVConnectorScheduler,
    LeaseTable,
    RemoteKV,
    TransferConfig,
    build_transfer_params,
    get_connector,
)

SECRET = b"benchmark-cluster-secret-32bytes"
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", default="16,63,250", help="blocks per pull (comma-separated)")
    p.add_argument("--cache-blocks", type=int, default=300, help="blocks in each side's cache")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args()


SHAPE = (LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)


def make_cache(num_blocks: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE[:2] + (num_blocks,) + SHAPE[2:], generator=gen)


def block_ids(args: argparse.Namespace, n: int, salt: int) -> list[int]:
    gen = torch.Generator().manual_seed(args.seed + salt)
    return torch.randperm(args.cache_blocks, generator=gen)[:n].tolist()


# ---- the prefill-side process --------------------------------------------------------------


def serve(args: argparse.Namespace, sizes: list[int], conn) -> None:  # noqa: ANN001
    """Child: KV servers (tcp, tcp+AES-GCM, shm from a shared cache and from a private one)
    and a raw socket sender, all over the same cache contents."""
    torch.set_num_threads(args.threads)
    private = make_cache(args.cache_blocks, args.seed)
    shared = SharedKVCache(tuple(private.shape), private.dtype)
    cache = shared.tensor.copy_(private)
    leases = LeaseTable(default_ttl_s=24 * 3600)
    for n in sizes:
        leases.grant(f"bench-{n}", block_ids(args, n, salt=1))
    source = KVCacheBlocks(cache, shm_segment=shared.name)
    plain, sealed = TransferConfig(SECRET), TransferConfig(SECRET, encrypt=True)
    checked = TransferConfig(SECRET, shm_checksums=True)
    servers = {
        "tcp": get_connector("tcp", plain).make_server(source, leases),
        "tcp+aes": get_connector("tcp", sealed).make_server(source, leases),
        "shm": get_connector("shm", plain).make_server(source, leases),
        "shm+checksums": get_connector("shm", checked).make_server(source, leases),
        "shm staged": get_connector("shm", plain).make_server(KVCacheBlocks(private), leases),
    }
    ports = {name: server.start()[1] for name, server in servers.items()}
    raw = gather_blocks(cache, block_ids(args, max(sizes), salt=1)).view(torch.uint8).numpy()
    listener = socket.create_server(("127.0.0.1", 0))
    ports["raw"] = listener.getsockname()[1]
    conn.send(ports)
    listener.settimeout(0.2)
    while not conn.poll():
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        with sock:
            (nbytes,) = struct.unpack("<Q", sock.recv(8, socket.MSG_WAITALL))
            sock.sendall(memoryview(raw.reshape(-1))[:nbytes])
    for server in servers.values():
        server.stop()
    shared.close()


def raw_pull(port: int, buf: memoryview) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(struct.pack("<Q", buf.nbytes))
        got = 0
        while got < buf.nbytes:
            n = sock.recv_into(buf[got:])
            assert n, "raw sender closed early"
            got += n


# ---- the decode side (this process) ---------------------------------------------------------


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_size(
    args: argparse.Namespace, ports: dict[str, int], n: int, clients: dict[str, object]
) -> dict[str, float]:
    dst_cache = torch.zeros_like(make_cache(args.cache_blocks, args.seed + 99))
    sink = KVCacheBlocks(dst_cache)
    dest = block_ids(args, n, salt=2)
    planner = KVConnectorScheduler(BLOCK_SIZE)
    nbytes = n * sink.block_nbytes
    raw_buf = memoryview(bytearray(nbytes))
    src_local = KVCacheBlocks(make_cache(args.cache_blocks, args.seed))
    src_ids = block_ids(args, n, salt=1)
    contiguous_src = gather_blocks(src_local.kv_cache, src_ids)
    contiguous_dst = torch.empty_like(contiguous_src)

    def pull(name: str) -> Callable[[], object]:
        transport = name.split()[0].split("+")[0]
        params = build_transfer_params(
            engine_id="bench", request_id=f"bench-{n}", block_ids=list(range(n)),
            block_hashes=[], host="127.0.0.1", port=ports[name], transport=transport,
            block_size=BLOCK_SIZE,
        )  # fmt: skip
        plan = planner.plan_load(RemoteKV.from_params(params), set())
        encrypt, checksums = name == "tcp+aes", name == "shm+checksums"
        if name not in clients:
            config = TransferConfig(SECRET, encrypt=encrypt, shm_checksums=checksums)
            clients[name] = get_connector(transport, config).make_client()
        client = clients[name]
        return lambda: client.pull(plan, sink, dest, release=False)

    def block_copy() -> None:
        for s, d in zip(src_ids, dest, strict=True):
            sink.pages.copy_block(src_local.pages, s, d)

    methods = {
        "raw socket": lambda: raw_pull(ports["raw"], raw_buf),
        "tcp": pull("tcp"),
        "tcp+aes": pull("tcp+aes"),
        "memcpy": lambda: contiguous_dst.copy_(contiguous_src),
        "block copy": block_copy,
        "shm": pull("shm"),
        "shm+checksums": pull("shm+checksums"),
        "shm staged": pull("shm staged"),
    }
    first_shm = timed(methods["shm"])  # maps the cache, faults its pages in: once per peer
    print(f"  first shm pull of {n} blocks in this process: {first_shm * 1e3:.1f} ms")
    times: dict[str, list[float]] = {name: [] for name in methods}
    for rep in range(args.warmup + args.repeats):
        for name, fn in methods.items():
            elapsed = timed(fn)
            if rep >= args.warmup:
                times[name].append(elapsed)
    for name in ("tcp", "tcp+aes", "shm", "shm+checksums", "shm staged"):  # right bytes?
        dst_cache.zero_()
        methods[name]()
        assert torch.equal(gather_blocks(dst_cache, dest), contiguous_src), f"{name} differs"
    return {name: nbytes / statistics.median(ts) / 1e9 for name, ts in times.items()}


def report(n: int, nbytes: int, gbps: dict[str, float]) -> dict[str, float]:
    ratios = {
        "tcp / raw socket": gbps["tcp"] / gbps["raw socket"],
        "tcp+aes / raw socket": gbps["tcp+aes"] / gbps["raw socket"],
        "shm / memcpy": gbps["shm"] / gbps["memcpy"],
        "shm / block copy": gbps["shm"] / gbps["block copy"],
        "shm+checksums / memcpy": gbps["shm+checksums"] / gbps["memcpy"],
        "shm staged / memcpy": gbps["shm staged"] / gbps["memcpy"],
    }
    print(f"\n{n} blocks ({n * BLOCK_SIZE} tokens, {nbytes / 2**20:.1f} MiB)")
    for name, value in gbps.items():
        print(f"  {name:<16} {value:7.2f} GB/s")
    for name, value in ratios.items():
        print(f"  {name:<22} {value:6.1%}")
    return ratios


def main() -> None:
    args = parse_args()
    sizes = [int(s) for s in args.blocks.split(",")]
    torch.set_num_threads(args.threads)
    block_bytes = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4 * BLOCK_SIZE
    print("kv_transfer benchmark", json.dumps(vars(args)))
    print(f"block: {LAYERS} layers x 2 x {BLOCK_SIZE} tokens x {KV_HEADS} heads x {HEAD_DIM} "
          f"x float32 = {block_bytes:,} bytes; cpus: {mp.cpu_count()}")  # fmt: skip
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(args, sizes, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("server process did not start within 120 s")
        ports = parent.recv()
        results, clients = {}, {}  # clients live across sizes, as in a decode worker
        for n in sizes:
            gbps = run_size(args, ports, n, clients)
            results[n] = {"gbps": gbps, "ratios": report(n, n * block_bytes, gbps)}
    finally:
        parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
