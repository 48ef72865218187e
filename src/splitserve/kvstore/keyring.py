"""The keys that seal KV blocks at rest (AES-256-GCM), each named by a key id.

A key id is the first 8 bytes of SHA-256 over a label and the key: every sealed block
carries the id of the key that sealed it, so that a ring of several keys opens each block
with the right one, and a block whose key has left the ring is told apart from a tampered
one. The id reveals nothing of the key.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_BYTES = 32
KEY_ID_BYTES = 8
NONCE_BYTES = 12
TAG_BYTES = 16
NO_KEY = bytes(KEY_ID_BYTES)  # the key id field of a plaintext block


def key_id(key: bytes) -> bytes:
    if len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
    return hashlib.sha256(b"splitserve-kv-key-id\0" + key).digest()[:KEY_ID_BYTES]


class SealError(Exception):
    """A sealed block that cannot be opened; ``missing_key``: its key is not in the ring."""

    def __init__(self, detail: str, missing_key: bool) -> None:
        super().__init__(detail)
        self.missing_key = missing_key


class KeyRing:
    """Keys by id, one of them current: new blocks are sealed with the current key, and a
    block sealed with any key of the ring opens."""

    def __init__(self, keys: Mapping[bytes, bytes], current: bytes) -> None:
        for kid, key in keys.items():
            if key_id(key) != kid:
                raise ValueError(f"key id {kid.hex()} does not match its key")
        if current not in keys:
            raise ValueError(f"the current key {current.hex()} is not among the keys")
        self.keys = dict(keys)
        self.current = current
        self._aeads = {kid: AESGCM(key) for kid, key in keys.items()}

    @classmethod
    def of(cls, current: bytes, *older: bytes) -> KeyRing:
        """A ring of raw keys, the first one current."""
        keys = {key_id(k): k for k in (current, *older)}
        return cls(keys, key_id(current))

    def seal(self, nonce: bytes, data: bytes, aad: bytes) -> bytes:
        """``data`` encrypted under the current key, with its 16-byte tag appended."""
        return self._aeads[self.current].encrypt(nonce, data, aad)

    def open(self, kid: bytes, nonce: bytes, body: bytes, aad: bytes) -> bytes:
        """The plaintext of a block sealed under key ``kid``; ``SealError`` if it cannot be."""
        aead = self._aeads.get(kid)
        if aead is None:
            raise SealError(f"sealed with key {kid.hex()}, which is not in the key file", True)
        try:
            return aead.decrypt(nonce, body, aad)
        except InvalidTag:
            raise SealError("wrong key or tampered", False) from None


def new_nonce() -> bytes:
    # Random 96-bit nonces: safe for far more blocks than one key seals before rotation.
    return os.urandom(NONCE_BYTES)
