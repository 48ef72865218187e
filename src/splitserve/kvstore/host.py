"""Host-RAM tier: a bounded LRU of immutable byte blocks."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from splitserve.kvstore.base import (
    BlockHash,
    BlockMeta,
    EvictListener,
    KVTier,
    StoredBlock,
    TierUsage,
    to_block,
)


class HostTier(KVTier):
    """Blocks in host memory, evicted least-recently-used first when ``capacity_bytes`` is hit.

    Capacity counts payload bytes only; evicted blocks go to ``on_evict`` (a tiered store
    demotes them to the next tier).
    """

    def __init__(self, capacity_bytes: int, on_evict: EvictListener | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[BlockHash, StoredBlock] = OrderedDict()  # oldest first
        self._bytes_used = 0
        self._lock = threading.Lock()
        self.set_evict_listener(on_evict)

    def put(
        self,
        block_hash: BlockHash,
        data: bytes | bytearray | memoryview | np.ndarray,
        meta: BlockMeta | None = None,
    ) -> bool:
        block = to_block(data, meta)
        size = len(block.data)
        if size > self.capacity_bytes:
            return False
        with self._lock:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                return True
            evicted = self._make_room(size)
            self._blocks[block_hash] = block
            self._bytes_used += size
        self._notify_evicted(evicted)
        return True

    def _make_room(self, size: int) -> list[tuple[BlockHash, StoredBlock]]:
        evicted = []
        while self._bytes_used + size > self.capacity_bytes:
            victim, block = self._blocks.popitem(last=False)
            self._bytes_used -= len(block.data)
            evicted.append((victim, block))
        return evicted

    def load(self, block_hash: BlockHash) -> StoredBlock | None:
        with self._lock:
            block = self._blocks.get(block_hash)
            if block is not None:
                self._blocks.move_to_end(block_hash)
            return block

    def contains(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def evict(self, block_hash: BlockHash) -> bool:
        with self._lock:
            block = self._blocks.pop(block_hash, None)
            if block is None:
                return False
            self._bytes_used -= len(block.data)
            return True

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self._bytes_used, self.capacity_bytes, len(self._blocks))

    def lru_order(self) -> list[BlockHash]:
        """Held hashes, least recently used first (the order they would be evicted in)."""
        with self._lock:
            return list(self._blocks)
