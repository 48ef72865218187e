"""The ``tcp`` transport: KV blocks over an authenticated socket, across hosts.

A pull is answered in chunks of about ``chunk_bytes``: the server gathers a chunk of blocks
into a reused buffer, checksums each block and sends ``BLOCKS`` (descriptors, then the raw
bytes straight from the buffer), and ends with ``END``. The client ``recv_into``s each
chunk into its own reused buffer, verifies it and scatters it into the cache. Chunking
bounds memory on both sides and lets the server gather chunk k+1 while the client scatters
chunk k.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from splitserve.transfer.auth import GCM_TAG_BYTES, PayloadCipher, block_aad
from splitserve.transfer.base import BlockSink, BlockSource, KVConnector
from splitserve.transfer.client import ThreadedKVClient, expect_layout
from splitserve.transfer.errors import ProtocolError
from splitserve.transfer.kv_pages import BufferPool, as_bytes, dtype_name
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


class TcpKVServer(ThreadedKVServer):
    """Serves leased blocks over TCP (see the module docstring for the message flow)."""

    buffers = BufferPool()  # shared by every server in the process, like the cores it saves

    def serve_pull(
        self, ch: Channel, cipher: PayloadCipher | None, lease: Lease, indices: Sequence[int]
    ) -> None:
        shape, dtype = tuple(self.source.block_shape), self.source.dtype
        per_chunk = max(1, self.config.chunk_bytes // _nbytes(shape, dtype))
        buf = self.buffers.take(min(per_chunk, len(indices)), shape, dtype)
        out = _Outbox(ch, self.config.fault.drop_after_bytes if self.config.fault else None)
        try:
            for start in range(0, len(indices), per_chunk):
                chunk = list(indices[start : start + per_chunk])
                blocks = buf[: len(chunk)]
                self.source.read_into([lease.block_ids[i] for i in chunk], blocks)
                self._send_chunk(out, cipher, lease, chunk, as_bytes(blocks))
        finally:
            self.buffers.give_back(buf)
        ch.send(Msg.END)

    def _send_chunk(
        self,
        out: _Outbox,
        cipher: PayloadCipher | None,
        lease: Lease,
        chunk: list[int],
        raw: np.ndarray,
    ) -> None:
        entries = [
            BlockEntry(
                i, _hash_at(lease, i), checksum(raw[j]), cipher.new_nonce() if cipher else bytes(12)
            )
            for j, i in enumerate(chunk)
        ]
        corrupt = self._corrupt_position(len(chunk))
        if corrupt is not None and cipher is None:
            raw[corrupt, 0] ^= 0xFF  # our gathered copy, never the cache
        meta = BatchMeta(dtype_name(self.source.dtype), tuple(self.source.block_shape), entries)
        tag = GCM_TAG_BYTES if cipher else 0
        out.ch.send_header(Msg.BLOCKS, pack_batch(meta), len(chunk) * (raw.shape[1] + tag))
        if cipher is None:
            out.send(memoryview(raw.reshape(-1)))
            return
        sealed = bytearray(raw.shape[1] + tag)
        for j, entry in enumerate(entries):
            aad = block_aad(lease.request_id, entry.index, entry.hash)
            cipher.encrypt_into(entry.nonce, memoryview(raw[j]), aad, sealed)
            if j == corrupt:
                sealed[0] ^= 0xFF
            out.send(memoryview(sealed))

    def _corrupt_position(self, n: int) -> int | None:
        numbers = self.next_block_numbers(n)
        fault = self.config.fault
        if fault is None or fault.corrupt_block is None or fault.corrupt_block not in numbers:
            return None
        return fault.corrupt_block - numbers.start


class TcpKVClient(ThreadedKVClient):
    """Pulls blocks over TCP into a ``BlockSink``."""

    buffers = BufferPool()

    def receive(
        self,
        ch: Channel,
        cipher: PayloadCipher | None,
        plan: LoadPlan,
        sink: BlockSink,
        dest_block_ids: Sequence[int],
    ) -> int:
        held: list[torch.Tensor] = []  # the staging buffer, whatever size it grew to
        try:
            return self._receive_chunks(ch, cipher, plan, sink, dest_block_ids, held)
        finally:
            for buf in held:
                self.buffers.give_back(buf)

    def _receive_chunks(
        self,
        ch: Channel,
        cipher: PayloadCipher | None,
        plan: LoadPlan,
        sink: BlockSink,
        dest_block_ids: Sequence[int],
        held: list[torch.Tensor],
    ) -> int:
        dtype, shape, per_block = expect_layout(sink)
        hashes, pos = plan.hashes, 0
        while (frame := ch.expect(Msg.BLOCKS, Msg.END)).type is Msg.BLOCKS:
            meta = unpack_batch(frame.meta)
            n = len(meta.entries)
            if n == 0 or pos + n > plan.num_blocks:
                raise ProtocolError(f"peer sent {n} blocks at {pos} of {plan.num_blocks}")
            check_batch(meta, dtype, shape, plan.load_indices[pos : pos + n], hashes[pos : pos + n])
            tag = GCM_TAG_BYTES if cipher else 0
            if frame.payload_len != n * (per_block + tag):
                raise ProtocolError(f"BLOCKS payload of {frame.payload_len} bytes for {n} blocks")
            if not held or held[0].shape[0] < n:
                if held:
                    self.buffers.give_back(held.pop())
                held.append(self.buffers.take(n, shape, sink.dtype))
            buf = held[0]
            raw = as_bytes(buf[:n])
            _recv_blocks(ch, cipher, plan.remote.request_id, meta.entries, raw)
            for j, entry in enumerate(meta.entries):
                verify(entry, raw[j])
            sink.write(dest_block_ids[pos : pos + n], buf[:n])
            pos += n
        if pos != plan.num_blocks:
            raise ProtocolError(f"peer ended the pull after {pos} of {plan.num_blocks} blocks")
        return pos * per_block


def _recv_blocks(
    ch: Channel,
    cipher: PayloadCipher | None,
    request_id: str,
    entries: list[BlockEntry],
    raw: np.ndarray,
) -> None:
    if cipher is None:
        ch.recv_into(memoryview(raw.reshape(-1)))
        return
    sealed = bytearray(raw.shape[1] + GCM_TAG_BYTES)
    for j, entry in enumerate(entries):
        ch.recv_into(memoryview(sealed))
        aad = block_aad(request_id, entry.index, entry.hash)
        cipher.decrypt_into(entry.nonce, memoryview(sealed), aad, memoryview(raw[j]))


class _Outbox:
    """Sends payload bytes, cutting the connection after ``drop_after`` of them (test fault)."""

    def __init__(self, ch: Channel, drop_after: int | None) -> None:
        self.ch, self.left = ch, drop_after

    def send(self, data: memoryview) -> None:
        if self.left is not None and data.nbytes >= self.left:
            self.ch.send_raw(data[: self.left])
            raise FaultDrop("drop_after_bytes reached")
        if self.left is not None:
            self.left -= data.nbytes
        self.ch.send_raw(data)


def _hash_at(lease: Lease, index: int) -> bytes | None:
    return lease.hashes[index] if index < len(lease.hashes) else None


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * dtype.itemsize


class TcpConnector(KVConnector):
    """``get_connector("tcp", config)``: works across hosts."""

    name = "tcp"

    def make_server(
        self, source: BlockSource, leases: LeaseTable, host: str = "127.0.0.1", port: int = 0
    ) -> TcpKVServer:
        return TcpKVServer(source, leases, self.config, host, port)

    def make_client(self) -> TcpKVClient:
        return TcpKVClient(self.config)
