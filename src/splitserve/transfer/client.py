"""The pulling half shared by the socket transports: connect, authenticate, request.

One connection per call; the connection is closed on every path. Socket and protocol
failures surface as the ``KVTransferError`` subclasses the decode worker falls back on.
"""

from __future__ import annotations

import socket
import time
from abc import abstractmethod
from collections.abc import Sequence

from splitserve.transfer.auth import PayloadCipher, client_handshake
from splitserve.transfer.base import BlockSink, KVClient, PullResult, TransferConfig
from splitserve.transfer.errors import PeerUnreachable
from splitserve.transfer.kv_pages import dtype_name
from splitserve.transfer.scheduler import LoadPlan, RemoteKV
from splitserve.transfer.wire import Channel, Msg, pack_pull, pack_str


class ThreadedKVClient(KVClient):
    """Blocking client; subclasses implement ``receive`` for their payload path."""

    def __init__(self, config: TransferConfig) -> None:
        self.config = config

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
        ch, cipher = self._connect(plan.remote)
        try:
            nbytes = 0
            if plan.num_blocks:
                ch.send(Msg.PULL, pack_pull(plan.remote.request_id, plan.load_indices))
                nbytes = self.receive(ch, cipher, plan, sink, dest_block_ids)
            if release:
                self._lease_op(ch, Msg.RELEASE, plan.remote)
        finally:
            ch.close()
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
        ch, _ = self._connect(remote)
        try:
            self._lease_op(ch, msg, remote)
        finally:
            ch.close()

    @staticmethod
    def _lease_op(ch: Channel, msg: Msg, remote: RemoteKV) -> None:
        ch.send(msg, pack_str(remote.request_id))
        ch.expect(Msg.OK)


def expect_layout(sink: BlockSink) -> tuple[str, tuple[int, ...], int]:
    """The sink's dtype name, block shape and bytes per block."""
    per_block = sink.dtype.itemsize
    for dim in sink.block_shape:
        per_block *= dim
    return dtype_name(sink.dtype), tuple(sink.block_shape), per_block
