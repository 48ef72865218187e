"""KV transfer between workers: the connector interface (``base``), its scheduler-side half
(``scheduler``), leases, and one module per transport (``tcp``, ``shm``).

Torch-free to import: the transports load only when ``get_connector`` asks for one.
"""

from __future__ import annotations

from splitserve.transfer.base import (
    BlockSink,
    BlockSource,
    KVClient,
    KVConnector,
    KVServer,
    PullResult,
    TransferConfig,
    connector_names,
    get_connector,
)
from splitserve.transfer.errors import (
    AuthenticationError,
    ChecksumMismatch,
    ConnectionDropped,
    IncompatibleKV,
    KVTransferError,
    LeaseNotFound,
    PeerUnreachable,
    ProtocolError,
    RemoteError,
    TransferTimeout,
)
from splitserve.transfer.faults import FaultInjection
from splitserve.transfer.lease import Lease, LeaseTable
from splitserve.transfer.scheduler import (
    KVConnectorScheduler,
    LoadPlan,
    RemoteKV,
    build_transfer_params,
)

__all__ = [
    "AuthenticationError",
    "BlockSink",
    "BlockSource",
    "ChecksumMismatch",
    "ConnectionDropped",
    "FaultInjection",
    "IncompatibleKV",
    "KVClient",
    "KVConnector",
    "KVConnectorScheduler",
    "KVServer",
    "KVTransferError",
    "Lease",
    "LeaseNotFound",
    "LeaseTable",
    "LoadPlan",
    "PeerUnreachable",
    "ProtocolError",
    "PullResult",
    "RemoteError",
    "RemoteKV",
    "TransferConfig",
    "TransferTimeout",
    "build_transfer_params",
    "connector_names",
    "get_connector",
]
