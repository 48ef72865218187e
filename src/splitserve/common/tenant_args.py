"""The flags that ``serve``, ``worker`` and ``router`` share for tenants: ``--api-keys FILE``,
and the cluster secret that signs a request's tenant and salts its KV."""

from __future__ import annotations

import argparse
import os

from splitserve.common.tenants import Tenants


def add_api_keys_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="a JSON list of {key or key_sha256, tenant, limits, share_public_prefix}: one "
        "tenant per key, whose KV no other tenant shares; or {keys: [...], tenants: {ID: "
        "{public_prefixes: [...]}}} to let a tenant's keys share those prefixes' KV, see "
        "docs/security.md (default: $SPLITSERVE_API_KEYS; overrides --api-key)",
    )


def tenants_from_args(args: argparse.Namespace) -> Tenants:
    """The tenants of ``--api-keys`` or ``--api-key`` (or their environment variables)."""
    api_key = args.api_key or os.environ.get("SPLITSERVE_API_KEY") or None
    keys_file = args.api_keys or os.environ.get("SPLITSERVE_API_KEYS") or None
    return Tenants.from_args(api_key, keys_file)


def read_secret(path: str | None) -> bytes:
    """The cluster secret for KV transfers: from a file, else $SPLITSERVE_KV_SECRET."""
    if path is None:
        return os.environ.get("SPLITSERVE_KV_SECRET", "").encode()
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as e:
        raise ValueError(f"cannot read the KV secret file {path}: {e.strerror}") from e
    if not secret:
        raise ValueError(f"the KV secret file {path} is empty")
    return secret
