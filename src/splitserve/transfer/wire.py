"""The KV data plane's framing, shared by every socket transport.

Every message is one frame::

    +-------+---------+------+-------+----------+-------------+------+---------+
    | magic | version | type | flags | meta_len | payload_len | meta | payload |
    | 4 B   | u8      | u8   | u16   | u32      | u64         |      |         |
    +-------+---------+------+-------+----------+-------------+------+---------+

``meta`` is small and parsed here; ``payload`` (raw block bytes) is never parsed: the
receiver reads it straight into its KV cache (``recv_into_parts``), the sender writes it
straight out of its own (``send_parts``). Every read is bounded by the limits below, so
garbage from a peer ends that connection and nothing else.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from enum import IntEnum
from typing import NamedTuple

from splitserve.transfer.errors import ConnectionDropped, ProtocolError, TransferTimeout

MAGIC = b"SSKV"
VERSION = 3  # 2: shm batches name a paged segment and a source block per entry; 3: shm
#              batches carry checksums only under FLAG_CHECKSUMS
HEADER = struct.Struct("<4sBBHIQ")
MAX_META_BYTES = 8 * 2**20
MAX_PAYLOAD_BYTES = 2**40
IOV_BATCH = 128  # buffers per sendmsg/recvmsg_into call (Linux allows 1024)
FLAG_ENCRYPT = 1
FLAG_CHECKSUMS = 2  # on SHM_READY: the entries carry block checksums to verify


class Msg(IntEnum):
    HELLO = 1  # server -> client: nonce; flags: server encrypts
    AUTH = 2  # client -> server: nonce, proof; flags: client wants encryption
    AUTH_OK = 3  # server -> client: server's proof
    PULL = 4  # client -> server: request id, block indices
    BLOCKS = 5  # server -> client: block descriptors, then block bytes as payload
    END = 6  # server -> client: every block of the pull was sent
    SHM_READY = 7  # server -> client: segment name and block descriptors
    SHM_DONE = 8  # client -> server: done reading the segment
    RELEASE = 9  # client -> server: request id (decode has the blocks)
    RENEW = 10  # client -> server: request id
    OK = 11  # server -> client
    ERROR = 12  # either way: code, message


class ErrorCode(IntEnum):
    AUTH = 1
    LEASE = 2
    BAD_REQUEST = 3
    INTERNAL = 4


class Frame(NamedTuple):
    type: Msg
    flags: int
    meta: bytes
    payload_len: int


class Channel:
    """A framed, blocking socket. Socket failures surface as ``KVTransferError`` subclasses.

    The timeout lives in the kernel (``SO_RCVTIMEO``/``SO_SNDTIMEO``: no progress for that
    long), not in Python's timeout mode, which polls and then makes one non-blocking call:
    every partial read or write would come back to Python, thousands per pull. Blocking, a
    vectored send or a ``MSG_WAITALL`` read moves a whole block per system call.
    """

    def __init__(self, sock: socket.socket, timeout_s: float | None) -> None:
        self.sock = sock
        sock.settimeout(None)
        if timeout_s is not None:
            usec = max(1, round(timeout_s * 1e6))
            timeval = struct.pack("@ll", usec // 1_000_000, usec % 1_000_000)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        if _is_tcp(sock):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(
        self, msg: Msg, meta: bytes = b"", flags: int = 0, payload: Iterable[memoryview] = ()
    ) -> None:
        """Send one frame; ``payload`` parts are sent as they are, with no copy."""
        parts = list(payload)
        self.send_header(msg, meta, sum(p.nbytes for p in parts), flags)
        for part in parts:
            self.send_raw(part)

    def send_header(self, msg: Msg, meta: bytes, payload_len: int, flags: int = 0) -> None:
        """Start a frame whose payload the caller streams with ``send_raw``."""
        with _socket_errors("sending"):
            head = HEADER.pack(MAGIC, VERSION, msg, flags, len(meta), payload_len)
            self.sock.sendall(head + meta)

    def send_raw(self, data: memoryview) -> None:
        with _socket_errors("sending"):
            self.sock.sendall(data)

    def send_parts(self, parts: Sequence[memoryview]) -> None:
        """Send ``parts`` back to back with vectored writes (no joining copy)."""
        with _socket_errors("sending"):
            _vectored(self.sock.sendmsg, parts, "send")

    def recv_into_parts(self, parts: Sequence[memoryview]) -> None:
        """Fill ``parts`` exactly, in order, with vectored reads (no intermediate copy)."""
        with _socket_errors("receiving"):
            _vectored(
                lambda views: self.sock.recvmsg_into(views, 0, socket.MSG_WAITALL)[0],
                parts,
                "receive",
            )

    def recv_frame(self) -> Frame:
        """Read one frame's header and meta; its payload is left for ``recv_into``."""
        head = bytearray(HEADER.size)
        self.recv_into(memoryview(head))
        magic, version, msg, flags, meta_len, payload_len = HEADER.unpack(head)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {bytes(magic)!r}")
        if version != VERSION:
            raise ProtocolError(f"protocol version {version}, this side speaks {VERSION}")
        if msg not in Msg.__members__.values():
            raise ProtocolError(f"unknown message type {msg}")
        if meta_len > MAX_META_BYTES or payload_len > MAX_PAYLOAD_BYTES:
            raise ProtocolError(f"frame too large (meta {meta_len}, payload {payload_len})")
        meta = bytearray(meta_len)
        self.recv_into(memoryview(meta))
        return Frame(Msg(msg), flags, bytes(meta), payload_len)

    def expect(self, *types: Msg) -> Frame:
        """Read a frame of one of ``types`` with no payload (an ERROR frame is raised)."""
        frame = self.recv_frame()
        if frame.type is Msg.ERROR:
            raise_remote_error(frame.meta)
        if frame.type not in types or (frame.payload_len and frame.type is not Msg.BLOCKS):
            raise ProtocolError(f"expected {[t.name for t in types]}, got {frame.type.name}")
        return frame

    def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly from the socket (no intermediate copy)."""
        got, size = 0, view.nbytes
        with _socket_errors("receiving"):
            while got < size:
                n = self.sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
                if n == 0:
                    raise ConnectionDropped(f"peer closed the connection after {got}/{size} bytes")
                got += n

    def send_error(self, code: ErrorCode, message: str) -> None:
        self.send(Msg.ERROR, struct.pack("<B", code) + message.encode()[:4096])

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def raise_remote_error(meta: bytes) -> None:
    """Raise the exception an ERROR frame stands for."""
    from splitserve.transfer.errors import AuthenticationError, LeaseNotFound, RemoteError

    code, message = (meta[0], meta[1:].decode(errors="replace")) if meta else (0, "")
    kind = {ErrorCode.AUTH: AuthenticationError, ErrorCode.LEASE: LeaseNotFound}
    raise kind.get(code, RemoteError)(f"peer refused: {message}")


@contextmanager
def _socket_errors(doing: str) -> Iterator[None]:
    """Map socket exceptions to transfer errors."""
    try:
        yield
    except (TimeoutError, BlockingIOError) as exc:  # the kernel's timeout gives EAGAIN
        raise TransferTimeout(f"timed out {doing}") from exc
    except OSError as exc:  # ConnectionResetError, BrokenPipeError, ...
        raise ConnectionDropped(f"connection lost while {doing}: {exc}") from exc


def _vectored(call: Callable[[list[memoryview]], int], parts: Sequence[memoryview], what: str):
    """Run ``call`` (``sendmsg`` or ``recvmsg_into``) until every byte of ``parts`` moved.

    A call moves any prefix of the bytes offered (the socket has a timeout, so it is
    non-blocking underneath): skip the parts done, cut the one it stopped in, go on.
    """
    pending, i = [p for p in parts if p.nbytes], 0
    while i < len(pending):
        moved = call(pending[i : i + IOV_BATCH])
        if moved == 0:
            left = sum(p.nbytes for p in pending[i:])
            raise ConnectionDropped(f"peer closed the connection with {left} bytes left to {what}")
        while moved:
            size = pending[i].nbytes
            if moved < size:
                pending[i] = pending[i][moved:]
                break
            moved -= size
            i += 1


def _is_tcp(sock: socket.socket) -> bool:
    return sock.family in (socket.AF_INET, socket.AF_INET6)


# ---- meta codecs -----------------------------------------------------------------------


def pack_str(value: str) -> bytes:
    data = value.encode()
    if len(data) > 0xFFFF:
        raise ValueError("string too long for the wire")
    return struct.pack("<H", len(data)) + data


def unpack_str(meta: bytes, offset: int) -> tuple[str, int]:
    (size,) = _unpack("<H", meta, offset)
    end = offset + 2 + size
    if end > len(meta):
        raise ProtocolError("truncated string")
    try:
        return meta[offset + 2 : end].decode(), end
    except UnicodeDecodeError as exc:
        raise ProtocolError("string is not UTF-8") from exc


def pack_pull(request_id: str, indices: Iterable[int]) -> bytes:
    idx = list(indices)
    return pack_str(request_id) + struct.pack(f"<I{len(idx)}I", len(idx), *idx)


def unpack_pull(meta: bytes) -> tuple[str, list[int]]:
    request_id, offset = unpack_str(meta, 0)
    (n,) = _unpack("<I", meta, offset)
    if len(meta) != offset + 4 + 4 * n:
        raise ProtocolError("PULL meta has the wrong length")
    return request_id, list(struct.unpack_from(f"<{n}I", meta, offset + 4))


def _unpack(fmt: str, meta: bytes, offset: int) -> tuple:
    try:
        return struct.unpack_from(fmt, meta, offset)
    except struct.error as exc:
        raise ProtocolError(f"truncated meta ({exc})") from exc
