"""Mutual authentication with the cluster secret, and the per-connection payload cipher.

Handshake (every connection, before anything else)::

    server -> client  HELLO    nonce_s, flags_s
    client -> server  AUTH     nonce_c, HMAC(secret, "client" | nonce_s | nonce_c | flags)
    server -> client  AUTH_OK  HMAC(secret, "server" | nonce_s | nonce_c | flags)

A peer without the secret learns nothing and gets no bytes; the flags (who asked for
encryption) are under both MACs, so nobody in between can turn encryption off. The AES-GCM key
is derived per connection with HKDF from the secret and both nonces.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from splitserve.transfer.errors import AuthenticationError, ChecksumMismatch, ProtocolError
from splitserve.transfer.wire import FLAG_ENCRYPT, Channel, ErrorCode, Msg

NONCE_BYTES = 32
MAC_BYTES = 32
GCM_NONCE_BYTES = 12
GCM_TAG_BYTES = 16
_LABEL = b"splitserve-kv-auth-v1"


class PayloadCipher:
    """AES-GCM over block payloads, one fresh random nonce per block; the AAD binds each
    ciphertext to its request, position and hash so blocks cannot be swapped or replayed."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    @staticmethod
    def new_nonce() -> bytes:
        return os.urandom(GCM_NONCE_BYTES)

    def encrypt_into(self, nonce: bytes, plain: memoryview, aad: bytes, out: bytearray) -> None:
        """Write ciphertext + tag (``len(plain) + 16`` bytes) into ``out``."""
        self._aead.encrypt_into(nonce, plain, aad, out)

    def decrypt_into(self, nonce: bytes, sealed: memoryview, aad: bytes, out: memoryview) -> None:
        """Verify and decrypt ``sealed`` into ``out``; a forged or damaged block raises."""
        try:
            self._aead.decrypt_into(nonce, sealed, aad, out)
        except Exception as exc:  # cryptography raises InvalidTag
            raise ChecksumMismatch("encrypted block failed authentication (damaged?)") from exc


def block_aad(request_id: str, index: int, block_hash: bytes | None) -> bytes:
    return request_id.encode() + struct.pack("<I", index) + (block_hash or b"")


def server_handshake(ch: Channel, secret: bytes, encrypt: bool) -> PayloadCipher | None:
    """Authenticate a connecting client; on a bad proof send an AUTH error and raise."""
    nonce_s = os.urandom(NONCE_BYTES)
    flags_s = FLAG_ENCRYPT if encrypt else 0
    ch.send(Msg.HELLO, nonce_s, flags=flags_s)
    frame = ch.expect(Msg.AUTH)
    if len(frame.meta) != NONCE_BYTES + MAC_BYTES:
        raise ProtocolError("AUTH meta has the wrong length")
    nonce_c, proof = frame.meta[:NONCE_BYTES], frame.meta[NONCE_BYTES:]
    transcript = nonce_s + nonce_c + struct.pack("<HH", flags_s, frame.flags)
    if not hmac.compare_digest(proof, _mac(secret, b"client", transcript)):
        ch.send_error(ErrorCode.AUTH, "authentication failed")
        raise AuthenticationError("client failed to prove the cluster secret")
    ch.send(Msg.AUTH_OK, _mac(secret, b"server", transcript))
    return _cipher(secret, transcript) if (flags_s | frame.flags) & FLAG_ENCRYPT else None


def client_handshake(ch: Channel, secret: bytes, encrypt: bool) -> PayloadCipher | None:
    """Prove the secret to the server and check that the server knows it too."""
    hello = ch.expect(Msg.HELLO)
    if len(hello.meta) != NONCE_BYTES:
        raise ProtocolError("HELLO meta has the wrong length")
    nonce_c = os.urandom(NONCE_BYTES)
    flags_c = FLAG_ENCRYPT if encrypt else 0
    transcript = hello.meta + nonce_c + struct.pack("<HH", hello.flags, flags_c)
    ch.send(Msg.AUTH, nonce_c + _mac(secret, b"client", transcript), flags=flags_c)
    ok = ch.expect(Msg.AUTH_OK)
    if not hmac.compare_digest(ok.meta, _mac(secret, b"server", transcript)):
        raise AuthenticationError("server failed to prove the cluster secret")
    return _cipher(secret, transcript) if (hello.flags | flags_c) & FLAG_ENCRYPT else None


def _mac(secret: bytes, role: bytes, transcript: bytes) -> bytes:
    return hmac.new(secret, _LABEL + b"|" + role + b"|" + transcript, hashlib.sha256).digest()


def _cipher(secret: bytes, transcript: bytes) -> PayloadCipher:
    hkdf = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=transcript, info=b"splitserve-kv-aesgcm-v1"
    )
    return PayloadCipher(hkdf.derive(secret))
