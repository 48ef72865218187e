"""The worker's KV flags (tiers, transfers, peer fetch), shared by ``splitserve worker`` and
``splitserve serve``, and the configs they make; ``splitserve keygen`` and ``splitserve kv``
(key rotation: ``keys``, ``rotate``, ``reencrypt``, ``drop-key``)."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from splitserve.common.protocol import DEFAULT_KV_PEER_TIMEOUT_S as DEFAULT_PEER_TIMEOUT_S
from splitserve.common.tenant_args import read_secret

# The KV tier flags: (flag, KVTierConfig field). ``serve`` passes the same flags on.
TIER_FLAGS = (
    ("--host-kv-gb", "host_kv_gb"),
    ("--disk-kv-dir", "disk_kv_dir"),
    ("--disk-kv-gb", "disk_kv_gb"),
    ("--kv-encryption-key-file", "encryption_key_file"),
    ("--host-kv-encrypt", "host_kv_encrypt"),
    ("--kv-retention-ttl-s", "retention_ttl_s"),
    ("--kv-retention-max-ttl-s", "retention_max_ttl_s"),
    ("--kv-retention-quota", "retention_quota"),
    ("--kv-retention-max-pinned", "retention_max_pinned"),
)


def add_kv_tier_args(p: argparse.ArgumentParser) -> None:
    from splitserve.config import KVTierConfig

    d = KVTierConfig()
    g = p.add_argument_group("KV tiers (see docs/kv-tiers.md)")
    g.add_argument("--host-kv-gb", type=float, default=d.host_kv_gb, help="host-RAM KV tier size")
    g.add_argument("--disk-kv-dir", default=None, help="directory of the disk KV tier (persists)")
    g.add_argument("--disk-kv-gb", type=float, default=d.disk_kv_gb, help="disk KV tier size")
    g.add_argument(
        "--kv-encryption-key-file", default=None, help="encrypt the disk tier (splitserve keygen)"
    )
    g.add_argument(
        "--host-kv-encrypt",
        action="store_true",
        help="seal the host-RAM tier's blocks too, with the same key file",
    )
    g.add_argument(
        "--kv-retention-ttl-s",
        type=float,
        default=d.retention_ttl_s,
        help="seconds a session's KV stays pinned after tool calls or kv_retention {}",
    )
    g.add_argument(
        "--kv-retention-max-ttl-s",
        type=float,
        default=d.retention_max_ttl_s,
        help="the longest kv_retention.ttl_s a request may ask for",
    )
    g.add_argument(
        "--kv-retention-quota",
        type=float,
        default=d.retention_quota,
        help="blocks one session may pin, as a fraction of the device pool",
    )
    g.add_argument(
        "--kv-retention-max-pinned",
        type=float,
        default=d.retention_max_pinned,
        help="blocks all sessions together may pin, as a fraction of the device pool",
    )


def tier_config(args: argparse.Namespace):
    """The tier flags as a config; a bad key file fails here, before the model loads."""
    from splitserve.config import KVTierConfig
    from splitserve.kvstore import load_keyring

    cfg = KVTierConfig(**{field: getattr(args, field_of(flag)) for flag, field in TIER_FLAGS})
    if cfg.encryption_key_file is not None:
        load_keyring(cfg.encryption_key_file)
    return cfg


def field_of(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def tier_worker_args(args: argparse.Namespace) -> list[str]:
    """The tier flags given to ``serve``, for its workers' command lines."""
    out: list[str] = []
    for flag, _ in TIER_FLAGS:
        value = getattr(args, field_of(flag))
        if value is True:
            out.append(flag)
        elif value is not None and value is not False:
            out += [flag, str(value)]
    return out


def cmd_keygen(args: argparse.Namespace) -> int:
    from splitserve.kvstore import generate_key

    try:
        path = generate_key(args.path)
    except OSError as e:
        raise ValueError(f"cannot write the key file {args.path}: {e.strerror}") from e
    print(f"wrote a new 256-bit KV encryption key to {path} (mode 600)")
    return 0


def add_kv_parser(sub) -> None:
    """``splitserve kv``: the key file's keys, rotation and re-sealing (docs/security.md)."""
    kv = sub.add_parser("kv", help="KV encryption keys: list, rotate, re-encrypt, drop")
    acts = kv.add_subparsers(dest="kv_command", required=True)
    keys = acts.add_parser("keys", help="list a key file's key ids (the current one marked)")
    keys.add_argument("key_file")
    keys.set_defaults(func=cmd_kv_keys)
    rotate = acts.add_parser("rotate", help="add a new key to a key file and make it current")
    rotate.add_argument("key_file")
    rotate.set_defaults(func=cmd_kv_rotate)
    reseal = acts.add_parser(
        "reencrypt",
        help="re-seal disk tier directories under the key file's current key "
        "(refused while a worker uses a directory)",
    )
    reseal.add_argument("directory", nargs="+", help="a --disk-kv-dir (of each pool worker)")
    reseal.add_argument("--kv-encryption-key-file", required=True, metavar="FILE")
    reseal.set_defaults(func=cmd_kv_reencrypt)
    drop = acts.add_parser("drop-key", help="remove a key that is not current from a key file")
    drop.add_argument("key_file")
    drop.add_argument("key_id", help="16 hex digits, as `splitserve kv keys` lists them")
    drop.set_defaults(func=cmd_kv_drop_key)


