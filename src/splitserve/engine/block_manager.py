"""Paged KV blocks: allocation, reference counts and the prefix cache. Pure Python, no torch.

Every block is in exactly one of two states::

    in use   ref_count > 0, listed in some sequence's block table
    free     ref_count == 0, in ``_free`` (an LRU queue: head is evicted first)

A free block may still hold valid KV under its hash: the prefix cache keeps it findable until
the block is reused for something else (lazy eviction). Freed blocks without a hash go to the
head of the queue so that cached ones are evicted last, oldest first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from splitserve.common.kv_hash import BlockChain, BlockHash, chain_salts
from splitserve.engine.block_views import Blocks
from splitserve.engine.cache_events import CacheEvents, SaltNames, report_runs
from splitserve.engine.free_queue import FreeQueue
from splitserve.engine.sequence import Sequence

__all__ = ["BlockManager", "CacheEvents", "PrefixMatch"]


@dataclass(slots=True)
class PrefixMatch:
    block_ids: list[int]
    hashes: list[BlockHash]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class BlockManager:
    """``on_evict(hash)`` hears of every cached block whose KV leaves the pool (the tier
    ladder counts it as demoted: its bytes were copied down when the block completed).
    ``events``, when set, hears of every block the cache gains or loses (KV events)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        on_evict: Callable[[BlockHash], None] | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...]] = [()] * num_blocks
        self.blocks = Blocks(self)
        self._free = FreeQueue(num_blocks)
        self._cached: dict[BlockHash, int] = {}
        self.prefix_queries = 0  # blocks looked up on admission
        self.prefix_hits = 0  # of which served from the cache
        self.on_evict = on_evict
        self.events: CacheEvents | None = None
        self._salts = SaltNames()  # root hash -> its salt, for ``events``

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._ref)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding KV findable under a hash (in use or free)."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reusable_blocks(self, num_tokens: int) -> int:
        """How many leading blocks of a ``num_tokens`` prompt can come from a cache: all
        full blocks but one holding the last token, which is always computed (its logits
        give the next token), so no computed token is ever written into a shared block."""
        return (num_tokens - 1) // self.block_size

    def lookup(self, h: BlockHash, tokens: tuple[int, ...]) -> int | None:
        """The block holding KV for ``h``, if cached and its tokens really match."""
        block_id = self._cached.get(h)
        if block_id is None or not _same(self._tokens[block_id], tokens):
            return None
        return block_id

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Cached blocks that cover a prefix of ``seq``'s tokens, without taking them.

        See ``reusable_blocks`` for why a fully cached prompt still computes its last block.
        """
        max_blocks = self.reusable_blocks(seq.num_tokens)
        chain = self.chain(seq, max_blocks)
        block_ids = self.cached_chain(chain, max_blocks)
        return PrefixMatch(block_ids, chain.hashes[: len(block_ids)])

    def cached_chain(self, chain: BlockChain, num_blocks: int) -> list[int]:
        """The blocks holding the leading cached part of ``chain``'s first ``num_blocks``
        blocks (tokens checked)."""
        cached, stored = self._cached, self._tokens
        hashes, tokens = chain.hashes, chain.tokens
        block_ids: list[int] = []
        # An index loop, not a zip of two slices: compiled (mypyc), it reads the lists in
        # place; this lookup runs for every prompt on every worker it visits.
        for i in range(min(num_blocks, len(hashes))):
            block_id = cached.get(hashes[i])
            if block_id is None or not _same(stored[block_id], tokens[i]):
                break
            block_ids.append(block_id)
        return block_ids

    def chain(self, seq: Sequence, num_blocks: int) -> BlockChain:
        """``seq``'s hash chain, covering at least its first ``num_blocks`` full blocks."""
        chain = seq.chain
        if chain is None or chain.block_size != self.block_size or chain.root != seq.root_hash:
            chain = seq.chain = BlockChain(seq.root_hash, self.block_size)
        if len(chain) < num_blocks:
            chain.extend(seq.token_ids, num_blocks)
        return chain

    def can_allocate(self, match: PrefixMatch, num_new_tokens: int, seq: Sequence) -> bool:
        """Whether ``seq`` can start with ``match`` reused plus ``num_new_tokens`` computed."""
        ref = self._ref
        matched_free = sum(1 for b in match.block_ids if ref[b] == 0)
        needed = self.blocks_needed(match.num_blocks * self.block_size + num_new_tokens)
        return needed - match.num_blocks + matched_free <= self.num_free_blocks

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return needed - len(seq.block_table) <= self.num_free_blocks

    # ---- mutations -----------------------------------------------------------------------

    def allocate(self, seq: Sequence, match: PrefixMatch) -> None:
        """Give a waiting ``seq`` the matched cached blocks; its computation starts after them."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        self._take(match.block_ids)
        seq.block_table = list(match.block_ids)
        seq.block_hashes = list(match.hashes)
        seq.num_computed_tokens = match.num_blocks * self.block_size
        self.prefix_queries += self.reusable_blocks(seq.num_tokens)
        self.prefix_hits += match.num_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``num_new_tokens`` more computed tokens."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        table = seq.block_table
        if needed - len(table) > len(self._free):
            raise RuntimeError("out of KV blocks: call can_append first")
        while len(table) < needed:
            table.append(self._take_head())

    def cache_full_blocks(self, seq: Sequence) -> list[tuple[int, BlockHash]]:
        """Register every newly completed block of ``seq`` in the prefix cache; returns the
        (block id, hash) pairs it published."""
        published: list[tuple[int, BlockHash]] = []
        start, num_full = len(seq.block_hashes), seq.num_computed_tokens // self.block_size
        if num_full <= start:
            return published
        chain = self.chain(seq, num_full)
        seq.block_hashes.extend(chain.hashes[start:num_full])
        cached, stored_hash, table = self._cached, self._hash, seq.block_table
        for i in range(start, num_full):
            h, block_id = chain.hashes[i], table[i]
            # Another sequence may have computed the same block first; keep the first one.
            if h not in cached and stored_hash[block_id] is None:
                stored_hash[block_id], self._tokens[block_id] = h, chain.tokens[i]
                cached[h] = block_id
                published.append((block_id, h))
        if self.events is not None and published:
            parent = chain.hashes[start - 1] if start else None
            new = {h for _, h in published}
            self._report_stored(
                parent,
                chain.hashes[start:num_full],
                chain.tokens[start:num_full],
                new,
                seq.root_hash,
                start,
            )
        return published

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks; the last ones are evicted first (they are the least shared)."""
        self.release(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    # ---- blocks that arrive from elsewhere (KV transfer, lower tiers) --------------------

    def cached_prefix(self, hashes: list[BlockHash], token_ids: list[int]) -> int:
        """How many leading blocks of a chain are already cached here (tokens checked)."""
        return len(self.cached_blocks(hashes, token_ids))

    def cached_blocks(self, hashes: list[BlockHash], token_ids: list[int]) -> list[int]:
        """The blocks holding the leading cached part of a chain (tokens checked)."""
        bs = self.block_size
        block_ids = []
        for i, h in enumerate(hashes):
            block_id = self.lookup(h, tuple(token_ids[i * bs : (i + 1) * bs]))
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def take_cached(self, hashes: list[BlockHash], token_ids: list[int]) -> list[int]:
        """The blocks holding the leading cached part of a chain, each with one reference
        more (a lease to a peer reading them: neither evicted nor reused until ``release``)."""
        block_ids = self.cached_blocks(hashes, token_ids)
        self._take(block_ids)
        return block_ids

    def reserve(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` free blocks (evicting LRU cached ones) to be filled from outside,
        or ``None`` if there are not enough. Each comes back with ``register`` or ``release``."""
        if num_blocks > len(self._free):
            return None
        return [self._take_head() for _ in range(num_blocks)]

    def register(
        self,
        block_ids: list[int],
        hashes: list[BlockHash],
        token_ids: list[int],
        start_block: int = 0,
        blocks: list[tuple[int, ...]] | None = None,
        parent: BlockHash | None = None,
        root: BlockHash | None = None,
    ) -> None:
        """Publish reserved blocks, now filled with the KV of the consecutive full blocks
        ``start_block, start_block + 1, ...`` of ``token_ids``, under their hashes, then
        release them into the prefix cache. ``blocks``: those blocks' tokens as tuples made
        already (a ``BlockChain``'s), stored as they are; a lookup through that chain then
        finds them by identity instead of comparing every token. ``parent``: the hash of
        the block before the first (None: that is the chain's first block), and ``root``,
        the chain's root hash, for ``events``."""
        bs = self.block_size
        for i, (block_id, h) in enumerate(zip(block_ids, hashes, strict=True), start_block):
            if h not in self._cached and self._hash[block_id] is None:
                self._hash[block_id] = h
                self._tokens[block_id] = (
                    tuple(token_ids[i * bs : (i + 1) * bs])
                    if blocks is None
                    else blocks[i - start_block]
                )
                self._cached[h] = block_id
        if self.events is not None:
            self._report_registered(block_ids, hashes, token_ids, start_block, blocks, parent, root)
        self.release(block_ids)

    def acquire(self, block_ids: list[int]) -> None:
        """Add one reference to each block (a pin, or a copy in flight that must not see the
        block reused); undone by ``release``."""
        self._take(block_ids)

    def demote(self, block_ids: list[int]) -> None:
        """Move those of ``block_ids`` that are free to the head of the eviction queue."""
        for block_id in reversed(block_ids):
            if block_id in self._free:
                self._free.move_to_front(block_id)

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block (a reservation or a lease)."""
        ref, free = self._ref, self._free
        for block_id in reversed(block_ids):
            count = ref[block_id] - 1
            assert count >= 0, f"block {block_id} released twice"
            ref[block_id] = count
            if count == 0:
                if self._hash[block_id] is None:
                    free.appendleft(block_id)
                else:
                    free.append(block_id)

    def cached_ids(self, hashes: Iterable[BlockHash]) -> set[int]:
        """The blocks cached under any of ``hashes`` (in use or free)."""
        cached = self._cached
        return {b for h in hashes if (b := cached.get(h)) is not None}

    def uncache(self, hashes: Iterable[BlockHash]) -> tuple[list[int], list[BlockHash]]:
        """Erase: evict the free blocks cached under ``hashes`` now (first in line for reuse,
        ``events`` hears of each) and return their ids, with the hashes whose block is in use
        (referenced: a running request, a pin, a lease, a copy), which stay cached."""
        freed: list[int] = []
        in_use: list[BlockHash] = []
        for h in hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                continue
            if self._ref[block_id]:
                in_use.append(h)
                continue
            self._evict(block_id)
            self._free.move_to_front(block_id)
            freed.append(block_id)
        return freed, in_use

    def reset_prefix_cache(self) -> None:
        """Evict every free cached block. When that empties the cache, ``events`` hears
        one ``cleared`` instead of a removal per block."""
        events = self.events
        emptied = all(self._ref[b] == 0 for b in self._cached.values())
        if emptied:
            self.events = None
        try:
            for block_id in self._free:
                self._evict(block_id)
        finally:
            self.events = events
        if emptied and events is not None:
            events.cleared()

    def note_salt(self, root: BlockHash, salt: str) -> None:
        """``root`` is the root hash of ``salt``'s chains: a chain's first block is told to
        ``events`` with its salt (``engine.cache_events``)."""
        if salt and self.events is not None:
            self._salts.name(root, salt)

    def _take(self, block_ids: list[int]) -> None:
        ref, free = self._ref, self._free
        for block_id in block_ids:
            if ref[block_id] == 0:
                free.remove(block_id)
            ref[block_id] += 1

    def _take_head(self) -> int:
        """The block first in line for eviction, evicted and taken."""
        block_id = self._free.pop_head()
        if self._hash[block_id] is not None:
            self._evict(block_id)
        self._ref[block_id] = 1
        return block_id

    def _evict(self, block_id: int) -> None:
        h = self._hash[block_id]
        if h is not None:
            del self._cached[h]
            if self.on_evict is not None:
                self.on_evict(h)
            if self.events is not None:
                self.events.removed(h)
            self._hash[block_id], self._tokens[block_id] = None, ()

    def _report_registered(
        self,
        block_ids: list[int],
        hashes: list[BlockHash],
        token_ids: list[int],
        start_block: int,
        blocks: list[tuple[int, ...]] | None,
        parent: BlockHash | None,
        root: BlockHash | None,
    ) -> None:
        # Registered here, not before: the hash now names this very block.
        new = {h for h, b in zip(hashes, block_ids, strict=True) if self._cached.get(h) == b}
        if not new:
            return
        if blocks is None:
            bs, end = self.block_size, start_block + len(hashes)
            blocks = [tuple(token_ids[i * bs : (i + 1) * bs]) for i in range(start_block, end)]
        self._report_stored(parent, hashes, blocks, new, root, start_block)

    def _report_stored(
        self,
        parent: BlockHash | None,
        hashes: list[BlockHash],
        tokens: list[tuple[int, ...]],
        new: set[BlockHash],
        root: BlockHash | None = None,
        start: int = 0,
    ) -> None:
        assert self.events is not None
        salts = chain_salts(self._salts.of(root), self.block_size)
        report_runs(self.events, parent, hashes, tokens, new, salts, start)


def _same(stored: tuple[int, ...], tokens: tuple[int, ...]) -> bool:
    """Whether a block's stored tokens are ``tokens``. Mostly they are the very tuple that
    was stored (a session's own chain): a tuple's ``==`` would still compare every item."""
    return stored is tokens or stored == tokens
