"""The tier interface of the KV store: one content-addressed block store per memory tier.

Every tier is keyed by the salted block hash of :mod:`splitserve.common.kv_hash`. Because
that hash covers the model, the tenant salt and the whole token prefix, equal keys mean
equal KV: a tier never needs to know which session a block came from, and blocks are
shared between sessions of one tenant but never across salts.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from splitserve.common.kv_hash import BlockHash

MAX_NDIM = 8
MAX_DTYPE_LEN = 16


@dataclass(slots=True, frozen=True)
class BlockMeta:
    """How to view a block's bytes as an array: a dtype string and a shape.

    ``dtype`` is a numpy dtype string (``"<f2"``) or any short ASCII name numpy lacks
    (``"bfloat16"``); the byte size is checked against the shape only when numpy knows it.
    """

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.dtype or len(self.dtype.encode("ascii")) > MAX_DTYPE_LEN:
            raise ValueError(f"dtype must be 1..{MAX_DTYPE_LEN} ASCII chars: {self.dtype!r}")
        if len(self.shape) > MAX_NDIM or any(d < 0 for d in self.shape):
            raise ValueError(f"shape must have <= {MAX_NDIM} non-negative dims: {self.shape}")

    def expected_nbytes(self) -> int | None:
        """Byte size implied by dtype and shape, or None when numpy does not know the dtype."""
        try:
            itemsize = np.dtype(self.dtype).itemsize
        except TypeError:
            return None
        return itemsize * math.prod(self.shape)


class StoredBlock(NamedTuple):
    """A block as a tier returns it: immutable bytes plus the meta it was stored with."""

    data: bytes
    meta: BlockMeta

    def to_numpy(self) -> np.ndarray:
        """A read-only array view of the bytes (numpy dtypes only)."""
        return np.frombuffer(self.data, dtype=np.dtype(self.meta.dtype)).reshape(self.meta.shape)


@dataclass(slots=True, frozen=True)
class TierUsage:
    """What a tier holds against its bound."""

    bytes_used: int
    bytes_capacity: int
    blocks: int


EvictListener = Callable[[Iterable[tuple[BlockHash, StoredBlock]]], None]


def to_block(
    data: bytes | bytearray | memoryview | np.ndarray, meta: BlockMeta | None
) -> StoredBlock:
    """Normalise what callers pass to ``put`` into immutable bytes and a checked meta.

    An array brings its own meta (``meta`` may be omitted); raw bytes default to ``|u1``.
    """
    if isinstance(data, np.ndarray):
        arr = np.ascontiguousarray(data)
        meta = meta or BlockMeta(arr.dtype.str, tuple(arr.shape))
        payload = arr.tobytes()
    else:
        payload = bytes(data)
        meta = meta or BlockMeta("|u1", (len(payload),))
    expected = meta.expected_nbytes()
    if expected is not None and expected != len(payload):
        raise ValueError(f"{meta} implies {expected} bytes, got {len(payload)}")
    return StoredBlock(payload, meta)


class KVTier(ABC):
    """One tier of the KV ladder (host RAM, local disk, ...).

    Contract:

    * Content-addressed: ``block_hash`` is the salted block hash from
      ``splitserve.common.kv_hash``; a block stored under a hash never changes, so ``put``
      of a hash already held only refreshes its recency.
    * Bounded: ``usage().bytes_used <= usage().bytes_capacity`` at all times; a tier makes
      room by evicting its least-recently-used blocks and reports them to the evict
      listener, so that a tiered store can demote them instead of dropping them.
    * A miss is ``None``, never an exception: a block that is missing, corrupt, fails its
      checksum, carries a wrong header or cannot be decrypted is a miss (the caller
      recomputes the prefix), and the tier discards it.
    * Thread-safe: every method may be called from any thread.
    """

    _evict_listener: EvictListener | None = None

    def set_evict_listener(self, listener: EvictListener | None) -> None:
        """Call ``listener`` with the (hash, block) pairs this tier evicts to make room."""
        self._evict_listener = listener

    def _notify_evicted(self, evicted: list[tuple[BlockHash, StoredBlock]]) -> None:
        # Called outside the tier's lock so that a listener may call back into tiers.
        if evicted and self._evict_listener is not None:
            self._evict_listener(evicted)

    @abstractmethod
    def put(
        self,
        block_hash: BlockHash,
        data: bytes | bytearray | memoryview | np.ndarray,
        meta: BlockMeta | None = None,
    ) -> bool:
        """Store a block; False when it cannot be held (larger than the tier, I/O error)."""

    @abstractmethod
    def load(self, block_hash: BlockHash) -> StoredBlock | None:
        """The block and its meta, or None on a miss; a hit counts as a use for LRU."""

    def get(self, block_hash: BlockHash) -> bytes | None:
        """The block's bytes, or None on a miss."""
        block = self.load(block_hash)
        return None if block is None else block.data

    @abstractmethod
    def contains(self, block_hash: BlockHash) -> bool:
        """Whether the tier holds the block (without counting as a use)."""

    @abstractmethod
    def evict(self, block_hash: BlockHash) -> bool:
        """Drop the block without notifying the evict listener; False if it was not held."""

    @abstractmethod
    def usage(self) -> TierUsage:
        """Bytes and blocks held against the tier's capacity."""
