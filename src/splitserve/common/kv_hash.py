"""The block hash chain: the one name every component gives a KV block.

A prompt is cut into fixed-size blocks; only full blocks are hashed::

    tokens:  [t0 .. t15][t16 .. t31][t32 .. t40]
    hashes:   h0         h1          (partial: none)
    h_i = H(h_{i-1} || tokens_i || extra),   h_{-1} = H("splitserve" || model_id || salt)

``H`` is xxhash3-128, stable across processes and machines (never Python's ``hash()``).
Because each hash covers its parent, equal hashes mean equal prefixes up to and including
that block; holders of a block still compare stored tokens on a hit, so a collision can
never serve wrong KV.

A chain may change salt once (``split_salt``: a tenant's public prefix, shared by its keys,
then one key's own blocks). The full blocks within the first ``tokens`` tokens are hashed
from the shared salt's root; the first block after them also mixes in the own salt's root,
so everything from there on is the key's alone::

    tokens = 40, block size 16:   [b0][b1]|[b2 ....][b3]
    h0 = H(root(shared), b0)   h1 = H(h0, b1)   h2 = H(h1, b2, root(own))   h3 = H(h2, b3)

When no full block lies within ``tokens`` the chain is simply the own salt's. The root of a
split salt names all three (``root_hash``); ``hash_blocks`` and ``BlockChain`` follow it.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import NamedTuple

import xxhash

DEFAULT_BLOCK_SIZE = 16
BlockHash = bytes

# A split salt starts with NUL, which no other salt does (``common.tenants.kv_salt`` makes
# hex digits, then "|" and a client's ``cache_salt``): "\0<tokens>:<len(shared)>:<shared><own>".
_SPLIT = "\0"
_SPLIT_ROOT = b"\x01"  # a split salt's root: this, root(shared), tokens (4 bytes), root(own)
_SPLIT_ROOT_LEN = 1 + 16 + 4 + 16


class ChainSalts(NamedTuple):
    """The salts a chain's blocks are hashed with, for KV events: ``first`` at its root,
    ``then`` mixed into block ``switch`` (-1: none)."""

    first: str
    switch: int = -1
    then: str = ""


def split_salt(shared: str, tokens: int, own: str) -> str:
    """The salt of a prompt whose first ``tokens`` tokens are hashed with ``shared`` (their
    full blocks) and the rest with ``own``; ``own`` alone when ``tokens`` is 0."""
    if tokens < 0 or not own or not shared:
        raise ValueError("a split salt needs a shared and an own salt and tokens >= 0")
    return f"{_SPLIT}{tokens}:{len(shared)}:{shared}{own}" if tokens else own


def _parse_split(salt: str) -> tuple[str, int, str] | None:
    """``(shared, tokens, own)`` of a split salt, None for any other salt (a malformed one
    too: it is then just a name)."""
    if not salt.startswith(_SPLIT):
        return None
    try:
        tokens, size, rest = salt[1:].split(":", 2)
        n, shared, own = int(tokens), rest[: int(size)], rest[int(size) :]
    except ValueError:
        return None
    ok = 0 < n < 2**32 and 0 < len(shared) == int(size) and own
    return (shared, n, own) if ok else None


def chain_salts(salt: str, block_size: int) -> ChainSalts:
    """Which blocks of a chain hashed with ``salt`` take which salt."""
    split = _parse_split(salt)
    if split is None:
        return ChainSalts(salt)
    shared, tokens, own = split
    switch = tokens // block_size
    return ChainSalts(shared, switch, own) if switch else ChainSalts(own)


def root_hash(model_id: str, salt: str = "") -> BlockHash:
    """The parent of a sequence's first block: distinct per model and per salt (tenant).
    A split salt's root is longer and names where its own salt enters (``chain_start``)."""
    split = _parse_split(salt)
    if split is None:
        return _root(model_id, salt)
    shared, tokens, own = split
    return b"".join(
        (_SPLIT_ROOT, _root(model_id, shared), tokens.to_bytes(4, "little"), _root(model_id, own))
    )


def _root(model_id: str, salt: str) -> BlockHash:
    h = xxhash.xxh3_128()
    for part in (b"splitserve-kv-v1", model_id.encode(), salt.encode()):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def chain_start(root: BlockHash, block_size: int) -> tuple[BlockHash, int, bytes]:
    """``(parent of block 0, switch, extra)``: block ``switch`` (-1: none) also hashes
    ``extra``, the own salt's root of a split chain."""
    if len(root) != _SPLIT_ROOT_LEN or root[:1] != _SPLIT_ROOT:
        return root, -1, b""
    shared, tokens, own = root[1:17], int.from_bytes(root[17:21], "little"), root[21:]
    switch = tokens // block_size
    return (shared, switch, own) if switch else (own, -1, b"")


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
    a growing sequence extend its chain without rehashing what it already has. A split
    chain (``split_salt``) is followed from its root, so from block 0.
    """
    switch, extra = -1, b""
    if start_block == 0:
        parent, switch, extra = chain_start(parent, block_size)
    hashes: list[BlockHash] = []
    for i in range(start_block, len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = block_hash(parent, block, extra if i == switch else b"")
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

    __slots__ = ("root", "block_size", "hashes", "tokens", "ahead", "_start", "_switch", "_extra")

    def __init__(self, root: BlockHash, block_size: int) -> None:
        self.root = root
        self.block_size = block_size
        self._start, self._switch, self._extra = chain_start(root, block_size)
        self.hashes: list[BlockHash] = []
        self.tokens: list[tuple[int, ...]] = []  # each block's tokens, for collision checks
        self.ahead: list[BlockHash] = []

    def __len__(self) -> int:
        return len(self.hashes)

    def extend(self, token_ids: Sequence[int], num_blocks: int) -> None:
        """Cover the first ``num_blocks`` full blocks of ``token_ids``, a continuation of
        the stream hashed so far."""
        bs, hashes, tokens, ahead = self.block_size, self.hashes, self.tokens, self.ahead
        parent = hashes[-1] if hashes else self._start
        for i in range(len(hashes), num_blocks):
            block = tuple(token_ids[i * bs : (i + 1) * bs])
            if i < len(ahead):
                parent = ahead[i]
            elif i == self._switch:
                parent = block_hash(parent, block, self._extra)
            else:
                parent = block_hash(parent, block)
            hashes.append(parent)
            tokens.append(block)
