"""The scheduler's half of the KV tier ladder: which blocks to copy, never the bytes.

Pure Python, no torch (the simulator may drive it). The model runner's half, ``KVMover``,
moves the bytes on a background thread and reports back with ``CopyDone``::

    device pool ──save: a block just completed──▶ lower tiers (host RAM ─▶ disk)
        ▲                                               │
        └──load: a waiting prompt's prefix misses here ─┘

Saves run when a block completes, so a cached block evicted from the device pool later is
already one tier down: eviction is the demotion, and nothing is copied on the hot path. A
copy holds a reference on its device blocks until it is done, so a block is never reused
while its bytes are read, nor read by the model while they are written.

Retention: a finished request may keep its leading blocks pinned in the device pool for a
TTL (``kv_retention.ttl_s``, or the default after a reply that called tools), at most
``quota_blocks`` per session and ``max_pinned_blocks`` in all; when a pin expires (or a
newer pin needs the room) its blocks go to the head of the eviction queue, down the ladder.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

from splitserve.common.kv_hash import BlockHash, hash_blocks
from splitserve.engine.block_manager import BlockManager, PrefixMatch
from splitserve.engine.sequence import Sequence


class LowerTiers(Protocol):
    """What the policy asks of the tier store: an in-memory index lookup, no I/O."""

    def contains(self, block_hash: BlockHash) -> bool: ...


@dataclass(slots=True)
class BlockCopy:
    """One batch of whole-block copies between the device pool and the lower tiers.

    A load fills ``block_ids`` (reserved, in no block table) with the KV stored under
    ``hashes``, the consecutive full blocks of ``token_ids`` (which holds just their tokens).
    """

    copy_id: int
    kind: Literal["save", "load"]
    block_ids: list[int]
    hashes: list[BlockHash]
    token_ids: list[int] = field(default_factory=list)
    request_id: str | None = None  # the sequence a load is for (None: a prefetch)
    # A load's device prefix (the cached blocks it extends), kept from eviction meanwhile.
    prefix_ids: list[int] = field(default_factory=list)
    root: BlockHash | None = None  # a load's chain's root hash (KV events name its salt)


class Admission(enum.Enum):
    COMPUTE = "compute"  # nothing below to load: admit and compute as usual
    LOADING = "loading"  # a load (its own, or a prefetch's) brings its prefix; it waits
    WAIT = "wait"  # lower tiers hold its prefix, but no free blocks to load into yet


class CopyDone(NamedTuple):
    copy_id: int
    num_ok: int  # leading blocks copied and verified (a load stops at its first miss)


@dataclass(slots=True)
class RetentionConfig:
    default_ttl_s: float = 30.0
    quota_blocks: int = 1 << 30  # per session
    max_pinned_blocks: int = 1 << 30  # all sessions together

    def __post_init__(self) -> None:
        if self.default_ttl_s < 0:
            raise ValueError(f"retention TTL must be >= 0, got {self.default_ttl_s}")
        if self.quota_blocks < 0 or self.max_pinned_blocks < 0:
            raise ValueError("retention quotas must be >= 0")


@dataclass(slots=True)
class _Pin:
    block_ids: list[int]
    expires_at: float


@dataclass(slots=True)
class TieringStats:
    loads: int = 0  # load batches started
    blocks_loaded: int = 0  # blocks promoted into the device pool
    load_misses: int = 0  # blocks a load expected but could not use (corrupt, wrong key)
    blocks_saved: int = 0
    device_demotions: int = 0  # cached blocks evicted from the pool, their KV one tier down
    pins: int = 0
    pins_expired: int = 0


class Tiering:
    """Decides saves, loads and pins for one engine; call from the engine thread only."""

    def __init__(
        self,
        block_manager: BlockManager,
        lower: LowerTiers | None,
        retention: RetentionConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bm = block_manager
        self.lower = lower
        self.retention = retention or RetentionConfig()
        self.clock = clock
        self.stats = TieringStats()
        self.loading: dict[str, Sequence] = {}  # sequences waiting for their load
        self._copies: list[BlockCopy] = []  # decided, not yet handed to the mover
        self._in_flight: dict[int, BlockCopy] = {}
        self._arriving: set[BlockHash] = set()  # hashes of loads in flight
        self._waiters: dict[int, list[str]] = {}  # load id -> others waiting for it
        self._ids = itertools.count()
        self._pins: OrderedDict[str, _Pin] = OrderedDict()  # oldest first
        if lower is not None:
            block_manager.on_evict = self._on_evict

    # ---- queries -------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a load is in flight (the engine must keep stepping to land it)."""
        return bool(self.loading or self._arriving)

    @property
    def loads_in_flight(self) -> int:
        return sum(1 for c in self._in_flight.values() if c.kind == "load")

    @property
    def pinned_blocks(self) -> int:
        return sum(len(p.block_ids) for p in self._pins.values())

    def take_copies(self) -> list[BlockCopy]:
        """The copies decided since the last call, now in flight (for the mover)."""
        copies, self._copies = self._copies, []
        for copy in copies:
            self._in_flight[copy.copy_id] = copy
        return copies

    # ---- loads ---------------------------------------------------------------------------

    def start_load(self, seq: Sequence, match: PrefixMatch) -> Admission:
        """On admission: if lower tiers hold blocks that extend ``match``, reserve device
        blocks for them and queue a load (``LOADING``: ``seq`` now waits in ``loading``), or
        ``WAIT`` for free blocks to load into; ``COMPUTE`` when there is nothing to load.
        When a load in flight (a prefetch) already brings its next block, ``seq`` waits for
        that one (``LOADING``), out of the queue, so requests behind it are not held up."""
        if self.lower is None or seq.tier_checked:
            return Admission.COMPUTE
        end = self.bm.reusable_blocks(seq.num_tokens)
        chain = self.bm.chain(seq, end)  # hashed already by the match: nothing is rehashed
        hashes, arriving = self._held_below(chain.hashes[match.num_blocks : end])
        if arriving is not None and not hashes:
            self._wait_for(seq, arriving)
            return Admission.LOADING
        if not hashes:
            seq.tier_checked = True
            return Admission.COMPUTE
        copy = self._plan_load(
            seq.token_ids, hashes, match.block_ids, seq.request_id, seq.root_hash
        )
        if copy is None:
            return Admission.WAIT
        # A load capped by the free blocks brings the rest in a later one, once it lands:
        # recomputing what a lower tier holds would cost the most on a crowded pool.
        seq.tier_checked = len(copy.hashes) == len(hashes)
        self.loading[seq.request_id] = seq
        return Admission.LOADING

    def blocks_below(self, seq: Sequence, match: PrefixMatch) -> int:
        """How many blocks after ``match`` lower tiers hold (or a load in flight brings) for
        ``seq``: what a load would spare it from computing. An index lookup, no I/O."""
        if self.lower is None or seq.tier_checked:
            return 0
        end = self.bm.reusable_blocks(seq.num_tokens)
        held, arriving = self._held_below(self.bm.chain(seq, end).hashes[match.num_blocks : end])
        return len(held) + (arriving is not None)

    def prefetch(self, token_ids: list[int], root: BlockHash) -> tuple[int, int]:
        """Start promoting whatever lower tiers hold of this prompt's prefix (a hint that the
        prompt is coming). Returns ``(held, loading)``: the leading reusable blocks the device
        pool holds, and how many after them are now on their way up."""
        usable = self.bm.reusable_blocks(len(token_ids))
        hashes = hash_blocks(token_ids[: usable * self.bm.block_size], root, self.bm.block_size)
        prefix = self.bm.cached_blocks(hashes, token_ids)
        held = len(prefix)
        if self.lower is None:
            return held, 0
        below, _ = self._held_below(hashes[held:])
        copy = self._plan_load(token_ids, below, prefix, None, root) if below else None
        return held, 0 if copy is None else len(copy.block_ids)

    def _held_below(self, hashes: list[BlockHash]) -> tuple[list[BlockHash], BlockHash | None]:
        """Of ``hashes`` (a prompt's next reusable blocks, in order), the leading ones lower
        tiers hold, up to one a load in flight brings already (then also that one's hash)."""
        held = []
        for h in hashes:
            if h in self._arriving:
                return held, h
            if not self.lower.contains(h):  # type: ignore[union-attr]
                break
            held.append(h)
        return held, None

    def _wait_for(self, seq: Sequence, block_hash: BlockHash) -> None:
        """Park ``seq`` until the load in flight that brings ``block_hash`` lands."""
        copy = next(
            c
            for c in itertools.chain(self._copies, self._in_flight.values())
            if c.kind == "load" and block_hash in c.hashes
        )
        self._waiters.setdefault(copy.copy_id, []).append(seq.request_id)
        self.loading[seq.request_id] = seq

    def _plan_load(
        self,
        token_ids: list[int],
        hashes: list[BlockHash],
        prefix_ids: list[int],
        request_id: str | None,
        root: BlockHash | None = None,
    ) -> BlockCopy | None:
        """Reserve device blocks for ``hashes`` (the blocks of ``token_ids`` after the cached
        ``prefix_ids``), as many as are free now, and queue their load; None when no block is
        free. The prefix is held until the load lands: the reservation must not evict it."""
        self.bm.acquire(prefix_ids)
        hashes = hashes[: self.bm.num_free_blocks]
        block_ids = self.bm.reserve(len(hashes)) if hashes else None
        if block_ids is None:
            self.bm.release(prefix_ids)
            return None
        self._arriving.update(hashes)
        bs, start = self.bm.block_size, len(prefix_ids)
        tokens = token_ids[start * bs : (start + len(hashes)) * bs]
        copy = BlockCopy(
            next(self._ids), "load", block_ids, hashes, tokens, request_id, list(prefix_ids), root
        )
        self._copies.append(copy)
        self.stats.loads += 1
        return copy

    def abort(self, request_id: str) -> Sequence | None:
        """Forget a sequence waiting on its load; the load still lands in the cache."""
        return self.loading.pop(request_id, None)

    # ---- saves ---------------------------------------------------------------------------

    def on_cached(self, published: list[tuple[int, BlockHash]]) -> None:
        """Blocks just completed in the pool: copy the ones no lower tier holds yet."""
        if self.lower is None:
            return
        todo = [(b, h) for b, h in published if not self.lower.contains(h)]
        if not todo:
            return
        block_ids = [b for b, _ in todo]
        self.bm.acquire(block_ids)
        self._copies.append(BlockCopy(next(self._ids), "save", block_ids, [h for _, h in todo]))

    def _on_evict(self, block_hash: BlockHash) -> None:
        if self.lower is not None and self.lower.contains(block_hash):
            self.stats.device_demotions += 1

    # ---- completions ---------------------------------------------------------------------

    def complete(self, done: CopyDone) -> list[Sequence]:
        """Apply a finished copy; returns the sequences to put back in the queue, in order."""
        copy = self._in_flight.pop(done.copy_id)
        if copy.kind == "save":
            self.bm.release(copy.block_ids)
            self.stats.blocks_saved += done.num_ok
            return []
        ok = done.num_ok
        self._arriving.difference_update(copy.hashes)
        self.stats.blocks_loaded += ok
        self.stats.load_misses += len(copy.block_ids) - ok
        self.bm.release(copy.block_ids[ok:])
        # The load starts right after its device prefix, which is held: its hash still stands.
        parent = self.bm.blocks[copy.prefix_ids[-1]].hash if copy.prefix_ids else None
        bs = self.bm.block_size
        blocks = [tuple(copy.token_ids[i * bs : (i + 1) * bs]) for i in range(ok)]
        self.bm.register(
            copy.block_ids[:ok],
            copy.hashes[:ok],
            copy.token_ids,
            start_block=len(copy.prefix_ids),  # where they sit in their chain, for events
            blocks=blocks,
            parent=parent,
            root=copy.root,
        )
        self.bm.release(copy.prefix_ids)
        if ok < len(copy.block_ids) and copy.request_id in self.loading:
            self.loading[copy.request_id].tier_checked = True  # a miss: recompute from there
        waiting = [copy.request_id, *self._waiters.pop(copy.copy_id, [])]
        return [self.loading.pop(r) for r in waiting if r in self.loading]

    # ---- retention -----------------------------------------------------------------------

    def retain(self, seq: Sequence) -> None:
        """On finish: pin ``seq``'s leading cached blocks if it asked for retention (call
        before its blocks are freed)."""
        if seq.retention_s and seq.finish_reason != "abort":
            cached = seq.block_table[: len(seq.block_hashes)]
            self.pin(seq.session_id or seq.request_id, cached, seq.retention_s)

    def pin(self, session: str, block_ids: list[int], ttl_s: float) -> int:
        """Pin cached ``block_ids`` (a prefix) for ``ttl_s`` as ``session``'s one pin, within
        its quota; returns how many blocks it pinned."""
        self._unpin(session)
        limit = min(self.retention.quota_blocks, self.retention.max_pinned_blocks)
        block_ids = block_ids[:limit]
        if not block_ids or ttl_s <= 0:
            return 0
        while self.pinned_blocks + len(block_ids) > self.retention.max_pinned_blocks:
            self._unpin(next(iter(self._pins)))  # the oldest pin makes room
        self.bm.acquire(block_ids)
        self._pins[session] = _Pin(list(block_ids), self.clock() + ttl_s)
        self.stats.pins += 1
        return len(block_ids)

    def expire_pins(self) -> int:
        """Unpin (and demote) every pin whose TTL has passed; returns how many."""
        now = self.clock()
        expired = [s for s, p in self._pins.items() if p.expires_at <= now]
        for session in expired:
            self._unpin(session)
            self.stats.pins_expired += 1
        return len(expired)

    def unpin_holding(self, block_ids: set[int]) -> int:
        """Erase: end every pin that holds one of ``block_ids``; returns how many."""
        holding = [s for s, p in self._pins.items() if not block_ids.isdisjoint(p.block_ids)]
        for session in holding:
            self._unpin(session)
        return len(holding)

    def _unpin(self, session: str) -> None:
        pin = self._pins.pop(session, None)
        if pin is not None:
            self.bm.release(pin.block_ids)
            self.bm.demote(pin.block_ids)
