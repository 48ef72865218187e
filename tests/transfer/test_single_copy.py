"""The in-place paths: shm straight out of a shared-memory cache, blocks as runs of the cache,
vectored socket IO, and connections kept between pulls. Real sockets, real /dev/shm."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest
import torch

from splitserve.engine.kv_pages import KVCacheBlocks, PagedBytes, gather_blocks
from splitserve.engine.shm_cache import SharedKVCache
from splitserve.transfer import (
    ChecksumMismatch,
    ConnectionDropped,
    FaultInjection,
    LeaseTable,
    ProtocolError,
    TransferConfig,
    get_connector,
)
from splitserve.transfer.payload import checksum
from splitserve.transfer.wire import Channel
from tests.transfer.helpers import (
    BLOCK_NBYTES,
    CACHE_SHAPE,
    SECRET,
    assert_blocks_equal,
    client,
    make_cache,
    plan_all,
    shm_segments,
    wait_until,
)


def test_shm_copies_straight_out_of_a_shared_cache(make_peer, shm_prefix: str) -> None:
    peer = make_peer("shm-shared", chunk_bytes=2 * BLOCK_NBYTES)  # 3 SHM_READY batches
    puller = client("shm")
    dst = torch.zeros_like(peer.cache)
    plan = plan_all(peer.offer("req-1", [3, 9, 4, 20, 21, 22]))
    puller.pull(plan, KVCacheBlocks(dst), [1, 2, 5, 6, 7, 8])
    assert_blocks_equal(peer.cache, [3, 9, 4, 20, 21, 22], dst, [1, 2, 5, 6, 7, 8])
    # No staging segment: the only segment is the cache, which the client keeps mapped.
    assert shm_segments(shm_prefix) == [peer.shared.name] == puller.maps.names()
    assert peer.server.segments.idle_names() == []
    # ... read-only: the decode side cannot write into the prefill worker's cache.
    mapped = puller.maps.pages(peer.shared.name, 2 * 2, 32, BLOCK_NBYTES // 4)
    assert not mapped.array.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        mapped.array[0, 0, 0] = 1
    puller.close()


def test_shm_corruption_is_caught_without_touching_the_shared_cache(make_peer) -> None:
    peer = make_peer("shm-shared", shm_checksums=True, fault=FaultInjection(corrupt_block=1))
    before = peer.cache.clone()
    plan = plan_all(peer.offer("req-1", [5, 6, 7]))
    sink = KVCacheBlocks(torch.zeros_like(peer.cache))
    with pytest.raises(ChecksumMismatch, match="position 1"):
        client("shm").pull(plan, sink, [0, 1, 2])
    assert torch.equal(peer.cache, before)
    client("shm").pull(plan, sink, [0, 1, 2])
    assert_blocks_equal(peer.cache, [5, 6, 7], sink.kv_cache, [0, 1, 2])


@pytest.mark.parametrize("kind", ["shm", "shm-shared"])
def test_shm_checksums_are_opt_in_and_a_client_that_wants_them_refuses_a_batch_without(
    make_peer, kind: str
) -> None:
    # By default neither side checksums (the lease keeps the blocks still under the copy);
    # the bytes still arrive exactly. A client asking for checksums refuses such a batch.
    peer = make_peer(kind)
    plan = plan_all(peer.offer("req-1", [4, 5, 6]))
    sink = KVCacheBlocks(torch.zeros_like(peer.cache))
    with pytest.raises(ProtocolError, match="without checksums"):
        client("shm", shm_checksums=True).pull(plan, sink, [0, 1, 2])
    client("shm").pull(plan, sink, [0, 1, 2])
    assert_blocks_equal(peer.cache, [4, 5, 6], sink.kv_cache, [0, 1, 2])
    faulty = TransferConfig(SECRET, fault=FaultInjection(corrupt_block=0))
    with pytest.raises(ValueError, match="needs shm_checksums"):
        get_connector("shm", faulty).make_server(KVCacheBlocks(make_cache(1)), LeaseTable())


def test_map_of_an_unlinked_cache_is_dropped(make_peer) -> None:
    # A prefill worker that stops (or restarts) unlinks its cache: the decode side must not
    # keep its memory alive through a stale map.
    peer = make_peer("shm-shared")
    puller = client("shm")
    puller.pull(plan_all(peer.offer("req-1", [1, 2])), KVCacheBlocks(make_cache(1)), [0, 1])
    assert puller.maps.names() == [peer.shared.name]
    peer.shared.close()
    puller.maps.prune()
    assert puller.maps.names() == []


def test_shared_cache_is_unlinked_when_its_process_is_killed(shm_prefix: str) -> None:
    code = (
        "import sys, torch\n"
        "from splitserve.engine.shm_cache import SharedKVCache\n"
        f"c = SharedKVCache((4, 1024), torch.float32, {shm_prefix + 'cache-'!r})\n"
        "print(c.name, flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        name = proc.stdout.readline().strip()
        assert shm_segments(shm_prefix) == [name]
        proc.kill()  # no chance to clean up: the resource tracker must
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert wait_until(lambda: shm_segments(shm_prefix) == [], timeout_s=10)


def test_shared_cache_close_unlinks_the_name_and_keeps_the_tensor(shm_prefix: str) -> None:
    cache = SharedKVCache(CACHE_SHAPE, torch.bfloat16, f"{shm_prefix}cache-")
    assert cache.tensor.shape == CACHE_SHAPE and not cache.tensor.any()
    assert shm_segments(shm_prefix) == [cache.name]
    cache.close()
    assert shm_segments(shm_prefix) == []
    cache.tensor.fill_(1.5)
    assert cache.tensor.sum().item() == 1.5 * cache.tensor.numel()
    with pytest.raises(ValueError, match="prefix"):
        SharedKVCache((4,), torch.float32, "other-prefix-")


@pytest.mark.parametrize("transport", ["tcp", "shm-shared"])
def test_connection_kept_between_pulls_and_replaced_once_closed(make_peer, transport) -> None:
    # The server drops connections idle for 1 s; the client must notice, not fail.
    peer = make_peer(transport, io_timeout_s=1.0)
    puller = client(transport)
    dst = KVCacheBlocks(torch.zeros_like(peer.cache))
    for i in range(3):
        puller.pull(plan_all(peer.offer(f"req-{i}", [i, i + 1])), dst, [0, 1])
    assert peer.server.connections[0] == 1
    assert wait_until(lambda: peer.server.connections[1] == 0)  # the server closed it
    puller.pull(plan_all(peer.offer("req-3", [7, 8])), dst, [0, 1])
    assert_blocks_equal(peer.cache, [7, 8], dst.kv_cache, [0, 1])
    assert peer.server.connections[0] == 2
    puller.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_runs_are_the_block_major_bytes(dtype: torch.dtype) -> None:
    cache = make_cache(2, dtype)
    pages = PagedBytes.of_cache(cache)
    gathered = gather_blocks(cache, [7]).view(torch.uint8).numpy().reshape(-1)
    runs = pages.runs(7)
    assert len(runs) == 2 * 2 and b"".join(runs) == gathered.tobytes()
    assert checksum(runs) == checksum([memoryview(gathered)])
    other = torch.zeros_like(cache)
    PagedBytes.of_cache(other).copy_block(pages, 7, 30)
    assert torch.equal(other[:, :, 30], cache[:, :, 7]) and other[:, :, :30].eq(0).all()
    with pytest.raises(IndexError):
        pages.runs(32)


def test_vectored_io_survives_partial_sends_and_receives() -> None:
    left, right = socket.socketpair()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # force many partial calls
    right.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sender, receiver = Channel(left, 5), Channel(right, 5)
    data = torch.randint(0, 256, (300_000,), dtype=torch.uint8).numpy()
    sizes = [1, 7, 4096, 12_288, 50_000, 3] * 4 + [300_000 - 4 * 66_395]
    parts, start = [], 0
    for size in sizes:
        parts.append(memoryview(data[start : start + size]))
        start += size
    out = bytearray(len(data))
    targets = [memoryview(out)[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(len(sizes))]
    thread = threading.Thread(target=sender.send_parts, args=(parts,))
    thread.start()
    receiver.recv_into_parts(targets)
    thread.join(5)
    assert bytes(out) == data.tobytes()
    sender.close()
    with pytest.raises(ConnectionDropped):
        receiver.recv_into_parts([memoryview(bytearray(10))])
    receiver.close()


def test_shared_cache_larger_than_dev_shm_is_a_clear_error(shm_prefix: str) -> None:
    fs = os.statvfs("/dev/shm")
    if fs.f_blocks == 0:
        pytest.skip("/dev/shm has no size limit")
    too_big = 2 * fs.f_blocks * fs.f_frsize // 4  # float32 elements; refused up front, not filled
    with pytest.raises(ValueError, match="lower --kv-cache-gb"):
        SharedKVCache((too_big,), torch.float32, f"{shm_prefix}cache-")
    assert shm_segments(shm_prefix) == []


def test_chunks_start_at_one_block_and_double_up_to_the_cap(make_peer) -> None:
    server = make_peer("tcp", chunk_bytes=16 * BLOCK_NBYTES).server
    spans = [(s.start, s.stop) for s in server.chunks(40, BLOCK_NBYTES)]
    assert spans == [(0, 1), (1, 3), (3, 7), (7, 15), (15, 31), (31, 40)]
    assert [(s.start, s.stop) for s in server.chunks(2, BLOCK_NBYTES)] == [(0, 1), (1, 2)]


def test_orphaned_cache_of_a_dead_process_is_unlinked_by_the_next_one(shm_prefix: str) -> None:
    # A worker SIGKILLed with its whole process group takes its resource tracker along: the
    # next cache created on the host cleans up after it.
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    dead_pid = int(done.stdout)
    prefix = f"{shm_prefix}cache-"
    orphan = f"{prefix}{dead_pid}-deadbeef"
    ours = f"{prefix}{os.getpid()}-cafe0000"
    for name in (orphan, ours):
        with open(f"/dev/shm/{name}", "wb") as f:
            f.write(b"x")
    cache = SharedKVCache((4,), torch.float32, prefix)
    assert shm_segments(shm_prefix) == sorted([ours, cache.name])
    cache.close()
    os.unlink(f"/dev/shm/{ours}")
