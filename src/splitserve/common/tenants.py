"""Tenants: who a request belongs to, how the router vouches for it, and its KV salt.

A deployment's clients authenticate with API keys; each key belongs to a tenant. The keys
file (``--api-keys FILE``) is a JSON list::

    [{"key": "sk-alice-1", "tenant": "alice"},
     {"key_sha256": "<hex sha256 of the key>", "tenant": "bob",
      "limits": {"requests_in_flight": 8, "tokens_per_minute": 60000}}]

``--api-key KEY`` is the one-tenant shorthand (tenant ``default``). Presented keys are hashed
and compared with every stored hash in constant time; keys never appear in logs or errors.

The file may also be an object that declares tenants' public prefixes
(``common/public_prefix.py``)::

    {"keys": [{"key": "sk-acme-1", "tenant": "acme", "share_public_prefix": true},
              {"key": "sk-acme-2", "tenant": "acme", "share_public_prefix": true},
              {"key": "sk-acme-3", "tenant": "acme"}],
     "tenants": {"acme": {"public_prefixes": ["You are Acme's assistant. ..."]}}}

A tenant that declares public prefixes separates its keys: each key is a principal of its
own (``acme/<16 hex digits from the key's hash>``) with its own KV salt, and the keys with
``share_public_prefix`` share the KV of those prefixes, and only of those, under the
tenant's public salt. Other tenants' keys share one principal, the tenant.

The router authenticates the client and forwards its principal to workers in a signed
header: ``x-splitserve-tenant: v1 <unix time> <principal> <hex HMAC>``, the MAC (keyed by
the cluster secret) covering the method, path, principal, time and a SHA-256 of the body.
A worker trusts the principal, and the router-written fields of the body (``kv_peer``,
``kv_transfer_params``), only with a valid signature.

Isolation is by construction: the block-hash salt of a request is derived on the server from
its principal (HMAC with the cluster secret), plus the request's ``cache_salt``. Tenants never
share a KV block, so no tenant can learn from ``cached_tokens`` or time to first token what
another one sent. The default tenant without a ``cache_salt`` keeps the empty salt.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.common.public_prefix import PublicPrefix, parse_prefixes

DEFAULT_TENANT = "default"
TENANT_HEADER = "x-splitserve-tenant"
# A signature older (or newer) than this is refused: a captured request cannot be replayed
# later. Router and worker clocks must agree within it.
MAX_SKEW_S = 300.0
_TENANT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_PRINCIPAL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}(/[0-9a-f]{16})?")
_ENTRY_FIELDS = {"key", "key_sha256", "tenant", "limits", "share_public_prefix"}
_LIMITS = ("requests_in_flight", "session_requests_in_flight", "kv_blocks", "tokens_per_minute")
_SIGN_LABEL = b"splitserve-tenant-v1"
_SALT_LABEL = b"splitserve-kv-salt-v1"
_PUBLIC_LABEL = b"splitserve-kv-public-v1"
_KEY_LABEL = b"splitserve-key-label-v1"


class InvalidSignature(Exception):
    """A forwarded request's tenant signature is missing, malformed, stale or forged."""


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's quotas; ``None`` is unlimited."""

    requests_in_flight: int | None = None
    session_requests_in_flight: int | None = None
    kv_blocks: int | None = None
    tokens_per_minute: int | None = None

    @classmethod
    def parse(cls, raw: Any, where: str) -> Limits:
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: limits must be an object")
        unknown = sorted(set(raw) - set(_LIMITS))
        if unknown:
            raise ValueError(f"{where}: unknown limit(s) {', '.join(unknown)}")
        for name, value in raw.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}: limit {name} must be a positive integer")
        return cls(**raw)


@dataclass(frozen=True, slots=True)
class Tenant:
    id: str
    limits: Limits = field(default_factory=Limits)
    public_prefixes: tuple[PublicPrefix, ...] = ()  # declared: its keys are principals


@dataclass(frozen=True, slots=True)
class Key:
    """One API key: its tenant, and whether it shares the tenant's public prefixes."""

    digest: bytes  # sha256 of the key
    tenant: Tenant
    shares_prefix: bool = False

    @property
    def principal(self) -> str:
        """Whose KV the key's requests make: its own in a tenant that declares public
        prefixes, else the tenant's."""
        if not self.tenant.public_prefixes:
            return self.tenant.id
        label = hashlib.sha256(_KEY_LABEL + self.digest).hexdigest()[:16]
        return f"{self.tenant.id}/{label}"


