"""The model runner's half of the KV tier ladder: copies whole blocks between the engine's
KV cache tensor and a ``TieredStore``, on one background thread.

The engine thread hands over ``BlockCopy`` batches (decided by ``engine.tiering``) and
collects ``CopyDone`` s between steps; it never waits for a copy unless it has nothing else
to run. A saved block is gathered, then put into the store (host RAM now, disk behind it);
a load reads the store and scatters into device blocks reserved for it. Both are safe while
the engine steps: the policy holds a reference on the blocks of every copy in flight.
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from splitserve.engine.kv_pages import (
    PagedBytes,
    as_bytes,
    block_nbytes,
    block_shape,
    dtype_name,
    gather_blocks,
    scatter_blocks,
)
from splitserve.engine.tiering import BlockCopy, CopyDone
from splitserve.kvstore import BlockMeta, TieredStore

# Loads first: a request waits on them, while a save only has to land before its block is
# needed again. Saves keep their order among themselves (a counter breaks ties).
_LOAD, _SAVE, _STOP = 0, 1, 2
# The mover shares the GIL with the engine's step. At Python's default 5 ms switch interval
# each GIL hand-over can wait out a whole interval behind the step's Python code: a 128-block
# host-RAM load took 5-8x longer while four requests decoded (benchmarks/kv_tier_overlap.py).
SWITCH_INTERVAL_S = 0.0005
# Hears of each load: (the slowest tier it read, seconds, blocks loaded).
LoadObserver = Callable[[str, float, int], None]  # (tier, seconds, blocks)


class KVMover:
    """Moves block bytes for the tier ladder; ``tier_names`` label the store's tiers."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        store: TieredStore,
        tier_names: list[str],
        on_load: LoadObserver | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.store = store
        self.tier_names = tier_names
        self.on_load = on_load
        self.meta = BlockMeta(dtype_name(kv_cache.dtype), block_shape(kv_cache))
        self.block_nbytes = block_nbytes(kv_cache)
        # A host cache is copied with numpy: torch would open an OpenMP team on this thread,
        # and two teams slow every engine step (omp_teams.py).
        host = kv_cache.device.type == "cpu" and kv_cache.is_contiguous()
        self.pages = PagedBytes.of_cache(kv_cache) if host else None
        self._jobs: queue.PriorityQueue[tuple[int, int, BlockCopy | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._done: list[CopyDone] = []
        self._cv = threading.Condition()
        self._pending = 0
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name="kv-tier-mover", daemon=True)
        self._thread.start()

    # ---- engine thread -------------------------------------------------------------------

    def submit(self, copies: list[BlockCopy]) -> None:
        with self._cv:
            self._pending += len(copies)
        for copy in copies:
            priority = _LOAD if copy.kind == "load" else _SAVE
            self._jobs.put((priority, next(self._order), copy))

    def completed(self) -> list[CopyDone]:
        """Copies finished since the last call."""
        with self._cv:
            done, self._done = self._done, []
        return done

    def wait(self, timeout_s: float) -> None:
        """Sleep until a copy finishes or ``timeout_s`` passes (the engine has nothing to run)."""
        with self._cv:
            if not self._done and self._pending:
                self._cv.wait(timeout_s)

    def idle(self) -> bool:
        """Whether every copy submitted has finished and been collected."""
        with self._cv:
            return not self._pending and not self._done

    def drain(self, timeout_s: float) -> bool:
        """Wait until every copy submitted has finished; False if ``timeout_s`` ran out."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending, timeout_s)

    def close(self, timeout_s: float = 5.0) -> bool:
        """Finish the copies already submitted, then stop; True if the thread ended in time."""
        self._jobs.put((_STOP, next(self._order), None))
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ---- mover thread --------------------------------------------------------------------

    def _run(self) -> None:
        while (copy := self._jobs.get()[2]) is not None:
            try:
                ok = self._save(copy) if copy.kind == "save" else self._load(copy)
            except Exception:  # a failed copy is a miss or an unsaved block, never a crash
                ok = 0
            with self._cv:
                self._done.append(CopyDone(copy.copy_id, ok))
                self._pending -= 1
                self._cv.notify_all()

    def _save(self, copy: BlockCopy) -> int:
        if self.pages is not None:
            rows = self.pages.gather(copy.block_ids)
        else:
            rows = as_bytes(gather_blocks(self.kv_cache, copy.block_ids).cpu())
        pairs = zip(copy.hashes, rows, strict=True)
        return sum(self.store.put(h, row, self.meta) for h, row in pairs)

    def _load(self, copy: BlockCopy) -> int:
        start = time.perf_counter()
        lowest = max(self._tier_of(h) for h in copy.hashes)
        buf = np.empty((len(copy.hashes), self.block_nbytes), dtype=np.uint8)
        n = 0
        for h in copy.hashes:
            block = self.store.load(h)
            if block is None or block.meta != self.meta:
                break  # the rest of the prefix is recomputed
            buf[n] = np.frombuffer(block.data, dtype=np.uint8)
            n += 1
        if n and self.pages is not None:
            for block, row in zip(copy.block_ids[:n], buf[:n], strict=True):
                self.pages.write_block(block, row)
        elif n:
            data = torch.from_numpy(buf[:n]).view(self.kv_cache.dtype)
            scatter_blocks(self.kv_cache, copy.block_ids[:n], data.view(n, *self.meta.shape))
        if self.on_load is not None:
            self.on_load(self.tier_names[lowest], time.perf_counter() - start, n)
        return n

    def _tier_of(self, block_hash: bytes) -> int:
        for i, tier in enumerate(self.store.tiers):
            if tier.contains(block_hash):
                return i
        return 0  # in the write queue between tiers: as fast as the top tier
