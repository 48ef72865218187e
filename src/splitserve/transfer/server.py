"""The serving half shared by the socket transports: accept, authenticate, dispatch.

One thread accepts; each connection gets its own thread; one more expires leases. A
connection runs: handshake, then requests (PULL, RELEASE, RENEW) until the peer leaves. Any
error on a connection is logged and ends that connection only; the server keeps serving.
"""

from __future__ import annotations

import logging
import socket
import threading
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence

from splitserve.transfer.auth import PayloadCipher, server_handshake
from splitserve.transfer.base import BlockSource, KVServer, TransferConfig
from splitserve.transfer.errors import KVTransferError, LeaseNotFound, ProtocolError
from splitserve.transfer.lease import Lease, LeaseTable
from splitserve.transfer.wire import Channel, ErrorCode, Msg, pack_str, unpack_pull, unpack_str

log = logging.getLogger(__name__)
_ACCEPT_POLL_S = 0.2


class FaultDrop(Exception):
    """Raised by a fault hook to cut the connection on purpose."""


class ThreadedKVServer(KVServer):
    """A thread-per-connection server; subclasses implement ``serve_pull``."""

    def __init__(
        self,
        source: BlockSource,
        leases: LeaseTable,
        config: TransferConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        reap_interval_s: float | None = 1.0,
    ) -> None:
        self.source, self.leases, self.config = source, leases, config
        self._bind = (host, port)
        self._reap_interval_s = reap_interval_s
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._blocks_served = 0  # counts blocks across the server's life, for corrupt_block
        self._accepted = 0

    @property
    def blocks_served(self) -> int:
        """Blocks sent to decode workers over this server's life."""
        return self._blocks_served

    @property
    def connections(self) -> tuple[int, int]:
        """(accepted over the server's life, open now): clients keep connections between
        pulls, so these stay far below the number of pulls."""
        with self._lock:
            return self._accepted, len(self._conns)

    @property
    def address(self) -> tuple[str, int]:
        if self._listener is None:
            raise RuntimeError("server is not started")
        host, port = self._listener.getsockname()[:2]
        return host, port

    def start(self) -> tuple[str, int]:
        if self._listener is not None:
            raise RuntimeError("server already started")
        listener = socket.create_server(self._bind, reuse_port=False)
        listener.settimeout(_ACCEPT_POLL_S)
        self._listener = listener
        self._spawn(self._accept_loop, "kv-accept")
        if self._reap_interval_s is not None:
            self._spawn(self._reap_loop, "kv-lease-reaper")
        return self.address

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            _shutdown(conn)
        for thread in list(self._threads):
            thread.join(timeout_s)
        if self._listener is not None:
            self._listener.close()

    # ---- threads -------------------------------------------------------------------------

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if not self._stopping.is_set():
                    log.exception("KV server accept failed")
                return
            with self._lock:
                self._conns.add(conn)
                self._accepted += 1
            self._spawn(self._handle, f"kv-conn-{peer}", conn, peer)

    def _reap_loop(self) -> None:
        assert self._reap_interval_s is not None
        while not self._stopping.wait(self._reap_interval_s):
            for lease in self.leases.expire():
                log.info("KV lease for request %r expired", lease.request_id)

    def _handle(self, conn: socket.socket, peer: object) -> None:
        ch = Channel(conn, self.config.io_timeout_s)
        try:
            cipher = server_handshake(ch, self.config.secret, self.config.encrypt)
            while not self._stopping.is_set() and self._serve_one(ch, cipher):
                pass
        except FaultDrop:
            log.warning("KV server: test fault cut the connection to %s", peer)
        except KVTransferError as exc:
            log.warning("KV server: connection from %s ended: %s", peer, exc)
        except Exception:
            log.exception("KV server: unexpected error on connection from %s", peer)
        finally:
            ch.close()  # before it leaves the count: an uncounted connection is closed
            with self._lock:
                self._conns.discard(conn)

    # ---- requests ------------------------------------------------------------------------

    def _serve_one(self, ch: Channel, cipher: PayloadCipher | None) -> bool:
        """Serve one request; False when the peer has left."""
        try:
            frame = ch.recv_frame()
        except KVTransferError:
            return False  # the peer left (or went silent) between requests
        if frame.payload_len:
            raise ProtocolError(f"unexpected payload on {frame.type.name}")
        if frame.type is Msg.PULL:
            request_id, indices = unpack_pull(frame.meta)
            self._pull(ch, cipher, request_id, indices)
        elif frame.type in (Msg.RELEASE, Msg.RENEW):
            request_id, _ = unpack_str(frame.meta, 0)
            self._lease_op(ch, frame.type, request_id)
        else:
            raise ProtocolError(f"unexpected {frame.type.name} from a client")
        return True

    def _pull(self, ch: Channel, cipher: PayloadCipher | None, rid: str, idx: list[int]) -> None:
        try:
            with self.leases.checkout(rid) as lease:
                bad = any(i >= len(lease.block_ids) for i in idx) or len(set(idx)) != len(idx)
                if bad or not idx:
                    ch.send_error(ErrorCode.BAD_REQUEST, f"bad block positions for {rid!r}")
                    return
                self._stall()
                self.serve_pull(ch, cipher, lease, idx)
        except LeaseNotFound as exc:
            ch.send_error(ErrorCode.LEASE, str(exc))

    def _lease_op(self, ch: Channel, msg: Msg, request_id: str) -> None:
        try:
            if msg is Msg.RELEASE:
                self.leases.release(request_id)
            else:
                self.leases.renew(request_id)
        except LeaseNotFound as exc:
            ch.send_error(ErrorCode.LEASE, str(exc))
            return
        ch.send(Msg.OK, pack_str(request_id))

    def _stall(self) -> None:
        fault = self.config.fault
        if fault is not None and fault.stall_s:
            # Interruptible by stop(), so a stalled test server still shuts down promptly.
            self._stopping.wait(fault.stall_s)

    def chunks(self, n: int, block_nbytes: int) -> Iterator[slice]:
        """Positions ``0..n`` cut into chunks that double from one block up to about
        ``chunk_bytes``: the peer starts on the first block while this side prepares the
        next (checksums, staging), and stays busy from then on::

            n = 40, cap 16:  [0] [1 2] [3..6] [7..14] [15..30] [31..39]
        """
        cap = max(1, self.config.chunk_bytes // block_nbytes)
        start, size = 0, 1
        while start < n:
            yield slice(start, min(n, start + size))
            start, size = start + size, min(cap, 2 * size)

    def next_block_numbers(self, n: int) -> range:
        """Serial numbers of the next ``n`` blocks served (for the ``corrupt_block`` fault)."""
        with self._lock:
            start = self._blocks_served
            self._blocks_served += n
        return range(start, start + n)

    @abstractmethod
    def serve_pull(
        self, ch: Channel, cipher: PayloadCipher | None, lease: Lease, indices: Sequence[int]
    ) -> None:
        """Send blocks ``indices`` (positions in ``lease.block_ids``) to the peer."""


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