def tenant_of_principal(principal: str) -> str:
    return principal.partition("/")[0]


class Tenants:
    """The deployment's API keys by tenant. Without keys every request is the default
    tenant's and needs no key."""

    def __init__(self, keys: list[Key], path: str | None = None) -> None:
        self.path = path  # the keys file they came from, if any (``common.keys_reload``)
        self._set(keys)

    def _set(self, keys: list[Key]) -> None:
        self._keys = keys
        self.by_id = {k.tenant.id: k.tenant for k in keys}
        # principal -> its tenant, for the keys that share their tenant's public prefixes
        self.sharing = {k.principal: k.tenant for k in keys if k.shares_prefix}

    def adopt(self, other: Tenants) -> None:
        """Take ``other``'s keys in place: everything holding this object sees them at once."""
        self._set(other._keys)

    @classmethod
    def open(cls) -> Tenants:
        return cls([])

    @classmethod
    def single(cls, api_key: str) -> Tenants:
        return cls([Key(_digest(api_key), Tenant(DEFAULT_TENANT))])

    @classmethod
    def from_args(cls, api_key: str | None, api_keys_file: str | None) -> Tenants:
        """``--api-keys FILE`` wins over ``--api-key KEY``; neither: open."""
        if api_keys_file:
            return cls.load(api_keys_file)
        return cls.single(api_key) if api_key else cls.open()

    @classmethod
    def load(cls, path: str | Path) -> Tenants:
        """Read a keys file; any problem is a ValueError naming the file and the entry."""
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as e:
            raise ValueError(f"cannot read the API keys file {path}: {e.strerror}") from None
        except ValueError as e:
            raise ValueError(f"the API keys file {path} is not valid JSON: {e}") from None
        entries, prefixes = _split_file(raw, path)
        keys, limits = [], {}
        for i, entry in enumerate(entries):
            key = _parse_entry(entry, f"{path}: entry {i}", prefixes)
            known = limits.setdefault(key.tenant.id, key.tenant.limits)
            if known != key.tenant.limits:
                raise ValueError(f"{path}: tenant {key.tenant.id!r} has two different limits")
            keys.append(key)
        if len({k.digest for k in keys}) != len(keys):
            raise ValueError(f"{path}: a key is listed twice")
        keyless = sorted(set(prefixes) - set(limits))
        if keyless:
            raise ValueError(f"{path}: tenant {keyless[0]!r} is declared but has no key")
        return cls(keys, str(path))

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str) -> Tenant | None:
        """The tenant of an ``Authorization: Bearer KEY`` header; None if it names none."""
        key = self.identify(authorization)
        return None if key is None else key.tenant

    def identify(self, authorization: str) -> Key | None:
        """The key an ``Authorization: Bearer KEY`` header presents; None if none matches.

        Every stored hash is compared, in constant time, whatever matches first."""
        if not self._keys:
            return Key(b"", Tenant(DEFAULT_TENANT))
        scheme, _, key = authorization.partition(" ")
        given = _digest(key.strip() if scheme.lower() == "bearer" else "")
        found = None
        for k in self._keys:
            if hmac.compare_digest(k.digest, given) and found is None:
                found = k
        return found


def _split_file(raw: Any, path: str | Path) -> tuple[list[Any], dict[str, tuple]]:
    """A keys file's key entries, and the public prefixes of the tenants it declares."""
    if isinstance(raw, dict) and "keys" in raw:
        unknown = sorted(set(raw) - {"keys", "tenants"})
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {', '.join(unknown)}")
        entries, declared = raw.get("keys"), raw.get("tenants", {})
    else:
        entries, declared = raw, {}
    if not isinstance(entries, list) or not entries:
        raise ValueError(
            f"the API keys file {path} must hold a non-empty JSON list "
            '(or an object whose "keys" is one)'
        )
    if not isinstance(declared, dict):
        raise ValueError(f"{path}: tenants must be an object of tenant ids")
    prefixes = {}
    for tenant, spec in declared.items():
        where = f"{path}: tenant {tenant!r}"
        if not _TENANT_ID.fullmatch(tenant):
            raise ValueError(f"{where}: a tenant id must be 1-64 letters, digits, '.', '_', '-'")
        if not isinstance(spec, dict) or set(spec) != {"public_prefixes"}:
            raise ValueError(f'{where} must be {{"public_prefixes": [...]}}')
        prefixes[tenant] = parse_prefixes(spec["public_prefixes"], where)
    return entries, prefixes


