"""The ``shm`` transport: KV blocks through POSIX shared memory, for workers on one host.

The authenticated control channel is the same socket protocol as ``tcp``; the bytes never
go through it. When the prefill worker's cache itself lives in shared memory
(``shm_cache.SharedKVCache``, what a prefill worker on this transport allocates), a pull is a
single copy, straight from the leased blocks into the decode worker's reserved blocks::

    client                                   server
    PULL(request, positions)            ->
                                        <-   SHM_READY (cache segment, source blocks)
    map the cache read-only (kept),     <-   END
    copy each block into its reserved
    block
    SHM_DONE                            ->   (the lease stays checked out until here)

A server whose cache is private (on another device, or allocated before the transport was
chosen) first copies the blocks into a staging segment laid out the same way, from a
``SegmentPool``, chunk by chunk so that the client copies chunk k while the server stages
chunk k+1, and names that segment instead: two copies, same client.

No checksums by default: the blocks are read while the server holds their lease checked
out, and a checked-out lease is never expired, so the prefill engine cannot rewrite them
under the copy; and they never leave the host. ``TransferConfig.shm_checksums`` asks for
them anyway: the server then checksums every block (in chunks, pipelined like staging) and
flags the batches (``FLAG_CHECKSUMS``), and the client verifies each block where it landed;
a client configured for checksums refuses a batch without them. Payloads are never
encrypted: they do not leave the host, and segments are mode 0600. Staging segments are
created and unlinked by the server (``shm_pool.py``), the cache segment by its engine;
nothing outlives them in ``/dev/shm``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from splitserve.engine.kv_pages import PagedBytes, dtype_name
from splitserve.transfer.auth import PayloadCipher
from splitserve.transfer.base import BlockSink, BlockSource, KVConnector, TransferConfig
from splitserve.transfer.client import ThreadedKVClient, batches
from splitserve.transfer.errors import ProtocolError
from splitserve.transfer.lease import Lease, LeaseTable
from splitserve.transfer.payload import BatchMeta, BlockEntry, checksum, pack_batch, verify
from splitserve.transfer.scheduler import LoadPlan
from splitserve.transfer.segment_maps import SEGMENT_PREFIX, SegmentMaps
from splitserve.transfer.server import FaultDrop, ThreadedKVServer
from splitserve.transfer.shm_pool import DEFAULT_MAX_IDLE_BYTES, SegmentPool
from splitserve.transfer.wire import FLAG_CHECKSUMS, Channel, Msg

DEFAULT_SEGMENT_PREFIX = SEGMENT_PREFIX


class ShmKVServer(ThreadedKVServer):
    """Serves leased blocks through shared memory: out of the cache itself when
    ``source.shm_segment`` names it, else through staging segments from a ``SegmentPool``
    (``max_idle_bytes=0``: a fresh one per pull, unlinked right after it)."""

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
        corrupts = config.fault is not None and config.fault.corrupt_block is not None
        if corrupts and not config.shm_checksums:
            raise ValueError("the corrupt_block fault needs shm_checksums on an shm server")
        super().__init__(source, leases, config, host, port)
        self.segments = SegmentPool(segment_prefix, max_idle_bytes)

    def stop(self, timeout_s: float = 5.0) -> None:
        super().stop(timeout_s)
        self.segments.close()

    def serve_pull(
        self, ch: Channel, cipher: PayloadCipher | None, lease: Lease, indices: Sequence[int]
    ) -> None:
        fault = self.config.fault
        if fault is not None and fault.drop_after_bytes is not None:
            raise FaultDrop("drop_after_bytes: cut before announcing any block")
        blocks = [lease.block_ids[i] for i in indices]
        source = self.source.pages
        if self.source.shm_segment is not None:
            self._announce(ch, lease, indices, self.source.shm_segment, source, blocks)
            ch.expect(Msg.SHM_DONE)
            return
        segment, healthy = self.segments.take(len(blocks) * source.block_nbytes), False
        staged: PagedBytes | None = None
        try:
            capacity = segment.size // source.block_nbytes
            staged = PagedBytes(segment.buf, source.rows, capacity, source.run)
            staging = list(range(len(blocks)))
            self._announce(ch, lease, indices, segment.name, staged, staging, copy_from=blocks)
            ch.expect(Msg.SHM_DONE)
            healthy = True
        finally:
            staged = None  # the segment cannot close while a view of it exists
            self.segments.give_back(segment, healthy)

    def _announce(
        self,
        ch: Channel,
        lease: Lease,
        indices: Sequence[int],
        name: str,
        pages: PagedBytes,
        blocks: Sequence[int],
        copy_from: Sequence[int] | None = None,
    ) -> None:
        """Announce ``indices`` (lying in ``blocks`` of segment ``name``): in chunks when this
        side has work per block (staging, checksums), so the client copies chunk k while this
        side prepares chunk k+1; else all at once."""
        checksums = self.config.shm_checksums
        if copy_from is None and not checksums:
            spans: Iterable[slice] = [slice(0, len(indices))]
        else:
            spans = self.chunks(len(indices), pages.block_nbytes)
        for span in spans:
            if copy_from is not None:
                for src, dst in zip(copy_from[span], blocks[span], strict=True):
                    pages.copy_block(self.source.pages, src, dst)
            entries = [
                BlockEntry(i, lease.hash_at(i), checksum(pages.runs(b)) if checksums else 0)
                for i, b in zip(indices[span], blocks[span], strict=True)
            ]
            if checksums:
                self._corrupt(entries)
            meta = BatchMeta(
                dtype_name(self.source.dtype), tuple(self.source.block_shape), entries,
                name, pages.num_blocks, tuple(blocks[span]),
            )  # fmt: skip
            ch.send(Msg.SHM_READY, pack_batch(meta), flags=FLAG_CHECKSUMS if checksums else 0)
        ch.send(Msg.END)

    def _corrupt(self, entries: list[BlockEntry]) -> None:
        # The bytes may be the prefill worker's live cache, which a test fault must not touch:
        # announce a wrong checksum instead, which the client sees exactly like a damaged block.
        numbers = self.next_block_numbers(len(entries))
        fault = self.config.fault
        if fault is not None and fault.corrupt_block in numbers:
            j = fault.corrupt_block - numbers.start
            entries[j] = entries[j]._replace(checksum=entries[j].checksum ^ 0xFF)


class ShmKVClient(ThreadedKVClient):
    """Pulls blocks from a same-host ``ShmKVServer`` into a ``BlockSink``."""

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        self.maps = SegmentMaps()

    def receive(
        self,
        ch: Channel,
        cipher: PayloadCipher | None,
        plan: LoadPlan,
        sink: BlockSink,
        dest_block_ids: Sequence[int],
    ) -> int:
        self.maps.prune()
        dst = sink.pages
        for frame, meta, targets in batches(ch, Msg.SHM_READY, plan, sink, dest_block_ids):
            checked = bool(frame.flags & FLAG_CHECKSUMS)
            if self.config.shm_checksums and not checked:
                raise ProtocolError("peer sent shm blocks without checksums; this side wants them")
            src = self.maps.pages(meta.segment, dst.rows, meta.segment_blocks, dst.run)
            for entry, block, target in zip(meta.entries, meta.source_blocks, targets, strict=True):
                if not 0 <= block < src.num_blocks:
                    raise ProtocolError(f"peer named block {block} of {src.num_blocks}")
                dst.copy_block(src, block, target)
                if checked:
                    verify(entry, dst.runs(target))
        ch.send(Msg.SHM_DONE)
        return plan.num_blocks * dst.block_nbytes


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
