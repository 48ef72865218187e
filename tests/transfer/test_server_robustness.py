"""A KV server survives garbage and unauthenticated peers; a client checks the server too."""

from __future__ import annotations

import os
import socket
import struct
import threading

import pytest
import torch

from splitserve.engine.kv_pages import KVCacheBlocks
from splitserve.transfer import AuthenticationError, ProtocolError, TransferConfig
from splitserve.transfer.tcp import TcpKVClient
from splitserve.transfer.wire import HEADER, MAGIC, VERSION, Msg, pack_pull
from tests.transfer.helpers import SECRET, assert_blocks_equal, plan_all


def read_until_closed(sock: socket.socket, limit: int = 1 << 16) -> bytes:
    """Everything the server sends before it closes (bounded in bytes and time)."""
    sock.settimeout(5)
    data = b""
    while len(data) < limit:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    raise AssertionError("server kept talking to a bad peer")


def frame(msg: int, meta: bytes = b"", payload_len: int = 0, version: int = VERSION) -> bytes:
    return HEADER.pack(MAGIC, version, msg, 0, len(meta), payload_len) + meta


@pytest.mark.parametrize(
    "garbage",
    [
        os.urandom(4096),
        b"SSKV" + b"\xff" * 64,
        frame(Msg.AUTH, b"x" * 10, payload_len=2**50),  # absurd lengths
        frame(Msg.PULL, pack_pull("req-1", [0, 1])),  # skips the handshake
        frame(Msg.AUTH, os.urandom(64)),  # a guessed proof
    ],
    ids=["random", "magic-then-ff", "absurd-length", "pull-before-auth", "guessed-proof"],
)
def test_garbage_ends_only_that_connection(make_peer, garbage: bytes) -> None:
    peer = make_peer("tcp")
    plan = plan_all(peer.offer("req-1", [1, 2]))
    idle = socket.create_connection((peer.host, peer.port))  # a silent peer, held open
    with socket.create_connection((peer.host, peer.port)) as bad:
        bad.sendall(garbage)
        answer = read_until_closed(bad)
    # At most HELLO and an error frame: never a block.
    assert len(answer) < 200
    dst = torch.zeros_like(peer.cache)
    TcpKVClient(TransferConfig(SECRET)).pull(plan, KVCacheBlocks(dst), [0, 1])
    assert_blocks_equal(peer.cache, [1, 2], dst, [0, 1])
    idle.close()


def fake_server(reply) -> tuple[socket.socket, threading.Thread]:
    """A one-shot server that runs ``reply(conn)`` for the first connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)

    def run() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            reply(conn)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener, thread


def pull_from(listener: socket.socket) -> None:
    from splitserve.transfer import RemoteKV

    port = listener.getsockname()[1]
    remote = RemoteKV("p", "req-1", (1,), "127.0.0.1", port, (), "tcp", 4)
    client = TcpKVClient(TransferConfig(SECRET, io_timeout_s=5))
    client.pull(plan_all(remote), KVCacheBlocks(torch.zeros(2, 2, 4, 4, 2, 8)), [0])


def test_client_refuses_a_server_without_the_secret() -> None:
    def impostor(conn: socket.socket) -> None:
        conn.sendall(frame(Msg.HELLO, os.urandom(32)))
        conn.recv(HEADER.size + 64)
        conn.sendall(frame(Msg.AUTH_OK, os.urandom(32)))  # cannot compute the real proof
        read_until_closed(conn)

    listener, thread = fake_server(impostor)
    with pytest.raises(AuthenticationError, match="server failed"):
        pull_from(listener)
    thread.join(5)
    listener.close()


def test_client_rejects_another_protocol_version() -> None:
    def future(conn: socket.socket) -> None:
        conn.sendall(frame(Msg.HELLO, os.urandom(32), version=VERSION + 1))
        read_until_closed(conn)

    listener, thread = fake_server(future)
    with pytest.raises(ProtocolError, match="version"):
        pull_from(listener)
    thread.join(5)
    listener.close()


def test_header_layout_is_stable() -> None:
    assert HEADER.size == 20 and struct.calcsize("<4sBBHIQ") == 20
