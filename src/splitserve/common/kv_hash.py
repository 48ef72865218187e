"""The block hash chain: the one name every component gives a KV block.

A prompt is cut into fixed-size blocks; only full blocks are hashed::

    tokens:  [t0 .. t15][t16 .. t31][t32 .. t40]
    hashes:   h0         h1          (partial: none)
    h_i = H(h_{i-1} || tokens_i || extra),   h_{-1} = H("splitserve" || model_id || salt)

``H`` is xxhash3-128, stable across processes and machines (never Python's ``hash()``).
Because each hash covers its parent, equal hashes mean equal prefixes up to and including
that block; holders of a block still compare stored tokens on a hit, so a collision can
never serve wrong KV.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence

import xxhash

DEFAULT_BLOCK_SIZE = 16
BlockHash = bytes


def root_hash(model_id: str, salt: str = "") -> BlockHash:
    """The parent of a sequence's first block: distinct per model and per salt (tenant)."""
    h = xxhash.xxh3_128()
    for part in (b"splitserve-kv-v1", model_id.encode(), salt.encode()):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def block_hash(parent: BlockHash, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash of one full block chained to its parent."""
    h = xxhash.xxh3_128(parent)
    h.update(_packer(len(tokens)).pack(*tokens))  # little-endian int64s, as numpy's tobytes
    if extra:
        h.update(extra)
    return h.digest()


@functools.cache
def _packer(n: int) -> struct.Struct:
    """Packs ``n`` token ids as little-endian int64 (3x faster than a numpy round trip)."""
    return struct.Struct(f"<{n}q")


def hash_blocks(
    token_ids: Sequence[int],
    parent: BlockHash,
    block_size: int = DEFAULT_BLOCK_SIZE,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from ``start_block`` on.

    ``parent`` is the hash of block ``start_block - 1`` (or the root for block 0), which lets
    a growing sequence extend its chain without rehashing what it already has.
    """
    hashes: list[BlockHash] = []
    for i in range(start_block, len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


class BlockChain:
    """The hashes and tokens of a token stream's leading full blocks, each computed once.

    A sequence carries one so that every lookup and cache registration of its blocks reuses
    the same hashes; it grows as the stream does. Sequences whose token lists are all
    prefixes of one stream (the turns of a session) may share one chain.

    ``ahead`` may hold the hashes of the stream's blocks computed elsewhere (the simulator's
    draws process hashes each session's whole synthetic stream ahead); block ``i`` takes
    ``ahead[i]`` instead of hashing its tokens. Whoever sets it vouches that the stream this
    chain covers starts with the one hashed, and must clear it where they part.
    """

    __slots__ = ("root", "block_size", "hashes", "tokens", "ahead")

    def __init__(self, root: BlockHash, block_size: int) -> None:
        self.root = root
        self.block_size = block_size
        self.hashes: list[BlockHash] = []
        self.tokens: list[tuple[int, ...]] = []  # each block's tokens, for collision checks
        self.ahead: list[BlockHash] = []

    def __len__(self) -> int:
        return len(self.hashes)

    def extend(self, token_ids: Sequence[int], num_blocks: int) -> None:
        """Cover the first ``num_blocks`` full blocks of ``token_ids``, a continuation of
        the stream hashed so far."""
        bs, hashes, tokens, ahead = self.block_size, self.hashes, self.tokens, self.ahead
        parent = hashes[-1] if hashes else self.root
        for i in range(len(hashes), num_blocks):
            block = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = ahead[i] if i < len(ahead) else block_hash(parent, block)
            hashes.append(parent)
            tokens.append(block)