def _parse_entry(entry: Any, where: str, prefixes: dict[str, tuple]) -> Key:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object")
    unknown = sorted(set(entry) - _ENTRY_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
    tenant = entry.get("tenant")
    if not isinstance(tenant, str) or not _TENANT_ID.fullmatch(tenant):
        raise ValueError(
            f"{where}: tenant must be 1-64 characters of letters, digits, '.', '_' or '-'"
        )
    if ("key" in entry) == ("key_sha256" in entry):
        raise ValueError(f"{where}: give exactly one of key and key_sha256")
    if "key" in entry:
        if not isinstance(entry["key"], str) or not entry["key"]:
            raise ValueError(f"{where}: key must be a non-empty string")
        digest = _digest(entry["key"])
    else:
        try:
            digest = bytes.fromhex(entry["key_sha256"])
        except (TypeError, ValueError):
            digest = b""
        if len(digest) != 32:
            raise ValueError(f"{where}: key_sha256 must be 64 hex digits")
    shares = entry.get("share_public_prefix", False)
    if not isinstance(shares, bool):
        raise ValueError(f"{where}: share_public_prefix must be true or false")
    if shares and tenant not in prefixes:
        raise ValueError(
            f"{where}: share_public_prefix needs public_prefixes declared for tenant {tenant!r}"
        )
    limits = Limits.parse(entry.get("limits"), where)
    return Key(digest, Tenant(tenant, limits, prefixes.get(tenant, ())), shares)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def sign(secret: bytes, method: str, path: str, tenant: str, body: bytes | None) -> str:
    """The ``x-splitserve-tenant`` value vouching that ``tenant`` (a principal: a tenant,
    or one key of it, ``Key.principal``) sent this request."""
    stamp = str(int(time.time()))
    return f"v1 {stamp} {tenant} {_mac(secret, method, path, tenant, stamp, body)}"


def verify(secret: bytes, value: str, method: str, path: str, body: bytes | None) -> str:
    """The principal a signed header names; raises InvalidSignature unless it is genuine."""
    parts = value.split(" ")
    if len(parts) != 4 or parts[0] != "v1" or not _PRINCIPAL.fullmatch(parts[2]):
        raise InvalidSignature("malformed tenant signature")
    _, stamp, tenant, mac = parts
    try:
        age = abs(time.time() - int(stamp))
    except ValueError:
        raise InvalidSignature("malformed tenant signature") from None
    if age > MAX_SKEW_S:
        raise InvalidSignature("stale tenant signature (are the clocks in sync?)")
    expected = _mac(secret, method, path, tenant, stamp, body)
    if not hmac.compare_digest(mac.encode(), expected.encode()):
        raise InvalidSignature("forged tenant signature")
    return tenant


def _mac(secret: bytes, method: str, path: str, tenant: str, stamp: str, body: bytes | None) -> str:
    digest = hashlib.sha256(body or b"").hexdigest()
    msg = "|".join((method.upper(), path, tenant, stamp, digest)).encode()
    return hmac.new(secret, _SIGN_LABEL + b"|" + msg, hashlib.sha256).hexdigest()


def kv_salt(secret: bytes, tenant: str, cache_salt: str | None = None) -> str:
    """The block-hash salt of a request: derived from its principal (``tenant``) with the
    cluster secret, then the request's own ``cache_salt``. The default tenant alone keeps
    the empty salt."""
    base = ""
    if tenant != DEFAULT_TENANT:
        base = hmac.new(secret, _SALT_LABEL + b"|" + tenant.encode(), hashlib.sha256).hexdigest()
    return f"{base}|{cache_salt}" if cache_salt else base


def public_salt(secret: bytes, tenant: str) -> str:
    """The salt of a tenant's public prefixes, shared by its keys that opt in."""
    return hmac.new(secret, _PUBLIC_LABEL + b"|" + tenant.encode(), hashlib.sha256).hexdigest()
