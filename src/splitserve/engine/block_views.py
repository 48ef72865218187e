"""Views of the block manager's per-block state, made on demand (for inspection and tests):
``bm.blocks[i]`` is a ``Block``. The manager itself keeps that state in flat lists."""

from __future__ import annotations

from typing import Any

from splitserve.common.kv_hash import BlockHash


class Block:
    """A view of one block's state; the manager keeps that state in flat lists, one entry
    per block (a simulated cluster holds 10^7 blocks: an object each is seconds to build)."""

    __slots__ = ("_bm", "block_id")

    def __init__(self, bm: Any, block_id: int) -> None:
        self._bm, self.block_id = bm, block_id

    @property
    def ref_count(self) -> int:
        return self._bm._ref[self.block_id]

    @property
    def hash(self) -> BlockHash | None:
        return self._bm._hash[self.block_id]

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The block's tokens, kept to rule out hash collisions."""
        return self._bm._tokens[self.block_id]

    @token_ids.setter
    def token_ids(self, tokens: tuple[int, ...]) -> None:
        self._bm._tokens[self.block_id] = tokens


class Blocks:
    """``bm.blocks[i]``: a ``Block`` view made on demand (for inspection and tests)."""

    def __init__(self, bm: Any) -> None:
        self._bm = bm

    def __len__(self) -> int:
        return len(self._bm._ref)

    def __getitem__(self, block_id: int) -> Block:
        if not 0 <= block_id < len(self):
            raise IndexError(block_id)
        return Block(self._bm, block_id)
