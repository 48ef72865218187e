"""Host-RAM tier: a bounded LRU of immutable byte blocks, optionally sealed (AES-256-GCM)."""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from typing import NamedTuple

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
from splitserve.kvstore.keyring import KeyRing, SealError, new_nonce


class Sealed(NamedTuple):
    """A block as an encrypted host tier holds it: ciphertext and tag, and what opens it."""

    data: bytes  # AES-GCM(payload) + tag
    meta: BlockMeta
    key_id: bytes
    nonce: bytes


class HostTier(KVTier):
    """Blocks in host memory, evicted least-recently-used first when ``capacity_bytes`` is hit.

    Capacity counts the bytes held per block: the payload, or with ``keyring`` its ciphertext
    and 16-byte tag. With ``keyring`` every block is sealed under the ring's current key, its
    block hash, meta and key id bound as associated data, so RAM never holds a block's
    plaintext; blocks are opened on load and on eviction. Evicted blocks go to ``on_evict``
    (a tiered store demotes them to the next tier).
    """

    def __init__(
        self,
        capacity_bytes: int,
        on_evict: EvictListener | None = None,
        keyring: KeyRing | None = None,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.keyring = keyring
        self.decrypt_failures = 0
        self._blocks: OrderedDict[BlockHash, StoredBlock | Sealed] = OrderedDict()  # oldest first
        self._bytes_used = 0
        self._lock = threading.Lock()
        self.set_evict_listener(on_evict)

    def put(
        self,
        block_hash: BlockHash,
        data: bytes | bytearray | memoryview | np.ndarray,
        meta: BlockMeta | None = None,
    ) -> bool:
        with self._lock:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                return True
        entry = self._seal(block_hash, to_block(data, meta))  # outside the lock: it is slow
        size = len(entry.data)
        if size > self.capacity_bytes:
            return False
        with self._lock:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                return True
            evicted = self._make_room(size)
            self._blocks[block_hash] = entry
            self._bytes_used += size
        self._notify_evicted(self._open_all(evicted))
        return True

    def _make_room(self, size: int) -> list[tuple[BlockHash, StoredBlock | Sealed]]:
        evicted = []
        while self._bytes_used + size > self.capacity_bytes:
            victim, block = self._blocks.popitem(last=False)
            self._bytes_used -= len(block.data)
            evicted.append((victim, block))
        return evicted

    def load(self, block_hash: BlockHash) -> StoredBlock | None:
        with self._lock:
            entry = self._blocks.get(block_hash)
            if entry is not None:
                self._blocks.move_to_end(block_hash)
        if entry is None or isinstance(entry, StoredBlock):
            return entry
        block = self._open(block_hash, entry)
        if block is None:
            self.evict(block_hash)
        return block

    # -- sealing -----------------------------------------------------------------------

    def _seal(self, block_hash: BlockHash, block: StoredBlock) -> StoredBlock | Sealed:
        if self.keyring is None:
            return block
        kid, nonce = self.keyring.current, new_nonce()
        body = self.keyring.seal(nonce, block.data, _aad(block_hash, block.meta, kid))
        return Sealed(body, block.meta, kid, nonce)

    def _open(self, block_hash: BlockHash, entry: Sealed) -> StoredBlock | None:
        aad = _aad(block_hash, entry.meta, entry.key_id)
        try:
            payload = self.keyring.open(entry.key_id, entry.nonce, entry.data, aad)
        except SealError:
            self.decrypt_failures += 1
            return None
        return StoredBlock(payload, entry.meta)

    def _open_all(self, evicted: list[tuple[BlockHash, StoredBlock | Sealed]]):
        opened = []
        for block_hash, entry in evicted:
            block = entry if isinstance(entry, StoredBlock) else self._open(block_hash, entry)
            if block is not None:
                opened.append((block_hash, block))
        return opened

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


def _aad(block_hash: BlockHash, meta: BlockMeta, key_id: bytes) -> bytes:
    """What a sealed host block is bound to: its hash, its meta and its key id."""
    dtype = meta.dtype.encode("ascii")
    shape = struct.pack(f"<B{len(meta.shape)}Q", len(meta.shape), *meta.shape)
    return b"splitserve-host-kv\0" + block_hash + key_id + bytes([len(dtype)]) + dtype + shape
