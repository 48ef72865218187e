"""The pulling half shared by the socket transports: connect, authenticate, request.

Connections are kept open between requests (``connections.py``); one that saw any failure
is closed. Socket and protocol failures surface as the ``KVTransferError`` subclasses the
decode worker falls back on.
"""

from __future__ import annotations

import socket
import time
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

from splitserve.engine.kv_pages import dtype_name
from splitserve.transfer.auth import PayloadCipher, client_handshake
from splitserve.transfer.base import BlockSink, KVClient, PullResult, TransferConfig
from splitserve.transfer.connections import Connection, IdleConnections
from splitserve.transfer.errors import PeerUnreachable, ProtocolError
from splitserve.transfer.payload import BatchMeta, check_batch, unpack_batch
from splitserve.transfer.scheduler import LoadPlan, RemoteKV
from splitserve.transfer.wire import Channel, Frame, Msg, pack_pull, pack_str


class ThreadedKVClient(KVClient):
    """Blocking client; subclasses implement ``receive`` for their payload path."""

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        # Reuse only well inside the server's idle timeout (it is io_timeout_s as well).
        self.idle = IdleConnections(max_idle_s=config.io_timeout_s / 2)

    def pull(
        self,
        plan: LoadPlan,
        sink: BlockSink,
        dest_block_ids: Sequence[int],
        release: bool = True,
    ) -> PullResult:
        if len(dest_block_ids) != plan.num_blocks:
            raise ValueError(f"{len(dest_block_ids)} destination blocks for {plan.num_blocks}")
        start = time.perf_counter()
        with self._connection(plan.remote) as (ch, cipher):
            nbytes = 0
            if plan.num_blocks:
                ch.send(Msg.PULL, pack_pull(plan.remote.request_id, plan.load_indices))
                nbytes = self.receive(ch, cipher, plan, sink, dest_block_ids)
            if release:
                self._lease_op(ch, Msg.RELEASE, plan.remote)
        return PullResult(plan.num_blocks, nbytes, time.perf_counter() - start)

    def renew(self, remote: RemoteKV) -> None:
        self._once(remote, Msg.RENEW)

    def release(self, remote: RemoteKV) -> None:
        self._once(remote, Msg.RELEASE)

    @abstractmethod
    def receive(
        self,
        ch: Channel,
        cipher: PayloadCipher | None,
        plan: LoadPlan,
        sink: BlockSink,
        dest_block_ids: Sequence[int],
    ) -> int:
        """Read the answer to a PULL into ``sink``; returns the block bytes moved."""

    # ---- helpers -------------------------------------------------------------------------

    def _connect(self, remote: RemoteKV) -> tuple[Channel, PayloadCipher | None]:
        try:
            sock = socket.create_connection(
                (remote.host, remote.port), timeout=self.config.connect_timeout_s
            )
        except TimeoutError as exc:
            raise PeerUnreachable(
                f"KV peer {remote.host}:{remote.port} did not accept within "
                f"{self.config.connect_timeout_s}s"
            ) from exc
        except OSError as exc:
            where = f"{remote.host}:{remote.port}"
            raise PeerUnreachable(f"KV peer {where} unreachable: {exc}") from exc
        ch = Channel(sock, self.config.io_timeout_s)
        try:
            return ch, client_handshake(ch, self.config.secret, self.config.encrypt)
        except BaseException:
            ch.close()
            raise

    def _once(self, remote: RemoteKV, msg: Msg) -> None:
        with self._connection(remote) as (ch, _):
            self._lease_op(ch, msg, remote)

    @contextmanager
    def _connection(self, remote: RemoteKV) -> Iterator[Connection]:
        """An authenticated connection to ``remote``'s server, idle or new; it goes back to
        the idle ones only if the block ends without an exception."""
        peer = (remote.host, remote.port)
        conn = self.idle.take(peer) or Connection(*self._connect(remote))
        try:
            yield conn
        except BaseException:
            conn.ch.close()
            raise
        self.idle.put(peer, conn)

    def close(self) -> None:
        """Close the idle connections."""
        self.idle.close()

    @staticmethod
    def _lease_op(ch: Channel, msg: Msg, remote: RemoteKV) -> None:
        ch.send(msg, pack_str(remote.request_id))
        ch.expect(Msg.OK)


class Batch(NamedTuple):
    frame: Frame
    meta: BatchMeta
    targets: Sequence[int]  # the local blocks its entries go to, in order


def batches(
    ch: Channel, msg: Msg, plan: LoadPlan, sink: BlockSink, dest_block_ids: Sequence[int]
) -> Iterator[Batch]:
    """The ``msg`` frames answering a PULL, up to ``END``, each checked against the plan: the
    planned blocks in order, under the planned hashes, laid out like ``sink``; ``END`` only
    after every planned block."""
    dtype, shape, _ = expect_layout(sink)
    pos = 0
    while (frame := ch.expect(msg, Msg.END)).type is msg:
        meta = unpack_batch(frame.meta)
        n = len(meta.entries)
        if n == 0 or pos + n > plan.num_blocks:
            raise ProtocolError(f"peer sent {n} blocks at {pos} of {plan.num_blocks}")
        span = slice(pos, pos + n)
        check_batch(meta, dtype, shape, plan.load_indices[span], plan.hashes[span])
        yield Batch(frame, meta, dest_block_ids[span])
        pos += n
    if pos != plan.num_blocks:
        raise ProtocolError(f"peer ended the pull after {pos} of {plan.num_blocks} blocks")


def expect_layout(sink: BlockSink) -> tuple[str, tuple[int, ...], int]:
    """The sink's dtype name, block shape and bytes per block."""
    per_block = sink.dtype.itemsize
    for dim in sink.block_shape:
        per_block *= dim
    return dtype_name(sink.dtype), tuple(sink.block_shape), per_block
