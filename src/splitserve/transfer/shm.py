"""The ``shm`` transport: KV blocks through POSIX shared memory, for workers on one host.

The authenticated control channel is the same socket protocol as ``tcp``; the bytes never
go through it::

    client                      server
    PULL(request, positions) ->
                                create segment, gather blocks into it (one copy), checksum
                             <- SHM_READY(segment name, descriptors)
    map segment, verify,
    scatter into the cache (one copy), unmap
    SHM_DONE                 ->
                                unlink segment

The server creates every segment and unlinks it (``shm_pool.py``): a segment whose pull
failed (client error, timeout, dropped connection) at once; a healthy one is kept for reuse
within a byte budget and unlinked at ``stop()``. Nothing outlives the server in ``/dev/shm``;
if the server process dies, ``multiprocessing``'s resource tracker unlinks its segments.
The client maps segments without registering them with its own resource tracker, which in
Python 3.11 would otherwise unlink them under the server or warn at exit. Payloads are
never encrypted: they do not leave the host, and segments are created mode 0600.
"""

from __future__ import annotations

import _posixshmem
import mmap
import os
from collections.abc import Sequence
from multiprocessing import shared_memory

import torch

from splitserve.transfer.auth import PayloadCipher
from splitserve.transfer.base import BlockSink, BlockSource, KVConnector, TransferConfig
from splitserve.transfer.client import ThreadedKVClient, expect_layout
from splitserve.transfer.errors import ProtocolError
from splitserve.transfer.kv_pages import as_bytes, dtype_name
from splitserve.transfer.lease import Lease, LeaseTable
from splitserve.transfer.payload import (
    BatchMeta,
    BlockEntry,
    check_batch,
    checksum,
    pack_batch,
    unpack_batch,
    verify,
)
from splitserve.transfer.scheduler import LoadPlan
from splitserve.transfer.server import FaultDrop, ThreadedKVServer
from splitserve.transfer.shm_pool import DEFAULT_MAX_IDLE_BYTES, SegmentPool
from splitserve.transfer.wire import Channel, Msg

DEFAULT_SEGMENT_PREFIX = "splitserve-kv-"


class ShmKVServer(ThreadedKVServer):
    """Serves leased blocks through shared-memory segments from a ``SegmentPool``
    (``max_idle_bytes=0``: a fresh segment per pull, unlinked right after it)."""

    def __init__(
        self,
        source: BlockSource,
        leases: LeaseTable,
        config: TransferConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        segment_prefix: str = DEFAULT_SEGMENT_PREFIX,
        max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES,
    ) -> None:
        if not segment_prefix.startswith(DEFAULT_SEGMENT_PREFIX) or "/" in segment_prefix:
            raise ValueError(f"segment_prefix must start with {DEFAULT_SEGMENT_PREFIX!r}")
        super().__init__(source, leases, config, host, port)
        self.segments = SegmentPool(segment_prefix, max_idle_bytes)

    def stop(self, timeout_s: float = 5.0) -> None:
        super().stop(timeout_s)
        self.segments.close()

    def serve_pull(
        self, ch: Channel, cipher: PayloadCipher | None, lease: Lease, indices: Sequence[int]
    ) -> None:
        shape, dtype = tuple(self.source.block_shape), self.source.dtype
        size = len(indices) * int(torch.Size(shape).numel()) * dtype.itemsize
        segment, healthy = self.segments.take(size), False
        try:
            meta = self._fill(segment, lease, indices, shape, dtype)
            fault = self.config.fault
            if fault is not None and fault.drop_after_bytes is not None:
                raise FaultDrop("drop_after_bytes: cut before announcing the segment")
            ch.send(Msg.SHM_READY, pack_batch(meta))
            ch.expect(Msg.SHM_DONE)
            healthy = True
        finally:
            self.segments.give_back(segment, healthy)

    def _fill(
        self,
        segment: shared_memory.SharedMemory,
        lease: Lease,
        indices: Sequence[int],
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> BatchMeta:
        blocks = _tensor_over(segment.buf, len(indices), shape, dtype)
        self.source.read_into([lease.block_ids[i] for i in indices], blocks)
        raw = as_bytes(blocks)
        entries = [
            BlockEntry(i, lease.hashes[i] if i < len(lease.hashes) else None, checksum(raw[j]))
            for j, i in enumerate(indices)
        ]
        numbers = self.next_block_numbers(len(indices))
        fault = self.config.fault
        if fault is not None and fault.corrupt_block in numbers:
            raw[fault.corrupt_block - numbers.start, 0] ^= 0xFF
        return BatchMeta(dtype_name(dtype), shape, entries, segment.name)


class ShmKVClient(ThreadedKVClient):
    """Pulls blocks from a same-host ``ShmKVServer`` into a ``BlockSink``."""

    def receive(
        self,
        ch: Channel,
        cipher: PayloadCipher | None,
        plan: LoadPlan,
        sink: BlockSink,
        dest_block_ids: Sequence[int],
    ) -> int:
        dtype, shape, per_block = expect_layout(sink)
        frame = ch.expect(Msg.SHM_READY)
        meta = unpack_batch(frame.meta)
        check_batch(meta, dtype, shape, plan.load_indices, plan.hashes)
        # Map only segments named like ours: belt and braces against an authenticated but
        # buggy peer pointing us at some other program's memory.
        if not meta.segment.startswith(DEFAULT_SEGMENT_PREFIX) or "/" in meta.segment:
            raise ProtocolError(f"peer named an unexpected segment {meta.segment!r}")
        mapping = _attach(meta.segment, plan.num_blocks * per_block)
        try:
            blocks = _tensor_over(mapping, plan.num_blocks, shape, sink.dtype)
            raw = as_bytes(blocks)
            for j, entry in enumerate(meta.entries):
                verify(entry, raw[j])
            sink.write(dest_block_ids, blocks)
            del blocks, raw  # the mapping cannot close while views of it exist
        finally:
            _close(mapping)
        ch.send(Msg.SHM_DONE)
        return plan.num_blocks * per_block


def _tensor_over(buf: memoryview | mmap.mmap, n: int, shape: tuple[int, ...], dtype: torch.dtype):
    count = n * int(torch.Size(shape).numel())
    return torch.frombuffer(buf, dtype=dtype, count=count).view(n, *shape)


def _attach(name: str, size: int) -> mmap.mmap:
    """Map an existing segment without registering it with this process's resource tracker."""
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError as exc:
        raise ProtocolError(f"shared-memory segment {name!r} does not exist") from exc
    try:
        if os.fstat(fd).st_size < size:
            raise ProtocolError(f"segment {name!r} is smaller than the {size} bytes announced")
        # MAP_POPULATE maps every page now, in one call, instead of one fault per 4 KiB page.
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)


def _close(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:
        # A view still exists (only on an error path); the mapping goes when it is collected.
        pass


class ShmConnector(KVConnector):
    """``get_connector("shm", config)``: same host only; the payload skips the socket."""

    name = "shm"

    def make_server(
        self,
        source: BlockSource,
        leases: LeaseTable,
        host: str = "127.0.0.1",
        port: int = 0,
        segment_prefix: str = DEFAULT_SEGMENT_PREFIX,
        max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES,
    ) -> ShmKVServer:
        return ShmKVServer(source, leases, self.config, host, port, segment_prefix, max_idle_bytes)

    def make_client(self) -> ShmKVClient:
        return ShmKVClient(self.config)
