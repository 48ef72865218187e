"""Key files for encrypting the KV tiers (AES-256-GCM), mode 600, in two formats.

One key: its 32 raw bytes (what ``splitserve keygen`` writes). Several keys, one of them
current (what ``splitserve kv rotate`` turns a key file into)::

    {"splitserve_kv_keys": 1,
     "current": "<key id, 16 hex digits>",
     "keys": {"<key id>": "<key, 64 hex digits>", ...}}

New blocks are sealed with the current key; a block sealed with another key of the file
stays readable; a block whose key has left the file is a miss. ``splitserve kv rotate``
adds a key and makes it current, ``splitserve kv reencrypt`` re-seals the disk tier under
it, and ``splitserve kv drop-key`` then removes the old one.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path

from splitserve.kvstore.disk import write_atomic
from splitserve.kvstore.keyring import KEY_BYTES, KEY_ID_BYTES, KeyRing, key_id

FORMAT = "splitserve_kv_keys"
FORMAT_VERSION = 1


def generate_key(path: str | Path) -> Path:
    """Write a new random key to ``path`` (one key, mode 0600); refuses to overwrite."""
    path = Path(path)
    try:
        # O_EXCL: never clobber a key that encrypts existing blocks; the mode is set at
        # creation so the key is never readable by others, even briefly.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ValueError(f"key file {path} already exists; refusing to overwrite it") from None
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(KEY_BYTES))
    return path


def load_keyring(path: str | Path) -> KeyRing:
    """Read a key file (either format), with a clear ValueError when it is unusable."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"key file {path} does not exist (create one with keygen)") from None
    except OSError as e:
        raise ValueError(f"cannot read key file {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"key file {path} is not a regular file")
    if mode & 0o077:
        raise ValueError(
            f"key file {path} is accessible by others (mode {mode & 0o777:o}); chmod 600"
        )
    if len(raw) == KEY_BYTES:
        return KeyRing.of(raw)
    try:
        return _decode(raw)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"key file {path} is neither {KEY_BYTES} raw bytes nor a splitserve key file: {e}"
        ) from None


def add_key(path: str | Path) -> bytes:
    """Add a new random key to the key file at ``path`` and make it current; its id."""
    ring = load_keyring(path)
    key = secrets.token_bytes(KEY_BYTES)
    kid = key_id(key)
    save_keyring(path, KeyRing({**ring.keys, kid: key}, kid))
    return kid


def drop_key(path: str | Path, kid_hex: str) -> None:
    """Remove a key that is not current from the key file: blocks it sealed become misses."""
    ring = load_keyring(path)
    kid = parse_key_id(kid_hex)
    if kid not in ring.keys:
        raise ValueError(f"key file {path} holds no key {kid_hex}")
    if kid == ring.current:
        raise ValueError(f"key {kid_hex} is the current key of {path}; rotate first")
    save_keyring(path, KeyRing({k: v for k, v in ring.keys.items() if k != kid}, ring.current))


def save_keyring(path: str | Path, ring: KeyRing) -> None:
    """Replace the key file atomically, mode 0600 from its creation on."""
    write_atomic(Path(path), _encode(ring), fsync=True, mode=0o600)


def parse_key_id(text: str) -> bytes:
    try:
        kid = bytes.fromhex(text)
    except ValueError:
        kid = b""
    if len(kid) != KEY_ID_BYTES:
        raise ValueError(f"a key id is {2 * KEY_ID_BYTES} hex digits, got {text!r}")
    return kid


def _encode(ring: KeyRing) -> bytes:
    keys = {kid.hex(): key.hex() for kid, key in ring.keys.items()}
    doc = {FORMAT: FORMAT_VERSION, "current": ring.current.hex(), "keys": keys}
    return (json.dumps(doc, indent=1) + "\n").encode()


def _decode(raw: bytes) -> KeyRing:
    doc = json.loads(raw)
    if doc.get(FORMAT) != FORMAT_VERSION:
        raise ValueError(f'no "{FORMAT}": {FORMAT_VERSION}')
    keys = {}
    for kid_hex, key_hex in doc["keys"].items():
        key = bytes.fromhex(key_hex)
        if len(key) != KEY_BYTES:
            raise ValueError(f"key {kid_hex} is {len(key)} bytes, expected {KEY_BYTES}")
        keys[parse_key_id(kid_hex)] = key
    return KeyRing(keys, parse_key_id(doc["current"]))
