"""A worker's disaggregation settings (``worker.disagg`` runs them), checked without
importing torch, so that a bad flag fails before the model loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.common.protocol import DEFAULT_KV_PEER_TIMEOUT_S, WORKER_ROLES
from splitserve.common.tls import client_context

if TYPE_CHECKING:
    from splitserve.transfer import TransferConfig

FAILURE_POLICIES = ("recompute", "fail")


@dataclass(slots=True)
class DisaggConfig:
    role: str = "both"
    transport: str = "tcp"
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    secret: bytes = b""
    encrypt: bool = False
    shm_checksums: bool = False
    lease_ttl_s: float = 30.0
    failure_policy: str = "recompute"
    fault: str | None = None  # test-only, see transfer.faults
    # Peer KV fetch (worker.peer): lend this worker's cached KV to peers and pull a moved
    # session's KV from its home worker when a request names one (``kv_peer``).
    peer: bool = False
    peer_timeout_s: float = DEFAULT_KV_PEER_TIMEOUT_S
    peer_ca: str | None = None  # the CA https:// peers are verified against (--worker-ca)

    def __post_init__(self) -> None:
        if self.role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {WORKER_ROLES}, got {self.role!r}")
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv-load-failure-policy must be one of {FAILURE_POLICIES}")
        if self.lease_ttl_s <= 0:
            raise ValueError(f"kv lease TTL must be > 0, got {self.lease_ttl_s}")
        if self.role != "both" and not self.secret:
            raise ValueError(
                "a prefill or decode worker needs the cluster secret "
                "(--kv-secret-file or SPLITSERVE_KV_SECRET)"
            )
        self._check_peer()
        if self.peer_ca is not None:
            client_context(self.peer_ca)  # a missing or bad file fails at start-up

    def _check_peer(self) -> None:
        if not self.peer:
            return
        if self.role == "prefill":
            raise ValueError("--kv-peer is for workers that serve sessions (role both or decode)")
        if not self.secret:
            raise ValueError(
                "--kv-peer needs the cluster secret (--kv-secret-file or SPLITSERVE_KV_SECRET)"
            )
        if not self.peer_timeout_s > 0:
            raise ValueError(f"--kv-peer-timeout must be > 0, got {self.peer_timeout_s}")

    @property
    def serves_kv(self) -> bool:
        """Whether this worker runs a KV data-plane server: a prefill worker for its decode
        workers, a collocated one with a secret, any worker lending KV to its peers."""
        return bool(self.secret) and (self.role != "decode" or self.peer)

    @property
    def shares_kv_cache(self) -> bool:
        """Whether this worker's KV cache belongs in shared memory: it serves KV over ``shm``,
        so same-host decode workers copy blocks straight out of it."""
        return self.transport == "shm" and self.serves_kv

    def transfer_config(self) -> TransferConfig:
        from splitserve.transfer import FaultInjection, TransferConfig

        return TransferConfig(
            secret=self.secret,
            encrypt=self.encrypt,
            shm_checksums=self.shm_checksums,
            fault=FaultInjection.parse(self.fault),
        )
