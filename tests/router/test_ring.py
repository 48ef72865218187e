"""Consistent hashing with virtual nodes and bounded loads: exact, deterministic behaviour."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import xxhash

from splitserve.router.ring import HashRing, key_position, load_cap

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]
KEYS = [f"session-{i}" for i in range(5000)]


def placements(ring: HashRing) -> dict[str, str]:
    return {k: ring.owner(k) for k in KEYS}


def test_positions_are_stable_across_processes():
    code = "from splitserve.router.ring import key_position as p; print(p('session-7'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == key_position("session-7")


def test_ring_does_not_depend_on_insertion_order():
    a, b = HashRing(URLS), HashRing(reversed(URLS))
    assert placements(a) == placements(b)


def test_keys_spread_over_all_members():
    counts = Counter(placements(HashRing(URLS)).values())
    assert set(counts) == set(URLS)
    # 160 virtual nodes keep every member within 25% of its fair share.
    assert all(0.75 * 1000 <= c <= 1.25 * 1000 for c in counts.values()), counts


def test_removing_a_member_moves_only_its_keys():
    ring = HashRing(URLS)
    before = placements(ring)
    ring.remove(URLS[2])
    after = placements(ring)
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == URLS[2]}
    assert 0.15 <= len(moved) / len(KEYS) <= 0.25  # about 1/N with N = 5


def test_adding_a_member_takes_only_the_keys_it_now_owns():
    ring = HashRing(URLS[:4])
    before = placements(ring)
    ring.add(URLS[4])
    after = placements(ring)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == URLS[4] for k in moved)
    assert 0.15 <= len(moved) / len(KEYS) <= 0.25


def test_preference_visits_each_member_once_starting_at_the_owner():
    ring = HashRing(URLS)
    order = list(ring.preference("abc"))
    assert sorted(order) == sorted(URLS)
    assert order[0] == ring.owner("abc")


def test_empty_ring_has_no_owner():
    assert HashRing().owner("k") is None
    assert HashRing(URLS).bounded_owner("k", {}) is None


@pytest.mark.parametrize(
    ("total", "members", "c", "cap"),
    [(0, 3, 1.25, 1), (2, 3, 1.25, 2), (11, 3, 1.25, 5), (12, 4, 1.0, 4), (100, 4, 1.25, 32)],
)
def test_load_cap_counts_the_request_being_placed(total, members, c, cap):
    assert load_cap(total, members, c) == cap


@pytest.mark.parametrize(
    ("total", "members", "c", "floor", "cap"),
    [(1, 4, 1.25, 1, 1), (1, 4, 1.25, 2, 2), (3, 4, 1.25, 3, 3), (100, 4, 1.25, 3, 32)],
)
def test_load_floor_raises_a_small_cap_and_leaves_a_large_one(total, members, c, floor, cap):
    assert load_cap(total, members, c, floor) == cap


def test_a_load_floor_keeps_a_turn_home_behind_one_request():
    ring = HashRing(URLS[:4])
    order = list(ring.preference("s"))
    loads = {order[0]: 1, order[1]: 0, order[2]: 0, order[3]: 0}  # cap = ceil(1.25 * 2 / 4) = 1
    assert ring.bounded_owner("s", loads) == order[1]
    assert ring.bounded_owner("s", loads, floor=2) == order[0]
    loads[order[0]] = 2  # at the floor: full again
    assert ring.bounded_owner("s", loads, floor=2) == order[1]


def test_bounded_owner_stays_home_below_the_cap():
    ring = HashRing(URLS[:3])
    home = ring.owner("s")
    loads = dict.fromkeys(URLS[:3], 2)  # cap = ceil(1.25 * 7 / 3) = 3: home has room
    assert ring.bounded_owner("s", loads) == home


def test_bounded_owner_overflows_to_the_next_member_clockwise():
    ring = HashRing(URLS[:3])
    order = list(ring.preference("s"))
    loads = {order[0]: 5, order[1]: 0, order[2]: 0}  # cap = ceil(1.25 * 6 / 3) = 3
    assert ring.bounded_owner("s", loads) == order[1]
    loads = {order[0]: 5, order[1]: 5, order[2]: 0}  # cap = ceil(1.25 * 11 / 3) = 5
    assert ring.bounded_owner("s", loads) == order[2]


def test_bounded_owner_skips_members_missing_from_loads():
    ring = HashRing(URLS[:3])
    order = list(ring.preference("s"))
    assert ring.bounded_owner("s", {order[1]: 0, order[2]: 0}) == order[1]


def test_bounded_loads_never_exceed_the_cap_while_filling():
    ring = HashRing(URLS[:4])
    loads = dict.fromkeys(URLS[:4], 0)
    for _ in range(400):
        # Every request is the same hot session: it must spill once home is at the cap.
        cap = load_cap(sum(loads.values()), 4, 1.25)
        chosen = ring.bounded_owner("hot", loads)
        loads[chosen] += 1
        assert loads[chosen] <= cap
    assert max(loads.values()) <= 125  # ceil(1.25 * 400 / 4)


def test_a_key_with_a_lone_surrogate_has_a_position():
    """Regression (tests/fuzz/test_hostile.py): a body's ``"user": "x\\udfff"`` is a session
    key that strict UTF-8 refuses; the router answered 500. Other keys keep their positions."""
    assert key_position("x\udfff") != key_position("x")
    assert key_position("session-7") == xxhash.xxh3_64_intdigest(b"session-7")
