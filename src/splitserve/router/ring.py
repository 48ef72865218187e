"""Consistent hashing with virtual nodes and bounded loads.

Each member owns ``vnodes`` points on a 64-bit ring; a key belongs to the member owning the
first point clockwise from the key's hash. Removing a member hands only its own keys to the
next points; adding one takes only the keys that now fall on its points. Positions come from
xxhash, so every process (and every router replica) builds the same ring.

Bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads",
2018): no member may hold more than ``ceil(c * (total + 1) / n)`` requests, counting the one
being placed. A key walks clockwise from its hash to the first member under that cap, so it
stays home unless home is full, and the overflow goes to the same next member every time.

The bound is meant for many requests per member. With a few single-request workers it is
1 or 2, so a turn leaves a home that is running just one other request and recomputes its
whole context elsewhere; ``floor`` keeps the cap at or above a chosen number of requests.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator, Mapping

import xxhash

DEFAULT_VNODES = 160
DEFAULT_LOAD_FACTOR = 1.25
DEFAULT_LOAD_FLOOR = 1  # the plain bound: ``load_cap`` is never below 1 anyway


def key_position(key: str) -> int:
    """A key's position on the ring: stable across processes (never Python's ``hash()``).
    A key from a client's JSON may hold lone surrogates, which strict UTF-8 refuses."""
    return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass"))


def load_cap(total_load: int, members: int, c: float, floor: int = DEFAULT_LOAD_FLOOR) -> int:
    """The most requests one member may hold once the request being placed is counted:
    ``ceil(c * (total + 1) / n)``, and never fewer than ``floor``."""
    if members < 1:
        raise ValueError("the load cap needs at least one member")
    return max(1, floor, math.ceil(c * (total_load + 1) / members))


class HashRing:
    """A consistent-hash ring over member names (worker URLs)."""

    def __init__(self, members: Iterable[str] = (), vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.vnodes = vnodes
        self._members: set[str] = set()
        self._points: list[int] = []
        self._owners: list[str] = []
        for m in members:
            self.add(m)

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def add(self, member: str) -> None:
        if member in self._members:
            return
        self._members.add(member)
        self._rebuild(
            list(zip(self._points, self._owners, strict=True))
            + [(key_position(f"{member}#{i}"), member) for i in range(self.vnodes)]
        )

    def remove(self, member: str) -> None:
        if member not in self._members:
            return
        self._members.discard(member)
        self._rebuild(
            [(p, o) for p, o in zip(self._points, self._owners, strict=True) if o != member]
        )

    def _rebuild(self, vnodes: list[tuple[int, str]]) -> None:
        # Sorting (point, name) orders even a 64-bit collision the same way in every process.
        vnodes.sort()
        self._points = [p for p, _ in vnodes]
        self._owners = [o for _, o in vnodes]

    def preference(self, key: str) -> Iterator[str]:
        """Members in the order a key visits them walking clockwise, each once."""
        if not self._points:
            return
        start = bisect.bisect_right(self._points, key_position(key))
        seen: set[str] = set()
        n = len(self._points)
        for i in range(n):
            owner = self._owners[(start + i) % n]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self._members):
                    return

    def owner(self, key: str, eligible: Callable[[str], bool] | None = None) -> str | None:
        """The first member clockwise from ``key`` that is ``eligible`` (any, if None)."""
        for member in self.preference(key):
            if eligible is None or eligible(member):
                return member
        return None

    def bounded_owner(
        self,
        key: str,
        loads: Mapping[str, int],
        c: float = DEFAULT_LOAD_FACTOR,
        floor: int = DEFAULT_LOAD_FLOOR,
    ) -> str | None:
        """The first member clockwise from ``key`` whose load is under the bound.

        Only members in ``loads`` take part (pass the healthy ones); missing members are
        skipped as if they were not on the ring, which moves only their own keys.
        """
        if not loads:
            return None
        cap = load_cap(sum(loads.values()), len(loads), c, floor)
        home = self.owner(key, lambda m: m in loads and loads[m] < cap)
        if home is None:  # c < 1 can leave every member at the cap: fall back to the least loaded
            return min(loads, key=lambda m: (loads[m], m))
        return home
