"""Leases: the prefill worker keeps a request's KV blocks until the decode worker confirms
it has them, or until the lease runs out. Either way the blocks are handed back exactly once.

Pure Python and thread-safe: the KV server's connection threads check leases out while the
engine thread grants them and a reaper expires them. Invariant: a lease that is checked out
(a transfer is reading its blocks) is never expired, and a lease released meanwhile is handed
back only when the last reader checks it in, so the engine never frees blocks mid-read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from splitserve.common.kv_hash import BlockHash
from splitserve.transfer.errors import LeaseNotFound

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 30.0
EndReason = Literal["released", "expired"]
OnEnd = Callable[["Lease", EndReason], None]


@dataclass(slots=True)
class Lease:
    """Blocks held for one request. ``hashes`` name the leading full blocks (a trailing
    partial block has no hash), so ``len(hashes) <= len(block_ids)``."""

    request_id: str
    block_ids: tuple[int, ...]
    hashes: tuple[BlockHash, ...]
    ttl_s: float
    expires_at: float
    readers: int = 0
    ended: EndReason | None = field(default=None)

    def hash_at(self, index: int) -> BlockHash | None:
        """The hash of the block at ``index``; None for a trailing partial block."""
        return self.hashes[index] if index < len(self.hashes) else None


class LeaseTable:
    """Request id -> ``Lease``, with ``on_end(lease, reason)`` called once per lease when it
    is released or expires (outside the table's lock; the engine frees the blocks there)."""

    def __init__(
        self,
        on_end: OnEnd | None = None,
        clock: Callable[[], float] = time.monotonic,
        default_ttl_s: float = DEFAULT_LEASE_TTL_S,
        remember_ended: int = 1024,
    ) -> None:
        if default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be > 0, got {default_ttl_s}")
        self._on_end = on_end
        self._clock = clock
        self._default_ttl_s = default_ttl_s
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        # Recently ended ids, only so that errors can say "expired" rather than "unknown".
        self._ended: OrderedDict[str, EndReason] = OrderedDict()
        self._remember_ended = remember_ended

    def grant(
        self,
        request_id: str,
        block_ids: Sequence[int],
        hashes: Sequence[BlockHash] = (),
        ttl_s: float | None = None,
    ) -> Lease:
        """Hold ``block_ids`` for ``request_id`` for ``ttl_s`` seconds (the default if None)."""
        ttl = self._default_ttl_s if ttl_s is None else ttl_s
        if ttl <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl}")
        if len(hashes) > len(block_ids):
            raise ValueError(f"{len(hashes)} hashes for {len(block_ids)} blocks")
        lease = Lease(request_id, tuple(block_ids), tuple(hashes), ttl, self._clock() + ttl)
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a lease")
            self._leases[request_id] = lease
            self._ended.pop(request_id, None)
        return lease

    def renew(self, request_id: str) -> Lease:
        """Push the deadline of a live lease ``ttl_s`` into the future."""
        with self._lock:
            lease = self._live(request_id)
            lease.expires_at = self._clock() + lease.ttl_s
            return lease

    def release(self, request_id: str) -> Lease:
        """The decode worker has the blocks: end the lease (raises ``LeaseNotFound``)."""
        with self._lock:
            lease = self._live(request_id)
            self._end(lease, "released")
            handback = lease.readers == 0
        if handback:
            self._call_on_end(lease)
        return lease

    def expire(self, now: float | None = None) -> list[Lease]:
        """End every lease past its deadline that no transfer is reading; return them."""
        now = self._clock() if now is None else now
        with self._lock:
            expired = [
                lease
                for lease in self._leases.values()
                if lease.expires_at <= now and lease.readers == 0
            ]
            for lease in expired:
                self._end(lease, "expired")
        for lease in expired:
            self._call_on_end(lease)
        return expired

    def get(self, request_id: str) -> Lease | None:
        """The live lease of ``request_id``, or None."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or (lease.expires_at <= self._clock() and lease.readers == 0):
                return None
            return lease

    @contextmanager
    def checkout(self, request_id: str) -> Iterator[Lease]:
        """Hold a live lease open while a transfer reads its blocks: renewed on entry, never
        expired inside, handed back on exit if it was released meanwhile."""
        with self._lock:
            lease = self._live(request_id)
            lease.readers += 1
            lease.expires_at = self._clock() + lease.ttl_s
        try:
            yield lease
        finally:
            with self._lock:
                lease.readers -= 1
                handback = lease.readers == 0 and lease.ended is not None
            if handback:
                self._call_on_end(lease)

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def holding(self, hashes: set[BlockHash]) -> list[str]:
        """The request ids of the live leases that hold a block of ``hashes`` (erasure)."""
        with self._lock:
            return [r for r, lease in self._leases.items() if not hashes.isdisjoint(lease.hashes)]

    def leased_blocks(self) -> int:
        """Number of blocks held by live leases (for ``/load`` and metrics)."""
        with self._lock:
            return sum(len(lease.block_ids) for lease in self._leases.values())

    def _live(self, request_id: str) -> Lease:
        lease = self._leases.get(request_id)
        if lease is None:
            ended = self._ended.get(request_id)
            detail = f"was {ended}" if ended else "is unknown"
            raise LeaseNotFound(f"lease for request {request_id!r} {detail}")
        if lease.expires_at <= self._clock() and lease.readers == 0:
            raise LeaseNotFound(f"lease for request {request_id!r} has expired")
        return lease

    def _end(self, lease: Lease, reason: EndReason) -> None:
        lease.ended = reason
        del self._leases[lease.request_id]
        self._ended[lease.request_id] = reason
        while len(self._ended) > self._remember_ended:
            self._ended.popitem(last=False)

    def _call_on_end(self, lease: Lease) -> None:
        if self._on_end is None:
            return
        try:
            self._on_end(lease, lease.ended or "released")
        except Exception:
            # The table stays consistent whatever the engine's callback does.
            log.exception("lease on_end callback failed for request %r", lease.request_id)
