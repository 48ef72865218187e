"""Helpers for transfer tests: a tiny fake KV cache, hash chains, a prefill-side peer."""

from __future__ import annotations

import os
import time

import torch

from splitserve.common.kv_hash import hash_blocks, root_hash
from splitserve.engine.kv_pages import KVCacheBlocks
from splitserve.engine.shm_cache import SharedKVCache
from splitserve.transfer import (
    KVConnectorScheduler,
    LeaseTable,
    LoadPlan,
    RemoteKV,
    TransferConfig,
    build_transfer_params,
    get_connector,
)
from splitserve.transfer.base import KVServer

L, NUM_BLOCKS, BS, KVH, HD = 2, 32, 4, 2, 8
CACHE_SHAPE = (L, 2, NUM_BLOCKS, BS, KVH, HD)
BLOCK_NBYTES = L * 2 * BS * KVH * HD * 4  # float32
SECRET = b"test-cluster-secret-0123456789ab"
SHM_DIR = "/dev/shm"


def make_cache(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(CACHE_SHAPE, generator=gen).to(dtype)


def chain(num_blocks: int) -> list[bytes]:
    return hash_blocks(list(range(num_blocks * BS)), root_hash("tiny-model"), BS)


def shm_segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


class Peer:
    """A prefill side (cache, lease table, started server) for one test. ``shared``: the
    cache lives in shared memory, as a prefill worker's on the shm transport does."""

    def __init__(
        self,
        transport: str,
        config: TransferConfig,
        shm_prefix: str,
        shared: bool = False,
        **server: object,
    ) -> None:
        self.transport = transport
        self.shared = (
            SharedKVCache(CACHE_SHAPE, torch.float32, f"{shm_prefix}cache-") if shared else None
        )
        self.cache = make_cache(0)
        if self.shared is not None:
            self.cache = self.shared.tensor.copy_(self.cache)
        self.ended: list[tuple[str, str]] = []
        self.leases = LeaseTable(
            on_end=lambda lease, why: self.ended.append((lease.request_id, why))
        )
        connector = get_connector(transport, config)
        kwargs = {"segment_prefix": shm_prefix, **server} if transport == "shm" else server
        segment = self.shared.name if self.shared is not None else None
        self.server: KVServer = connector.make_server(
            KVCacheBlocks(self.cache, shm_segment=segment), self.leases, **kwargs
        )
        self.host, self.port = self.server.start()

    def close(self) -> None:
        self.server.stop()
        if self.shared is not None:
            self.shared.close()

    def offer(
        self, request_id: str, block_ids: list[int], num_hashed: int | None = None
    ) -> RemoteKV:
        """Lease ``block_ids`` and return what the prefill worker would answer."""
        hashes = chain(len(block_ids) if num_hashed is None else num_hashed)
        self.leases.grant(request_id, block_ids, hashes)
        params = build_transfer_params(
            engine_id="prefill-0",
            request_id=request_id,
            block_ids=block_ids,
            block_hashes=hashes,
            host=self.host,
            port=self.port,
            transport=self.transport,
            block_size=BS,
            kv_dtype="float32",
            kv_block_shape=(L, 2, BS, KVH, HD),
        )
        return RemoteKV.from_params(params)


def plan_all(remote: RemoteKV, held: set[bytes] | None = None) -> LoadPlan:
    return KVConnectorScheduler(BS).plan_load(remote, held or set())


def assert_blocks_equal(src: torch.Tensor, src_ids, dst: torch.Tensor, dst_ids) -> None:
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(dst[:, :, d], src[:, :, s]), f"block {s} -> {d} differs"


def client(kind: str, **config: object):
    """A client for ``kind`` (a transport name, or ``shm-shared``)."""
    cfg = TransferConfig(secret=config.pop("secret", SECRET), **config)  # type: ignore[arg-type]
    return get_connector(kind.partition("-")[0], cfg).make_client()


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
