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

The server creates and unlinks every segment, in a ``finally``: on success, on a client
error or timeout, and on a dropped connection, so nothing is left in ``/dev/shm``. (If the
server process itself dies, ``multiprocessing``'s resource tracker unlinks its segments.)
The client maps segments without registering them with its own resource tracker, which in
Python 3.11 would otherwise unlink them under the server or warn at exit. Payloads are
never encrypted: they do not leave the host, and segments are created mode 0600.
"""

from __future__ import annotations

import _posixshmem
import mmap
import os
import secrets
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
from splitserve.transfer.wire import Channel, Msg

DEFAULT_SEGMENT_PREFIX = "splitserve-kv-"


class ShmKVServer(ThreadedKVServer):
    """Serves leased blocks through shared-memory segments, one per pull."""

    def __init__(
        self,
        source: BlockSource,
        leases: LeaseTable,
        config: TransferConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        segment_prefix: str = DEFAULT_SEGMENT_PREFIX,
    ) -> None:
        if not segment_prefix.startswith(DEFAULT_SEGMENT_PREFIX) or "/" in segment_prefix:
            raise ValueError(f"segment_prefix must start with {DEFAULT_SEGMENT_PREFIX!r}")
        super().__init__(source, leases, config, host, port)
        self.segment_prefix = segment_prefix

    def serve_pull(
        self, ch: Channel, cipher: PayloadCipher | None, lease: Lease, indices: Sequence[int]
    ) -> None:
        shape, dtype = tuple(self.source.block_shape), self.source.dtype
        size = len(indices) * int(torch.Size(shape).numel()) * dtype.itemsize
        name = f"{self.segment_prefix}{secrets.token_hex(8)}"
        segment = shared_memory.SharedMemory(name=name, create=True, size=size)
        try:
            meta = self._fill(segment, lease, indices, shape, dtype)
            fault = self.config.fault
            if fault is not None and fault.drop_after_bytes is not None:
                raise FaultDrop("drop_after_bytes: cut before announcing the segment")
            ch.send(Msg.SHM_READY, pack_batch(meta))
            ch.expect(Msg.SHM_DONE)
        finally:
            segment.unlink()
            _close(segment)

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
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _close(mapping: shared_memory.SharedMemory | mmap.mmap) -> None:
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
    ) -> ShmKVServer:
        return ShmKVServer(source, leases, self.config, host, port, segment_prefix)

    def make_client(self) -> ShmKVClient:
        return ShmKVClient(self.config)
