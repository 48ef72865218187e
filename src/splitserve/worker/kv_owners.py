"""Which KV blocks belong to which (tenant, session): what erasure needs to find them.

Blocks are named by content alone (the salted hash chain), so a worker remembers, per
request, the full blocks of its prompt (when it starts) and of its prompt and output (when
it ends, finished or aborted), under its owner: ``(tenant, session)``, or the request
itself when it names no session. A session's later turn extends its earlier
prefix, so its blocks are mostly the ones it has already.

Bounded: at most ``max_blocks`` (hash, owner) entries in all, about 100 bytes each; past
that the least recently used owners are forgotten whole (never one with a request running),
and one owner keeps at most ``max_blocks // 4`` blocks, its oldest forgotten first. What
memory forgets, and everything after a restart, the disk tier's owner log
(``kvstore.owner_log``) still knows for the blocks on disk.

A block is *shared* when another live owner made it too: a session, or a request still
running (a finished request without a session is no session to keep blocks for).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from splitserve.kvstore.owner_log import NO_SESSION, OwnerLog, session_digest

BlockHash = bytes
Key = tuple[str, bool, str]  # (tenant, is a session, the session or the request id)
Hasher = Callable[[list[int], str], list[BlockHash]]  # (token ids, salt) -> full-block hashes
DEFAULT_MAX_BLOCKS = 1 << 18


@dataclass(slots=True)
class _Owner:
    hashes: dict[BlockHash, None] = field(default_factory=dict)  # insertion order: oldest first
    running: int = 0


class Claim(NamedTuple):
    """The blocks an erasure takes (``erase``) and the ones it leaves to other live owners."""

    erase: set[BlockHash]
    shared: set[BlockHash]


class KVOwners:
    """The owner record of one worker; every method may be called from any thread."""

    def __init__(
        self,
        hasher: Hasher,
        log: OwnerLog | None = None,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
    ) -> None:
        if max_blocks < 4:
            raise ValueError(f"max_blocks must be >= 4, got {max_blocks}")
        self.hasher = hasher
        self.log = log
        self.max_blocks = max_blocks
        self._owners: OrderedDict[Key, _Owner] = OrderedDict()  # least recently used first
        self._size = 0
        self._lock = threading.Lock()

    # ---- recording ------------------------------------------------------------------------

    def begin(
        self, tenant: str, session: str | None, request_id: str, salt: str, prompt: list[int]
    ) -> Key:
        """A request starts: its prompt's blocks are its owner's from now on."""
        key = (tenant, True, session) if session is not None else (tenant, False, request_id)
        self._add(key, self.hasher(prompt, salt), running=1)
        return key

    def end(self, key: Key, salt: str, token_ids: list[int]) -> None:
        """The request ended (finished or aborted) with ``token_ids``, prompt and output."""
        self._add(key, self.hasher(token_ids, salt), running=-1)

    def _add(self, key: Key, hashes: list[BlockHash], running: int) -> None:
        with self._lock:
            owner = self._owners.get(key)
            if owner is None:
                owner = self._owners[key] = _Owner()
            self._owners.move_to_end(key)
            owner.running = max(0, owner.running + running)
            new = [h for h in hashes if h not in owner.hashes]
            owner.hashes.update(dict.fromkeys(new))
            self._size += len(new)
            self._trim(owner)
        if self.log is not None and new:
            self.log.append(key[0], key[2] if key[1] else None, new)

    def _trim(self, latest: _Owner) -> None:
        excess = len(latest.hashes) - self.max_blocks // 4
        for h in list(latest.hashes)[: max(0, excess)]:
            del latest.hashes[h]
            self._size -= 1
        for key in list(self._owners):
            if self._size <= self.max_blocks:
                return
            if self._owners[key].running == 0:
                self._size -= len(self._owners.pop(key).hashes)

    def holds(self, block_hash: BlockHash) -> bool:
        """Whether some owner in memory made this block (the owner log's compaction asks)."""
        with self._lock:
            return any(block_hash in o.hashes for o in self._owners.values())

    # ---- erasure --------------------------------------------------------------------------

    def claim_session(self, tenant: str, session: str) -> Claim:
        """The blocks of ``tenant``'s ``session`` and which of them other live owners share."""
        key = (tenant, True, session)
        with self._lock:
            owner = self._owners.get(key)
            mine = set(owner.hashes) if owner is not None else set()
            others = self._live_except(lambda k: k == key)
        digest = session_digest(session)
        for who, h in self.log.records(tenant) if self.log is not None else ():
            if who == digest:
                mine.add(h)
            elif who != NO_SESSION:
                others.add(h)
        return Claim(mine - others, mine & others)

    def claim_tenant(self, tenant: str) -> Claim:
        """Every block of ``tenant`` and which of them other tenants' live owners share (only
        tenants on the same salt can)."""
        with self._lock:
            mine = {h for k, o in self._owners.items() if k[0] == tenant for h in o.hashes}
            others = self._live_except(lambda k: k[0] == tenant)
        if self.log is not None:
            mine.update(h for _, h in self.log.records(tenant))
        return Claim(mine - others, mine & others)

    def _live_except(self, excluded: Callable[[Key], bool]) -> set[BlockHash]:
        return {
            h
            for k, o in self._owners.items()
            if (k[1] or o.running) and not excluded(k)
            for h in o.hashes
        }

    def forget_session(self, tenant: str, session: str) -> None:
        """The session was erased: forget its record, in memory and in the owner log."""
        with self._lock:
            owner = self._owners.pop((tenant, True, session), None)
            self._size -= 0 if owner is None else len(owner.hashes)
        if self.log is not None:
            self.log.drop_session(tenant, session)

    def forget_tenant(self, tenant: str) -> None:
        with self._lock:
            for key in [k for k in self._owners if k[0] == tenant]:
                self._size -= len(self._owners.pop(key).hashes)
        if self.log is not None:
            self.log.drop_tenant(tenant)


class OwnedStream:
    """A request's output stream that reports its tokens to the owner record when closed
    (every consumer closes its stream: ``responses.collect`` and ``sse_events`` do)."""

    def __init__(self, inner: Any, owners: KVOwners, key: Key, salt: str, prompt: list[int]):
        self._inner, self._owners, self._key, self._salt = inner, owners, key, salt
        self._tokens = list(prompt)
        self._prompt_len = len(prompt)
        self._ended = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for out in self._inner:
            self._tokens[self._prompt_len :] = out.outputs[0].token_ids
            yield out

    def close(self) -> None:
        self._inner.close()
        if not self._ended:
            self._ended = True
            self._owners.end(self._key, self._salt, self._tokens)


def hashes_of(engine: Any) -> Hasher | None:
    """The engine's block hashes by salt, when it has them (the builtin engine)."""
    return getattr(engine, "block_hashes", None)


def owners_for(engine: Any) -> KVOwners | None:
    """The owner record for ``engine``: with an owner log next to its disk tier, if any."""
    hasher = hashes_of(engine)
    if hasher is None or getattr(engine, "erase_blocks", None) is None:
        return None
    tiers = getattr(engine, "kv_tiers", None)
    disk = tiers.ladder.disk() if tiers is not None else None
    if disk is None:
        return KVOwners(hasher)
    store = tiers.ladder.store
    owners = KVOwners(hasher)
    owners.log = OwnerLog(disk.directory, keep=lambda h: store.contains(h) or owners.holds(h))
    return owners
