"""What the prefix cache tells about itself: the block manager's side of KV events.

The block manager calls ``CacheEvents`` (``common.kv_events.BlockEventSink`` publishes them
in vLLM's format) as blocks enter and leave its cache. A stretch of a chain whose blocks
are only partly new is told as runs of new blocks, each chained to the block before it, and
a chain's first block carries its salt: whoever indexes the events (the router) then tells
tenants' equal tokens apart, as vLLM's events carry a request's ``cache_salt``. A split
chain's switch block (``common.kv_hash.split_salt``) starts a run carrying the salt mixed
in there.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from splitserve.common.kv_hash import BlockHash, ChainSalts

MAX_NAMED_SALTS = 4096  # salts whose root hash can be named (``SaltNames``)
_UNSALTED = ChainSalts("")


class CacheEvents(Protocol):
    """Hears what the prefix cache gains and loses. ``stored``: consecutive blocks of one
    chain, the first chained to ``parent`` (None: a prompt's first block, hashed from the
    root of ``salt``; else ``salt``, when given, is mixed into the first), with their
    tokens."""

    def stored(
        self,
        hashes: list[BlockHash],
        parent: BlockHash | None,
        blocks: list[tuple[int, ...]],
        salt: str = "",
    ) -> None: ...
    def removed(self, block_hash: BlockHash) -> None: ...
    def cleared(self) -> None: ...


class SaltNames:
    """The salts of the last ``MAX_NAMED_SALTS`` root hashes named (the empty salt's root
    needs no name)."""

    __slots__ = ("_salts",)

    def __init__(self) -> None:
        self._salts: OrderedDict[BlockHash, str] = OrderedDict()

    def name(self, root: BlockHash, salt: str) -> None:
        self._salts[root] = salt
        self._salts.move_to_end(root)
        if len(self._salts) > MAX_NAMED_SALTS:
            self._salts.popitem(last=False)

    def of(self, root: BlockHash | None) -> str:
        return "" if root is None else self._salts.get(root, "")


def report_runs(
    events: CacheEvents,
    parent: BlockHash | None,
    hashes: list[BlockHash],
    tokens: list[tuple[int, ...]],
    new: set[BlockHash],
    salts: ChainSalts = _UNSALTED,
    start: int = 0,
) -> None:
    """Tell ``events`` of the runs of ``new`` blocks in ``hashes`` (blocks ``start, ...`` of
    one chain, whose block before is ``parent``), each run chained to the block before it.
    A run that starts the chain carries its first salt; one also starts at a split chain's
    switch block (``salts.switch``), carrying the salt that enters there::

        parent  hashes:  h0  h1  h2  h3        new = {h0, h1, h3}
        stored:         [h0  h1]    [h3]       parents: parent, h2
    """
    i, end, switch = 0, len(hashes), salts.switch - start
    while i < end:
        if hashes[i] not in new:
            i += 1
            continue
        j = i + 1
        while j < end and hashes[j] in new and j != switch:
            j += 1
        before = hashes[i - 1] if i else parent
        salt = salts.then if i == switch else salts.first if before is None else ""
        events.stored(hashes[i:j], before, tokens[i:j], salt)
        i = j
