"""Key files for encrypting the disk tier at rest (AES-256-GCM): what `splitserve keygen` writes."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

KEY_BYTES = 32


def generate_key(path: str | Path) -> Path:
    """Write a new random 256-bit key to ``path`` with mode 0600; refuses to overwrite."""
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


def load_key(path: str | Path) -> bytes:
    """Read a key written by :func:`generate_key`, with a clear ValueError when it is unusable."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        key = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"key file {path} does not exist (create one with keygen)") from None
    except OSError as e:
        raise ValueError(f"cannot read key file {path}: {e}") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"key file {path} is not a regular file")
    if mode & 0o077:
        raise ValueError(
            f"key file {path} is accessible by others (mode {mode & 0o777:o}); chmod 600"
        )
    if len(key) != KEY_BYTES:
        raise ValueError(f"key file {path} holds {len(key)} bytes, expected {KEY_BYTES}")
    return key
