"""LeaseTable semantics with an injected clock: grant, renew, release, expire, checkout."""

from __future__ import annotations

import pytest

from splitserve.transfer import LeaseNotFound, LeaseTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def table() -> tuple[LeaseTable, Clock, list[tuple[str, str]]]:
    clock, ended = Clock(), []
    leases = LeaseTable(
        on_end=lambda lease, why: ended.append((lease.request_id, why)), clock=clock
    )
    return leases, clock, ended


def test_release_hands_blocks_back_once(table) -> None:
    leases, _, ended = table
    leases.grant("a", [4, 5, 6], [b"x" * 16, b"y" * 16])
    assert leases.leased_blocks() == 3
    assert leases.release("a").block_ids == (4, 5, 6)
    assert ended == [("a", "released")]
    with pytest.raises(LeaseNotFound, match="was released"):
        leases.release("a")
    assert ended == [("a", "released")] and len(leases) == 0


def test_expire_at_deadline_and_renew_pushes_it(table) -> None:
    leases, clock, ended = table
    leases.grant("a", [1], ttl_s=10)
    leases.grant("b", [2], ttl_s=30)
    clock.now += 8
    leases.renew("a")  # deadline now 118
    clock.now += 9  # 117
    assert leases.expire() == []
    clock.now += 1  # 118: a's deadline
    assert [lease.request_id for lease in leases.expire()] == ["a"]
    assert ended == [("a", "expired")]
    assert [lease.request_id for lease in leases.expire(now=130.0)] == ["b"]
    with pytest.raises(LeaseNotFound, match="was expired"):
        leases.renew("a")


def test_past_deadline_lease_is_not_live_before_reaping(table) -> None:
    leases, clock, ended = table
    leases.grant("a", [1], ttl_s=5)
    clock.now += 5
    assert leases.get("a") is None
    with pytest.raises(LeaseNotFound, match="has expired"):
        leases.renew("a")
    assert ended == []  # handed back by expire(), exactly once
    leases.expire()
    assert ended == [("a", "expired")]


def test_checked_out_lease_never_expires_and_release_waits_for_reader(table) -> None:
    leases, clock, ended = table
    leases.grant("a", [1, 2], ttl_s=5)
    with leases.checkout("a"):
        clock.now += 60
        assert leases.expire() == []
        leases.release("a")
        assert ended == []  # a transfer is still reading the blocks
    assert ended == [("a", "released")]


def test_unknown_duplicate_and_bad_grants(table) -> None:
    leases, _, _ = table
    with pytest.raises(LeaseNotFound, match="is unknown"):
        leases.renew("nope")
    leases.grant("a", [1])
    with pytest.raises(ValueError, match="already holds"):
        leases.grant("a", [2])
    with pytest.raises(ValueError, match="hashes for"):
        leases.grant("b", [1], [b"x" * 16, b"y" * 16])
    with pytest.raises(ValueError, match="ttl_s"):
        leases.grant("c", [1], ttl_s=0)


def test_callback_error_does_not_break_the_table() -> None:
    def boom(lease, why) -> None:
        raise RuntimeError("engine hiccup")

    leases = LeaseTable(on_end=boom)
    leases.grant("a", [1])
    leases.release("a")
    assert len(leases) == 0
