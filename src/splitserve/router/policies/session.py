"""Sticky sessions: consistent hashing with bounded loads over the session key."""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.router.policies.base import RequestInfo, RoutingPolicy, least_loaded
from splitserve.router.ring import (
    DEFAULT_LOAD_FACTOR,
    DEFAULT_LOAD_FLOOR,
    DEFAULT_VNODES,
    HashRing,
)
from splitserve.router.worker import Worker


class SyncedRing:
    """A ring kept equal to the current candidate set.

    The ring's points depend only on its members, never on the order they joined, so two
    routers that see the same healthy workers place every key the same way. Candidates are
    usually the same workers call after call: then syncing costs one comparison, and their
    loads, by URL, are kept current by the workers themselves (``Worker.watch``).
    """

    def __init__(self, vnodes: int = DEFAULT_VNODES) -> None:
        self.ring = HashRing(vnodes=vnodes)
        self._synced: tuple[Worker, ...] = ()
        self._by_url: dict[str, Worker] = {}  # the synced candidates; the first of a URL wins
        self.loads: dict[str, int] = {}  # their loads; replaced (not cleared) at each resync

    def sync(self, workers: Sequence[Worker]) -> HashRing:
        candidates = tuple(workers)
        if candidates == self._synced:  # Workers compare by identity; a URL never changes
            return self.ring
        wanted = {w.url for w in workers}
        current = self.ring.members
        if wanted != current:
            for url in current - wanted:
                self.ring.remove(url)
            for url in sorted(wanted - current):
                self.ring.add(url)
        self._synced = candidates
        for w in self._by_url.values():
            w.unwatch(self.loads)
        self._by_url, self.loads = {}, {}
        for w in reversed(candidates):
            self._by_url[w.url] = w
        for w in self._by_url.values():
            w.watch(self.loads)
        return self.ring

    def worker(self, url: str | None) -> Worker | None:
        """The candidate of the last sync at ``url``."""
        return self._by_url.get(url) if url is not None else None


class SessionPolicy(RoutingPolicy):
    """Each session has a home worker on the ring; it leaves home only when home is full.

    ``load_factor`` is Mirrokni et al.'s ``c``: no worker holds more than
    ``ceil(c * average)`` requests, so one heavy session cannot pin its worker into overload.
    ``load_floor`` raises that cap to at least so many requests: a turn that leaves home
    recomputes its context elsewhere, which costs more than queueing behind one or two
    requests when the workers are few and busy one request at a time. Requests without a
    session key go to the least-loaded worker.
    """

    name = "session"

    def __init__(
        self,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        vnodes: int = DEFAULT_VNODES,
        load_floor: int = DEFAULT_LOAD_FLOOR,
    ):
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1 (a cap below average), got {load_factor}")
        if load_floor < 1:
            raise ValueError(f"load_floor must be >= 1, got {load_floor}")
        self.load_factor = load_factor
        self.load_floor = load_floor
        self._ring = SyncedRing(vnodes)

    def select_worker(self, workers: Sequence[Worker], info: RequestInfo) -> Worker | None:
        if not workers or info.session_key is None:
            return least_loaded(workers)
        ring = self._ring.sync(workers)
        url = ring.bounded_owner(
            info.session_key, self._ring.loads, self.load_factor, self.load_floor
        )
        return self._ring.worker(url)

    def home_worker(self, workers: Sequence[Worker], info: RequestInfo) -> Worker | None:
        if not workers or info.session_key is None:
            return None
        url = self._ring.sync(workers).owner(info.session_key)
        return self._ring.worker(url)
