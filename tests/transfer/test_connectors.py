"""Both transports over real loopback sockets (and real shared memory): exact round trips,
only the planned blocks, authentication, and every failure mode as its own exception."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from splitserve.engine.kv_pages import KVCacheBlocks
from splitserve.transfer import (
    AuthenticationError,
    ChecksumMismatch,
    ConnectionDropped,
    FaultInjection,
    LeaseNotFound,
    PeerUnreachable,
    RemoteKV,
    TransferTimeout,
)
from tests.transfer.helpers import (
    BLOCK_NBYTES,
    assert_blocks_equal,
    chain,
    client,
    make_cache,
    plan_all,
    shm_segments,
    wait_until,
)

# shm-shared: the prefill side's cache lives in shared memory (the single-copy path).
TRANSPORTS = ["tcp", "shm", "shm-shared"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("encrypt", [False, True])
def test_pull_moves_exactly_the_missing_blocks(make_peer, transport: str, encrypt: bool) -> None:
    # chunk_bytes of 3 blocks makes the tcp answer span several BLOCKS frames.
    peer = make_peer(transport, encrypt=encrypt, chunk_bytes=3 * BLOCK_NBYTES)
    remote_ids = [3, 9, 4, 20, 21, 22, 30, 31]  # 7 hashed + a partial tail block
    remote = peer.offer("req-1", remote_ids, num_hashed=7)
    plan = plan_all(remote, held=set(chain(7)[:2]))
    assert plan.load_indices == (2, 3, 4, 5, 6, 7)
    dst, dest_ids = torch.zeros_like(make_cache()), [1, 2, 5, 6, 7, 8]
    result = client(transport, encrypt=encrypt).pull(plan, KVCacheBlocks(dst), dest_ids)
    assert (result.num_blocks, result.nbytes) == (6, 6 * BLOCK_NBYTES)
    assert_blocks_equal(peer.cache, plan.remote_block_ids, dst, dest_ids)
    assert not dst[:, :, [0, 3, 4, 9]].any()  # nothing else written
    assert peer.ended == [("req-1", "released")] and len(peer.leases) == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_wrong_secret_is_refused_and_right_secret_admitted(make_peer, transport: str) -> None:
    peer = make_peer(transport)
    plan = plan_all(peer.offer("req-1", [1, 2, 3]))
    dst = torch.zeros_like(peer.cache)
    with pytest.raises(AuthenticationError):
        client(transport, secret=b"not-the-cluster-secret").pull(
            plan, KVCacheBlocks(dst), [0, 1, 2]
        )
    assert not dst.any() and len(peer.leases) == 1
    client(transport).pull(plan, KVCacheBlocks(dst), [0, 1, 2])
    assert_blocks_equal(peer.cache, [1, 2, 3], dst, [0, 1, 2])


@pytest.mark.parametrize(
    ("transport", "encrypt"),
    [("tcp", False), ("tcp", True), ("shm", False), ("shm-shared", False)],
)
def test_corrupted_block_is_detected_once(make_peer, transport: str, encrypt: bool) -> None:
    checked = {"shm_checksums": True} if transport.startswith("shm") else {}
    peer = make_peer(transport, encrypt=encrypt, fault=FaultInjection(corrupt_block=2), **checked)
    plan = plan_all(peer.offer("req-1", [5, 6, 7, 8]))
    sink = KVCacheBlocks(torch.zeros_like(peer.cache))
    with pytest.raises(ChecksumMismatch):
        client(transport, encrypt=encrypt).pull(plan, sink, [0, 1, 2, 3])
    assert len(peer.leases) == 1  # not confirmed: the lease stays until release or expiry
    client(transport, encrypt=encrypt).pull(plan, sink, [0, 1, 2, 3])  # the fault fires once
    assert_blocks_equal(peer.cache, [5, 6, 7, 8], sink.kv_cache, [0, 1, 2, 3])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_connection_cut_mid_transfer(make_peer, shm_prefix: str, transport: str) -> None:
    peer = make_peer(transport, fault=FaultInjection(drop_after_bytes=700))
    plan = plan_all(peer.offer("req-1", [5, 6, 7, 8]))
    with pytest.raises(ConnectionDropped):
        client(transport).pull(plan, KVCacheBlocks(torch.zeros_like(peer.cache)), [0, 1, 2, 3])
    cache = [peer.shared.name] if peer.shared else []  # no staging segment left behind
    assert wait_until(lambda: shm_segments(shm_prefix) == cache)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unknown_and_expired_leases(make_peer, transport: str) -> None:
    peer = make_peer(transport)
    sink = KVCacheBlocks(torch.zeros_like(peer.cache))
    plan = plan_all(peer.offer("req-1", [5, 6]))
    unknown = plan_all(RemoteKV.from_params({**plan.remote.to_params(), "remote_request_id": "x"}))
    with pytest.raises(LeaseNotFound, match="unknown"):
        client(transport).pull(unknown, sink, [0, 1])
    peer.leases.expire(now=time.monotonic() + 3600)
    assert peer.ended == [("req-1", "expired")]
    with pytest.raises(LeaseNotFound, match="expired"):
        client(transport).pull(plan, sink, [0, 1])
    assert not sink.kv_cache.any()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_timeout_when_the_peer_stalls(make_peer, transport: str) -> None:
    peer = make_peer(transport, fault=FaultInjection(stall_s=5))
    plan = plan_all(peer.offer("req-1", [5, 6]))
    started = time.monotonic()
    with pytest.raises(TransferTimeout):
        client(transport, io_timeout_s=0.3).pull(
            plan, KVCacheBlocks(torch.zeros_like(peer.cache)), [0, 1]
        )
    assert time.monotonic() - started < 3


def test_unreachable_peer() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago and has no listener
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    remote = RemoteKV("p", "r", (1,), "127.0.0.1", port, (), "tcp", 4)
    with pytest.raises(PeerUnreachable):
        client("tcp", connect_timeout_s=1).pull(plan_all(remote), KVCacheBlocks(make_cache()), [0])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_renew_and_release_without_pulling(make_peer, transport: str) -> None:
    peer = make_peer(transport)
    remote = peer.offer("req-1", [5, 6])
    before = peer.leases.get("req-1").expires_at
    assert wait_until(lambda: time.monotonic() > before - 29.9)
    client(transport).renew(remote)
    assert peer.leases.get("req-1").expires_at > before
    client(transport).release(remote)
    assert peer.ended == [("req-1", "released")]
    with pytest.raises(LeaseNotFound):
        client(transport).release(remote)


def test_shm_without_pool_unlinks_after_every_pull(make_peer, shm_prefix: str) -> None:
    peer = make_peer("shm", server={"max_idle_bytes": 0})
    for i in range(3):
        plan = plan_all(peer.offer(f"req-{i}", [i, i + 1]))
        client("shm").pull(plan, KVCacheBlocks(torch.zeros_like(peer.cache)), [0, 1])
        assert wait_until(lambda: shm_segments(shm_prefix) == [])


def test_shm_pool_reuses_one_segment_and_unlinks_it_at_stop(make_peer, shm_prefix) -> None:
    peer = make_peer("shm")
    dst = torch.zeros_like(peer.cache)
    for i in range(3):
        plan = plan_all(peer.offer(f"req-{i}", [i, i + 1, i + 2]))
        client("shm").pull(plan, KVCacheBlocks(dst), [0, 1, 2])
        assert_blocks_equal(peer.cache, [i, i + 1, i + 2], dst, [0, 1, 2])
        assert wait_until(lambda: len(peer.server.segments.idle_names()) == 1)
    assert len(shm_segments(shm_prefix)) == 1
    peer.server.stop()
    assert shm_segments(shm_prefix) == []


def test_shm_failed_pull_never_returns_its_segment_to_the_pool(make_peer, shm_prefix) -> None:
    peer = make_peer("shm", shm_checksums=True, fault=FaultInjection(corrupt_block=0))
    plan = plan_all(peer.offer("req-1", [1, 2]))
    with pytest.raises(ChecksumMismatch):
        client("shm").pull(plan, KVCacheBlocks(torch.zeros_like(peer.cache)), [0, 1])
    assert wait_until(lambda: shm_segments(shm_prefix) == [])
