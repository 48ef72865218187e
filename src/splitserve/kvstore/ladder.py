"""Build the tier ladder a worker was configured with: host RAM, then disk, either optional."""

from __future__ import annotations

from typing import NamedTuple

from splitserve.config import KVTierConfig
from splitserve.kvstore.base import KVTier
from splitserve.kvstore.disk import DiskTier
from splitserve.kvstore.host import HostTier
from splitserve.kvstore.keyfile import load_keyring
from splitserve.kvstore.tiered import TieredStore

GIB = 2**30


class Ladder(NamedTuple):
    store: TieredStore
    names: list[str]  # "host", "disk": metric labels, in ladder order

    def disk(self) -> DiskTier | None:
        return self._tier("disk")  # type: ignore[return-value]

    def host(self) -> HostTier | None:
        return self._tier("host")  # type: ignore[return-value]

    def _tier(self, wanted: str) -> KVTier | None:
        for name, tier in zip(self.names, self.store.tiers, strict=True):
            if name == wanted:
                return tier
        return None


def build_ladder(cfg: KVTierConfig, model_id: str) -> Ladder | None:
    """The configured tiers, or None when neither host RAM nor a disk directory is given.

    Raises ``ValueError`` for an unusable key file or directory.
    """
    if not cfg.enabled:
        return None
    tiers: list[KVTier] = []
    names: list[str] = []
    ring = load_keyring(cfg.encryption_key_file) if cfg.encryption_key_file else None
    if cfg.host_kv_gb > 0:
        host_ring = ring if cfg.host_kv_encrypt else None
        tiers.append(HostTier(int(cfg.host_kv_gb * GIB), keyring=host_ring))
        names.append("host")
    if cfg.disk_kv_dir is not None:
        try:
            disk = DiskTier(cfg.disk_kv_dir, int(cfg.disk_kv_gb * GIB), model_id, key=ring)
        except OSError as e:
            raise ValueError(f"cannot use the disk KV directory {cfg.disk_kv_dir}: {e}") from e
        tiers.append(disk)
        names.append("disk")
    return Ladder(TieredStore(tiers, write_through=cfg.write_through), names)
