"""The free-block queue: block ids in eviction order, head first. Pure Python, no torch.

A doubly linked list threaded through two flat lists indexed by block id, with node ``n``
as the sentinel (``_next[n]`` is the head, ``_prev[n]`` the tail)::

    sentinel ⇄ head ⇄ ... ⇄ tail ⇄ sentinel

Every operation is O(1) and allocates nothing: take any block out, put one back at either
end, pop the head. (An ``OrderedDict`` does the same, but at 10^5 blocks its hash table
churns as blocks come and go, and building one per worker dominated the start-up of a
simulated cluster of 10^7 blocks.)

The links are shared int objects (``_ids(n)[i]`` is the one ``i``, for every queue), typed
``Any`` so that compiled code (mypyc) moves them as they are: typed ``int``, it unboxes each
link it reads and boxes each it writes, a new int object per write past 256.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

_IDS: list[Any] = []


def _ids(n: int) -> list[Any]:
    """The shared int objects ``0 .. n`` (at least)."""
    if len(_IDS) <= n:
        _IDS.extend(range(len(_IDS), n + 1))
    return _IDS


class FreeQueue:
    """Initially holds ``0 .. n-1`` in order."""

    def __init__(self, n: int) -> None:
        self._ids = ids = _ids(n)
        self._next: list[Any] = ids[1 : n + 1]
        self._next.append(ids[0])
        self._prev: list[Any] = [ids[n]]
        self._prev.extend(ids[:n])
        self._queued = bytearray(b"\x01") * n
        self._len = n
        self._end = n  # the sentinel

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: int) -> bool:
        return bool(self._queued[block_id])

    def __iter__(self) -> Iterator[int]:
        nxt, end = self._next, self._end
        block_id = nxt[end]
        while block_id != end:
            following = nxt[block_id]  # read first: the caller may take block_id out
            yield block_id
            block_id = following

    def head(self) -> int:
        """The block to evict next; the queue must not be empty."""
        return self._next[self._end]

    def pop_head(self) -> int:
        """Take out and return the head; the queue must not be empty."""
        block_id = self._next[self._end]
        self.remove(block_id)
        return block_id

    def remove(self, block_id: int) -> None:
        nxt, prev = self._next, self._prev
        before: Any = prev[block_id]
        after: Any = nxt[block_id]
        nxt[before] = after
        prev[after] = before
        self._queued[block_id] = 0
        self._len -= 1

    def append(self, block_id: int) -> None:
        """Put ``block_id`` last in line for eviction."""
        self._insert_after(self._prev[self._end], block_id)

    def appendleft(self, block_id: int) -> None:
        """Put ``block_id`` first in line for eviction."""
        self._insert_after(self._end, block_id)

    def move_to_front(self, block_id: int) -> None:
        self.remove(block_id)
        self.appendleft(block_id)

    def _insert_after(self, before: int, block_id: int) -> None:
        nxt, prev, ids = self._next, self._prev, self._ids
        block: Any = ids[block_id]
        after: Any = nxt[before]
        nxt[before] = block
        prev[block_id] = ids[before]
        nxt[block_id] = after
        prev[after] = block
        self._queued[block_id] = 1
        self._len += 1
