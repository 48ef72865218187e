"""The ``tcp`` transport: KV blocks over an authenticated socket, across hosts.

A pull is answered in chunks (one block, then doubling up to ``chunk_bytes``): the server
checksums a chunk's blocks where they lie in its cache and sends ``BLOCKS`` (descriptors,
then the raw bytes), and ends with ``END``. Neither side copies a block outside the socket:
the server writes each block's runs straight out of its cache (``sendmsg``), the client
reads them straight into the blocks it reserved (``recvmsg_into``) and checksums them
there, one block at a time, while the kernel already buffers the next::

    server                                    client
    checksum chunk k (in the cache)
    BLOCKS k: descriptors, runs of the cache ->  recvmsg_into the reserved blocks, verify each
    checksum chunk k+1 ...                       (the socket buffer holds what comes next)
    END                                       ->

Encrypted pulls copy each block once more, into a buffer that AES-GCM seals or opens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from splitserve.engine.kv_pages import PagedBytes, dtype_name
from splitserve.transfer.auth import GCM_TAG_BYTES, PayloadCipher, block_aad
from splitserve.transfer.base import BlockSink, BlockSource, KVConnector
from splitserve.transfer.client import ThreadedKVClient, batches, expect_layout
from splitserve.transfer.errors import ProtocolError
from splitserve.transfer.lease import Lease, LeaseTable
from splitserve.transfer.payload import (
    BatchMeta,
    BlockEntry,
    checksum,
    pack_batch,
    verify,
)
from splitserve.transfer.scheduler import LoadPlan
from splitserve.transfer.server import FaultDrop, ThreadedKVServer
from splitserve.transfer.wire import Channel, Msg

Runs = list[memoryview]  # one block's bytes, as runs of a paged cache


class TcpKVServer(ThreadedKVServer):
    """Serves leased blocks over TCP (see the module docstring for the message flow)."""

    def serve_pull(
        self, ch: Channel, cipher: PayloadCipher | None, lease: Lease, indices: Sequence[int]
    ) -> None:
        pages = self.source.pages
        out = _Outbox(ch, self.config.fault.drop_after_bytes if self.config.fault else None)
        for span in self.chunks(len(indices), pages.block_nbytes):
            chunk = list(indices[span])
            runs = [pages.runs(lease.block_ids[i]) for i in chunk]
            entries = [
                BlockEntry(i, lease.hash_at(i), checksum(r), _nonce(cipher))
                for i, r in zip(chunk, runs, strict=True)
            ]
            corrupt = self._corrupt_position(len(chunk))
            meta = BatchMeta(dtype_name(self.source.dtype), tuple(self.source.block_shape), entries)
            per_block = pages.block_nbytes + (GCM_TAG_BYTES if cipher else 0)
            ch.send_header(Msg.BLOCKS, pack_batch(meta), len(chunk) * per_block)
            if cipher is None:
                if corrupt is not None:
                    runs[corrupt] = [_damaged(runs[corrupt])]  # a copy, never the cache
                out.send([part for block in runs for part in block])
            else:
                _send_sealed(out, cipher, lease.request_id, entries, runs, corrupt)
        ch.send(Msg.END)

    def _corrupt_position(self, n: int) -> int | None:
        numbers = self.next_block_numbers(n)
        fault = self.config.fault
        if fault is None or fault.corrupt_block is None or fault.corrupt_block not in numbers:
            return None
        return fault.corrupt_block - numbers.start


def _send_sealed(
    out: _Outbox,
    cipher: PayloadCipher,
    request_id: str,
    entries: list[BlockEntry],
    runs: list[Runs],
    corrupt: int | None,
) -> None:
    plain = bytearray(sum(part.nbytes for part in runs[0]))
    sealed = bytearray(len(plain) + GCM_TAG_BYTES)
    for j, (entry, block) in enumerate(zip(entries, runs, strict=True)):
        _join_into(block, plain)
        aad = block_aad(request_id, entry.index, entry.hash)
        cipher.encrypt_into(entry.nonce, memoryview(plain), aad, sealed)
        if j == corrupt:
            sealed[0] ^= 0xFF
        out.send([memoryview(sealed)])


class TcpKVClient(ThreadedKVClient):
    """Pulls blocks over TCP into a ``BlockSink``."""

    def receive(
        self,
        ch: Channel,
        cipher: PayloadCipher | None,
        plan: LoadPlan,
        sink: BlockSink,
        dest_block_ids: Sequence[int],
    ) -> int:
        per_block = expect_layout(sink)[2] + (GCM_TAG_BYTES if cipher else 0)
        for frame, meta, targets in batches(ch, Msg.BLOCKS, plan, sink, dest_block_ids):
            if frame.payload_len != len(targets) * per_block:
                raise ProtocolError(f"BLOCKS payload of {frame.payload_len} bytes")
            if cipher is None:
                _recv_plain(ch, meta.entries, sink.pages, targets)
            else:
                _recv_sealed(ch, cipher, plan.remote.request_id, meta.entries, sink.pages, targets)
        return plan.num_blocks * sink.pages.block_nbytes


def _recv_plain(
    ch: Channel, entries: list[BlockEntry], pages: PagedBytes, targets: Sequence[int]
) -> None:
    # Straight into the reserved blocks: a block that fails its checksum is never read, the
    # decode worker frees every reserved block when the pull raises.
    for entry, block in zip(entries, targets, strict=True):
        runs = pages.runs(block)
        ch.recv_into_parts(runs)
        verify(entry, runs)


def _recv_sealed(
    ch: Channel,
    cipher: PayloadCipher,
    request_id: str,
    entries: list[BlockEntry],
    pages: PagedBytes,
    targets: Sequence[int],
) -> None:
    sealed = bytearray(pages.block_nbytes + GCM_TAG_BYTES)
    plain = np.empty(pages.block_nbytes, np.uint8)
    for entry, block in zip(entries, targets, strict=True):
        ch.recv_into(memoryview(sealed))
        aad = block_aad(request_id, entry.index, entry.hash)
        cipher.decrypt_into(entry.nonce, memoryview(sealed), aad, memoryview(plain))
        verify(entry, [memoryview(plain)])
        pages.write_block(block, plain)


class _Outbox:
    """Sends payload bytes, cutting the connection after ``drop_after`` of them (test fault)."""

    def __init__(self, ch: Channel, drop_after: int | None) -> None:
        self.ch, self.left = ch, drop_after

    def send(self, parts: Runs) -> None:
        size = sum(part.nbytes for part in parts)
        if self.left is None or size < self.left:
            self.left = None if self.left is None else self.left - size
            self.ch.send_parts(parts)
            return
        cut, left = [], self.left
        for part in parts:
            cut.append(part[: min(left, part.nbytes)])
            left -= cut[-1].nbytes
        self.ch.send_parts(cut)
        raise FaultDrop("drop_after_bytes reached")


def _nonce(cipher: PayloadCipher | None) -> bytes:
    return cipher.new_nonce() if cipher else bytes(12)


def _join_into(parts: Runs, out: bytearray) -> None:
    offset = 0
    for part in parts:
        out[offset : offset + part.nbytes] = part
        offset += part.nbytes


def _damaged(parts: Runs) -> memoryview:
    data = bytearray(sum(part.nbytes for part in parts))
    _join_into(parts, data)
    data[0] ^= 0xFF
    return memoryview(data)


class TcpConnector(KVConnector):
    """``get_connector("tcp", config)``: works across hosts."""

    name = "tcp"

    def make_server(
        self, source: BlockSource, leases: LeaseTable, host: str = "127.0.0.1", port: int = 0
    ) -> TcpKVServer:
        return TcpKVServer(source, leases, self.config, host, port)

    def make_client(self) -> TcpKVClient:
        return TcpKVClient(self.config)
