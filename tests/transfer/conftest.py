"""Fixtures for transfer tests: servers over real loopback sockets, checked for shm leaks."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from splitserve.transfer import TransferConfig
from tests.transfer.helpers import SECRET, Peer, shm_segments


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    """A segment prefix unique to the test; the test fails if any segment of it survives."""
    prefix = f"splitserve-kv-test-{uuid.uuid4().hex[:8]}-"
    yield prefix
    assert shm_segments(prefix) == []


@pytest.fixture
def make_peer(shm_prefix: str) -> Iterator[Callable[..., Peer]]:
    peers: list[Peer] = []

    def make(kind: str, **config: object) -> Peer:
        """``kind``: a transport name, or ``shm-shared`` (shm from a shared-memory cache)."""
        transport, _, variant = kind.partition("-")
        shared = variant == "shared"
        server = config.pop("server", {})
        cfg = TransferConfig(secret=config.pop("secret", SECRET), **config)  # type: ignore[arg-type]
        peers.append(Peer(transport, cfg, shm_prefix, shared, **server))  # type: ignore[arg-type]
        return peers[-1]

    yield make
    for peer in peers:
        peer.close()
