"""The KV connector interface, split by role as in vLLM v1.

* Scheduler side (``scheduler.py``, pure Python): ``KVConnectorScheduler.plan_load`` turns the
  prefill worker's ``kv_transfer_params`` into a ``LoadPlan`` of the blocks to pull.
* Worker side (here, one implementation per transport): a ``KVServer`` on the prefill worker
  serves leased blocks out of a ``BlockSource``; a ``KVClient`` on the decode worker pulls a
  ``LoadPlan`` into a ``BlockSink``. ``get_connector(name, config)`` picks the transport.

::

    prefill worker                                  decode worker
    engine --grant--> LeaseTable                    KVConnectorScheduler.plan_load
    kv_cache <-read-- KVServer <==== pull(plan) ==== KVClient --write--> kv_cache
                      LeaseTable.release  <== RELEASE ==  (after the blocks are written)
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol

from splitserve.transfer.faults import FaultInjection

if TYPE_CHECKING:
    import torch

    from splitserve.engine.kv_pages import PagedBytes
    from splitserve.transfer.lease import LeaseTable
    from splitserve.transfer.scheduler import LoadPlan, RemoteKV


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Settings shared by both halves of a transport.

    ``secret`` is the cluster secret every peer must prove (HMAC) before any byte moves.
    ``encrypt`` seals block payloads with AES-GCM (either side asking is enough).
    ``shm_checksums`` makes an ``shm`` server checksum every block it announces, for the
    client to verify where the block landed. Off by default: shm blocks are read under a
    checked-out lease, which the prefill engine never rewrites nor expires (``LeaseTable``),
    and never leave the host, so the check would guard against nothing but a bug, at the
    price of two more passes over the bytes. (``tcp`` always checksums.)
    ``fault`` is test-only and acts on the serving side.
    """

    secret: bytes
    encrypt: bool = False
    connect_timeout_s: float = 5.0
    io_timeout_s: float = 30.0
    chunk_bytes: int = 16 * 2**20
    shm_checksums: bool = False
    fault: FaultInjection | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or not self.secret:
            raise ValueError("TransferConfig.secret must be non-empty bytes")
        for name in ("connect_timeout_s", "io_timeout_s", "chunk_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransferConfig.{name} must be > 0")


class BlockSource(Protocol):
    """Where a KV server reads blocks from (the prefill engine's cache).

    Servers read ``pages`` on their own threads, only leased blocks, which the engine never
    rewrites. ``shm_segment`` names the shared-memory segment the cache lives in, if it does:
    the ``shm`` transport then lets a same-host peer copy straight out of it.
    """

    block_shape: tuple[int, ...]  # one block: (L, 2, block_size, kv_heads, head_dim)
    dtype: torch.dtype
    pages: PagedBytes
    shm_segment: str | None


class BlockSink(Protocol):
    """Where a KV client writes pulled blocks to (the decode engine's cache).

    Clients write ``pages``, only the blocks the engine reserved for the pull and does not
    read until it returns; after a failed pull those blocks hold garbage and are freed.
    """

    block_shape: tuple[int, ...]
    dtype: torch.dtype
    pages: PagedBytes


class PullResult(NamedTuple):
    num_blocks: int
    nbytes: int  # block bytes moved (payload only)
    seconds: float


class KVServer(ABC):
    """Serves leased blocks to authenticated peers, on its own threads.

    Runs from ``start()`` to ``stop()`` (also a context manager). While running it also
    expires leases past their deadline. It never crashes on a bad peer: a broken frame
    ends that connection only.
    """

    @abstractmethod
    def start(self) -> tuple[str, int]:
        """Bind and start serving; returns the (host, port) to put in kv_transfer_params."""

    @abstractmethod
    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end open connections, join the threads."""

    @property
    @abstractmethod
    def address(self) -> tuple[str, int]: ...

    def __enter__(self) -> KVServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class KVClient(ABC):
    """Pulls blocks from a peer's ``KVServer``. Every failure raises a ``KVTransferError``
    subclass (see ``errors.py``); the decode worker then recomputes or fails the request."""

    @abstractmethod
    def pull(
        self,
        plan: LoadPlan,
        sink: BlockSink,
        dest_block_ids: Sequence[int],
        release: bool = True,
    ) -> PullResult:
        """Fetch ``plan``'s blocks, verify each, write block ``plan.load_indices[i]`` into
        local block ``dest_block_ids[i]``; then (``release``) end the remote lease."""

    @abstractmethod
    def renew(self, remote: RemoteKV) -> None:
        """Extend the remote lease (the decode worker is still busy with the request)."""

    @abstractmethod
    def release(self, remote: RemoteKV) -> None:
        """End the remote lease without pulling (e.g. the decode worker recomputes)."""

    @abstractmethod
    def close(self) -> None:
        """Let go of whatever the client keeps between pulls (idle connections)."""


class KVConnector(ABC):
    """A transport by name: builds the worker-side halves from one ``TransferConfig``."""

    name: ClassVar[str]

    def __init__(self, config: TransferConfig) -> None:
        self.config = config

    @abstractmethod
    def make_server(
        self, source: BlockSource, leases: LeaseTable, host: str = "127.0.0.1", port: int = 0
    ) -> KVServer:
        """A (not yet started) server over ``source``, serving the leases in ``leases``."""

    @abstractmethod
    def make_client(self) -> KVClient: ...


# Imported lazily so that picking a name does not pull in every transport.
_REGISTRY: dict[str, str] = {
    "tcp": "splitserve.transfer.tcp:TcpConnector",
    "shm": "splitserve.transfer.shm:ShmConnector",
}


def connector_names() -> list[str]:
    return sorted(_REGISTRY)


def get_connector(name: str, config: TransferConfig) -> KVConnector:
    """The connector registered as ``name`` (``"tcp"`` or ``"shm"``)."""
    try:
        module, _, cls = _REGISTRY[name].partition(":")
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}; known: {connector_names()}") from None
    return getattr(importlib.import_module(module), cls)(config)
