"""The KV tier ladder below the device pool: host RAM, then local disk (see ``base.KVTier``)."""

from __future__ import annotations

from splitserve.kvstore.base import BlockMeta, KVTier, StoredBlock, TierUsage
from splitserve.kvstore.disk import DiskStats, DiskTier
from splitserve.kvstore.host import HostTier
from splitserve.kvstore.keyfile import add_key, drop_key, generate_key, load_keyring
from splitserve.kvstore.keyring import KeyRing
from splitserve.kvstore.tiered import TieredStats, TieredStore

__all__ = [
    "BlockMeta",
    "DiskStats",
    "DiskTier",
    "HostTier",
    "KVTier",
    "KeyRing",
    "StoredBlock",
    "TierUsage",
    "TieredStats",
    "TieredStore",
    "add_key",
    "drop_key",
    "generate_key",
    "load_keyring",
]
