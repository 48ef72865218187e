"""Authenticated connections a KV client keeps open between pulls, per peer.

A fresh connection costs a TCP connect, a server thread and the HMAC handshake (one and a
half round trips): several milliseconds on a busy host, as much as moving 10 MiB. A decode
worker pulls from the same prefill workers again and again, so it keeps a few idle ones.

Invariants: a connection is lent to one pull at a time and comes back only after a request
that ended cleanly (a failed one may have left bytes in flight: it is closed); an idle one
is handed out only if it is younger than ``max_idle_s`` (below the server's idle timeout)
and the peer has not closed it or sent anything since.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from typing import NamedTuple

from splitserve.transfer.auth import PayloadCipher
from splitserve.transfer.wire import Channel

Peer = tuple[str, int]


class Connection(NamedTuple):
    ch: Channel
    cipher: PayloadCipher | None


class IdleConnections:
    def __init__(self, max_idle_s: float, per_peer: int = 4) -> None:
        self.max_idle_s, self.per_peer = max_idle_s, per_peer
        self._idle: dict[Peer, list[tuple[float, Connection]]] = {}
        self._lock = threading.Lock()

    def take(self, peer: Peer) -> Connection | None:
        """A usable idle connection to ``peer``, or None; stale ones are closed on the way."""
        while True:
            with self._lock:
                stack = self._idle.get(peer)
                if not stack:
                    return None
                since, conn = stack.pop()
            if time.monotonic() - since < self.max_idle_s and _quiet(conn.ch.sock):
                return conn
            conn.ch.close()

    def put(self, peer: Peer, conn: Connection) -> None:
        with self._lock:
            stack = self._idle.setdefault(peer, [])
            keep = len(stack) < self.per_peer
            if keep:
                stack.append((time.monotonic(), conn))
        if not keep:
            conn.ch.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for stack in idle.values():
            for _, conn in stack:
                conn.ch.close()


def _quiet(sock: socket.socket) -> bool:
    """The peer has neither closed the connection nor sent anything unasked (either would
    make the socket readable)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):  # closed under us
        return False
    return not readable
