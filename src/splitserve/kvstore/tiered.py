"""The tier ladder: look up top-down, promote hits, demote evictions, write through behind.

::

    put ──▶ tier 0 (host RAM) ──evicted──┐
              │ write-through            ▼
              └──────────────▶ [writer queue] ──▶ tier 1 (disk) ──evicted──▶ dropped
    get ◀── first tier that hits, copied into tier 0 (promotion)

Only the writer thread touches lower tiers on the ``put`` path, so ``put`` costs a RAM copy
and a queue append, never disk I/O. Blocks waiting in the queue stay readable from a
pending map, so a block in flight between tiers is never a spurious miss.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from splitserve.kvstore.base import BlockHash, BlockMeta, KVTier, StoredBlock, TierUsage, to_block

_STOP = object()


class Erased(NamedTuple):
    """What ``TieredStore.erase`` removed: blocks per tier (ladder order), queued copies."""

    per_tier: list[int]
    queued: int


@dataclass(slots=True)
class TieredStats:
    """Counters for ``/metrics``: hits per tier index, and traffic between tiers."""

    hits: list[int] = field(default_factory=list)
    misses: int = 0
    pending_hits: int = 0
    promotions: int = 0
    demotions: int = 0
    write_throughs: int = 0
    dropped_writes: int = 0  # the queue was full: the block is recomputed if needed again
    write_errors: int = 0


class TieredStore:
    """A ladder of :class:`KVTier` s, fastest first (for example ``[HostTier, DiskTier]``).

    ``write_through`` also persists every ``put`` to the lower tiers, in the background, so
    that a session's blocks survive a restart and not only once evicted from RAM. Call
    :meth:`close` (on SIGTERM) to finish pending writes.
    """

    def __init__(
        self, tiers: list[KVTier], write_through: bool = True, queue_size: int = 4096
    ) -> None:
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        self.tiers = list(tiers)
        self.write_through = write_through
        self.stats = TieredStats(hits=[0] * len(self.tiers))
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        # Blocks queued for a lower tier, still readable meanwhile; guarded by _cv.
        self._pending: dict[BlockHash, StoredBlock] = {}
        self._in_flight = 0
        self._writing: BlockHash | None = None  # the hash the writer is storing right now
        self._cv = threading.Condition()
        self._closed = False
        for i, tier in enumerate(self.tiers[:-1]):
            tier.set_evict_listener(lambda evicted, i=i: self._demote(i + 1, evicted))
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()

    # -- foreground --------------------------------------------------------------------

    def put(
        self,
        block_hash: BlockHash,
        data: bytes | bytearray | memoryview | np.ndarray,
        meta: BlockMeta | None = None,
    ) -> bool:
        """Store in the top tier now; write through to the lower tiers in the background."""
        block = to_block(data, meta)
        stored = self.tiers[0].put(block_hash, block.data, block.meta)
        if self.write_through and len(self.tiers) > 1:
            if self._enqueue(block_hash, block, range(1, len(self.tiers))):
                self.stats.write_throughs += 1
        return stored

    def load(self, block_hash: BlockHash) -> StoredBlock | None:
        """The block from the fastest tier holding it, promoted into the top tier; else None."""
        for i, tier in enumerate(self.tiers):
            block = tier.load(block_hash)
            if block is not None:
                self.stats.hits[i] += 1
                if i > 0:
                    self._promote(block_hash, block)
                return block
        with self._cv:
            block = self._pending.get(block_hash)
        if block is not None:
            self.stats.pending_hits += 1
            self._promote(block_hash, block)
            return block
        self.stats.misses += 1
        return None

    def get(self, block_hash: BlockHash) -> bytes | None:
        """The block's bytes from the fastest tier holding it, or None."""
        block = self.load(block_hash)
        return None if block is None else block.data

    def contains(self, block_hash: BlockHash) -> bool:
        with self._cv:
            if block_hash in self._pending:
                return True
        return any(tier.contains(block_hash) for tier in self.tiers)

    def evict(self, block_hash: BlockHash) -> bool:
        """Drop the block from every tier (a queued write may still land afterwards)."""
        return any([tier.evict(block_hash) for tier in self.tiers])

    def erase(self, hashes: Iterable[BlockHash]) -> Erased:
        """Remove ``hashes`` from every tier for good: from the top tier, from the write
        queue (a queued copy is never written), then from the lower tiers (a disk file is
        unlinked), after any write of them under way has landed.

        Callers keep other threads from putting these blocks meanwhile (the engine lets its
        mover finish first): a block put again while it is erased may survive."""
        wanted = set(hashes)
        top = sum(self.tiers[0].evict(h) for h in wanted)
        with self._cv:
            queued = sum(self._pending.pop(h, None) is not None for h in wanted)
            while self._writing in wanted:
                self._cv.wait()
        lower = [sum(tier.evict(h) for h in wanted) for tier in self.tiers[1:]]
        return Erased([top, *lower], queued)

    def usage(self) -> list[TierUsage]:
        """Usage of each tier, in ladder order."""
        return [tier.usage() for tier in self.tiers]

    def _promote(self, block_hash: BlockHash, block: StoredBlock) -> None:
        if self.tiers[0].put(block_hash, block.data, block.meta):
            self.stats.promotions += 1

    def _demote(self, target: int, evicted: Iterable[tuple[BlockHash, StoredBlock]]) -> None:
        for block_hash, block in evicted:
            with self._cv:
                queued = block_hash in self._pending
            if queued or self.tiers[target].contains(block_hash):
                continue  # already written (or being written) through: nothing to copy
            if self._enqueue(block_hash, block, [target]):
                self.stats.demotions += 1

    def _enqueue(self, block_hash: BlockHash, block: StoredBlock, targets: Iterable[int]) -> bool:
        # Never block the caller (the engine step): a full queue drops the copy instead.
        with self._cv:
            if self._closed:
                return False
            try:
                self._queue.put_nowait((block_hash, block, tuple(targets)))
            except queue.Full:
                self.stats.dropped_writes += 1
                return False
            self._pending[block_hash] = block
            self._in_flight += 1
        return True

    # -- background writer -------------------------------------------------------------

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            block_hash, block, targets = item
            with self._cv:
                # Not pending any more: erased meanwhile, or queued again (that copy writes).
                wanted = self._pending.get(block_hash) is block
                self._writing = block_hash if wanted else None
            for i in targets if wanted else ():
                try:
                    self.tiers[i].put(block_hash, block.data, block.meta)
                except Exception:
                    # One bad write must not kill the writer; the block is simply not stored.
                    self.stats.write_errors += 1
            with self._cv:
                self._in_flight -= 1
                self._writing = None
                if self._pending.get(block_hash) is block:
                    del self._pending[block_hash]
                self._cv.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write has landed; False if ``timeout_s`` ran out first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while self._in_flight:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cv.wait(remaining)
        return True

    def close(self, timeout_s: float | None = 5.0) -> bool:
        """Finish pending writes (within ``timeout_s``) and stop the writer; True if all landed."""
        with self._cv:
            self._closed = True
        flushed = self.flush(timeout_s)
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            return False  # flush timed out; the daemon writer dies with the process
        self._writer.join(timeout_s)
        return flushed