def cmd_kv_keys(args: argparse.Namespace) -> int:
    from splitserve.kvstore import load_keyring

    ring = load_keyring(args.key_file)
    for kid in ring.keys:
        print(f"{kid.hex()}{'  current' if kid == ring.current else ''}")
    return 0


def cmd_kv_rotate(args: argparse.Namespace) -> int:
    from splitserve.kvstore import add_key

    kid = add_key(args.key_file)
    print(f"added key {kid.hex()} to {args.key_file}; new blocks are sealed with it")
    return 0


def cmd_kv_reencrypt(args: argparse.Namespace) -> int:
    from splitserve.kvstore import load_keyring
    from splitserve.kvstore.reseal import ResealReport, reseal_directory
    from splitserve.worker.saved_responses import reseal_responses

    ring = load_keyring(args.kv_encryption_key_file)
    for directory in args.directory:
        s = ResealReport()  # the stored responses'
        r = reseal_directory(directory, ring, functools.partial(reseal_responses, report=s))
        if r == ResealReport() and any(Path(directory).glob("*/[0-9a-f][0-9a-f]/*.kvb")):
            raise ValueError(
                f"{directory} holds no block files, its subdirectories do (serve gives each "
                "pool worker its own): name those"
            )
        print(
            f"{directory}: {r.resealed} blocks re-sealed with key {ring.current.hex()}, "
            f"{r.already_current} already were, {r.missing_key} sealed with keys not in the "
            f"key file and {r.unreadable} unreadable left as they are (misses)"
        )
        if s != ResealReport():
            print(
                f"{directory}: {s.resealed} stored responses re-sealed, {s.already_current} "
                f"already were, {s.missing_key + s.unreadable} that cannot be opened left"
            )
    return 0


def cmd_kv_drop_key(args: argparse.Namespace) -> int:
    from splitserve.kvstore import drop_key

    drop_key(args.key_file, args.key_id)
    print(f"dropped key {args.key_id} from {args.key_file}; blocks it sealed are now misses")
    return 0


def disagg_config(args: argparse.Namespace):
    from splitserve.worker.disagg_config import DisaggConfig

    return DisaggConfig(
        role=args.role,
        transport=args.kv_transport,
        kv_host=args.kv_host or args.host,
        kv_port=args.kv_port,
        secret=read_secret(args.kv_secret_file),
        encrypt=args.kv_encrypt,
        shm_checksums=args.kv_shm_checksums,
        lease_ttl_s=args.kv_lease_ttl,
        failure_policy=args.kv_load_failure_policy,
        fault=args.kv_test_fault,
        peer=args.kv_peer,
        peer_timeout_s=args.kv_peer_timeout,
        peer_ca=args.worker_ca,
    )


def add_kv_transfer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-transport",
        default="tcp",
        choices=["tcp", "shm"],
        help="how a prefill worker serves KV blocks (shm: same host only)",
    )
    p.add_argument("--kv-host", default=None, help="KV transfer bind address (default: --host)")
    p.add_argument("--kv-port", type=int, default=0, help="KV transfer port (default: any free)")
    p.add_argument(
        "--kv-secret-file",
        default=None,
        help="cluster secret for KV transfers (default: $SPLITSERVE_KV_SECRET)",
    )
    p.add_argument("--kv-encrypt", action="store_true", help="encrypt KV payloads (AES-GCM)")
    p.add_argument(
        "--kv-shm-checksums",
        action="store_true",
        help="checksum shm transfers too (off: leased blocks cannot change under the copy)",
    )
    p.add_argument(
        "--kv-lease-ttl",
        type=float,
        default=30.0,
        help="seconds a prefill worker holds KV for a decode worker to pull",
    )
    p.add_argument(
        "--kv-load-failure-policy",
        default="recompute",
        choices=["recompute", "fail"],
        help="when a KV pull fails: prefill locally (default) or fail the request",
    )
    p.add_argument(
        "--kv-peer",
        action="store_true",
        help="peer KV fetch: lend cached KV to other workers (POST /v1/kv/lease) and pull a "
        "moved session's KV from the home worker a request names (kv_peer); needs the secret",
    )
    p.add_argument(
        "--kv-peer-timeout",
        type=float,
        default=DEFAULT_PEER_TIMEOUT_S,
        metavar="SECONDS",
        help="how long to wait for a peer's lease answer before computing locally "
        f"(default {DEFAULT_PEER_TIMEOUT_S:g})",
    )
    p.add_argument("--kv-test-fault", default=None, help=argparse.SUPPRESS)
