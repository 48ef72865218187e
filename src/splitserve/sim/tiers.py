"""A simulated worker's lower KV tiers: host RAM, then local disk, below its device pool.

The decisions are the real engine's. ``engine/tiering.py``'s ``Tiering`` runs on every
simulated worker, called by the real scheduler: when a waiting prompt's device prefix match
ends, it asks the tiers which of the next blocks they hold, reserves device blocks for them,
parks the sequence and queues the load; when the load lands the blocks are published in
the prefix cache and the sequence goes back to the front of the queue. The tiers' contents
are ``kvstore/host.py``'s ``HostTier``, the real LRU (a block is one byte here, so the
capacities count blocks), chained as the real ``TieredStore`` chains them: saves write
through to every tier, an eviction demotes to the next tier what it lacks, a disk hit is
promoted into host RAM. What is simulated is only the time the bytes take::

    device pool ──save: a block completes (computed, or registered from a KV pull)──▶ host ─▶ disk
        ▲                                                                              │
        └── load: latency + bytes / host link (+ bytes / disk for disk-only blocks) ───┘

- A save is done at once. The real engine copies a completed block down on the mover
  thread and holds the device block until the copy lands (milliseconds); nothing waits on
  it, and on a GPU it uses the host link's other direction.
- A load takes ``CostModel.tier_load_time``, one at a time per worker (the real engine's
  single mover thread), while the engine keeps stepping; it lands at the next step boundary.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from splitserve.common.kv_hash import BlockHash
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.sequence import Sequence
from splitserve.engine.tiering import CopyDone, Tiering
from splitserve.kvstore.base import BlockMeta, StoredBlock
from splitserve.kvstore.host import HostTier

_UNIT = StoredBlock(b"\0", BlockMeta("|u1", (1,)))  # a block's stand-in: one byte


class SimLadder:
    """The tiers ``(name, capacity in blocks)``, fastest first: ``host`` and/or ``disk``."""

    def __init__(self, tiers: Iterable[tuple[str, int]]) -> None:
        named = list(tiers)
        if not named:
            raise ValueError("a ladder needs at least one tier")
        self.names = [name for name, _ in named]
        self.tiers = [HostTier(blocks) for _, blocks in named]
        for i, tier in enumerate(self.tiers[:-1]):
            tier.set_evict_listener(lambda evicted, i=i: self._demote(i + 1, evicted))

    def contains(self, block_hash: BlockHash) -> bool:
        return any(tier.contains(block_hash) for tier in self.tiers)

    def save(self, block_hash: BlockHash) -> None:
        """Into the top tier, written through to the others."""
        for tier in self.tiers:
            tier.put(block_hash, _UNIT.data, _UNIT.meta)

    def load(self, block_hash: BlockHash) -> str | None:
        """The name of the fastest tier holding the block (a hit counts as a use; a lower
        tier's hit is promoted into the top one), or None."""
        for i, tier in enumerate(self.tiers):
            if tier.load(block_hash) is not None:
                if i:
                    self.tiers[0].put(block_hash, _UNIT.data, _UNIT.meta)
                return self.names[i]
        return None

    def held(self) -> list[int]:
        """Blocks each tier holds, in ladder order."""
        return [tier.usage().blocks for tier in self.tiers]

    def _demote(self, target: int, evicted: Iterable[tuple[BlockHash, StoredBlock]]) -> None:
        for block_hash, block in evicted:
            if not self.tiers[target].contains(block_hash):
                self.tiers[target].put(block_hash, block.data, block.meta)


class TierLoad(NamedTuple):
    """One load as read from the tiers: its copy id and where its blocks were found."""

    copy_id: int
    host_blocks: int
    disk_blocks: int

    @property
    def blocks(self) -> int:
        return self.host_blocks + self.disk_blocks


class SimTiering(Tiering):
    """The real tier policy over a ``SimLadder``; saves land at once (module docstring)."""

    def __init__(self, block_manager: BlockManager, ladder: SimLadder) -> None:
        super().__init__(block_manager, ladder)
        self.ladder = ladder

    def on_cached(self, published: list[tuple[int, BlockHash]]) -> None:
        """As the real one: every completed block no lower tier holds yet goes down."""
        ladder = self.ladder
        for _, block_hash in published:
            if not ladder.contains(block_hash):
                ladder.save(block_hash)
                self.stats.blocks_saved += 1

    def take_loads(self) -> list[TierLoad]:
        """The loads decided since the last call, their blocks read from the tiers now; a
        load stops at its first miss, as the real mover's does."""
        loads = []
        for copy in self.take_copies():  # only loads: saves never queue a copy here
            found = {"host": 0, "disk": 0}
            for block_hash in copy.hashes:
                tier = self.ladder.load(block_hash)
                if tier is None:
                    break
                found[tier] += 1
            loads.append(TierLoad(copy.copy_id, found["host"], found["disk"]))
        return loads

    def land(self, load: TierLoad) -> list[Sequence]:
        """Publish a finished load; the sequences to put back in the queue, in order."""
        return self.complete(CopyDone(load.copy_id, load.blocks))
