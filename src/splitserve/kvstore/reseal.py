"""Re-seal a disk tier's block files under the current key of a key file (``kv reencrypt``).

Each file is read, verified (checksum, then AES-GCM under the key that sealed it), sealed
again with the current key and a fresh nonce, and replaced atomically (write, then rename)
with its access time kept, so the LRU order a restart rebuilds is unchanged. Plaintext
files are sealed too. A file that cannot be opened (its key is gone, it is corrupt) is left
alone and counted: a worker treats it as a miss.

The directory must not be in use: a running worker holds a shared lock on it and may write
blocks under the key it loaded, so re-sealing takes the lock exclusively and refuses while
a worker holds it (a worker that starts meanwhile waits until re-sealing is done).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from splitserve.kvstore.disk import (
    PREFIX_BYTES,
    SUFFIX,
    BlockFileError,
    DirectoryLock,
    open_body,
    pack_file,
    parse_file,
    write_atomic,
)
from splitserve.kvstore.keyring import KeyRing


@dataclass(slots=True)
class ResealReport:
    """What re-sealing did to a directory's block files."""

    resealed: int = 0
    already_current: int = 0
    missing_key: int = 0  # sealed with a key that is not in the key file: left, a miss
    unreadable: int = 0  # corrupt or of another format: left, a miss (or dropped at a scan)


def reseal_directory(
    directory: str | Path,
    ring: KeyRing,
    also: Callable[[Path, KeyRing], None] | None = None,
) -> ResealReport:
    """Re-seal every block file under ``directory`` with ``ring.current``; ``also``: what
    else lives in the directory and is re-sealed under the same lock (stored responses).

    Raises ``ValueError`` when the directory is not a disk tier's or a worker holds it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory")
    try:
        lock = DirectoryLock(directory, exclusive=True)
    except BlockingIOError:
        raise ValueError(
            f"{directory} is in use by a running worker; stop it first (it writes under "
            "the key it loaded)"
        ) from None
    report = ResealReport()
    with lock:
        for path in sorted(directory.glob(f"[0-9a-f][0-9a-f]/*{SUFFIX}")):
            _reseal_file(path, ring, report)
        if also is not None:
            also(directory, ring)
    return report


def _reseal_file(path: Path, ring: KeyRing, report: ResealReport) -> None:
    try:
        raw = path.read_bytes()
        st = os.stat(path)
        header, header_raw = parse_file(raw[:PREFIX_BYTES], raw[PREFIX_BYTES:])
        if header.encrypted and header.key_id == ring.current:
            report.already_current += 1
            return
        payload = open_body(header, header_raw, raw[PREFIX_BYTES:], ring)
    except BlockFileError as e:
        if e.missing_key:
            report.missing_key += 1
        else:
            report.unreadable += 1
        return
    except (OSError, ValueError):
        report.unreadable += 1
        return
    write_atomic(path, pack_file(header.sealed_by(ring), payload, ring), fsync=True)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    report.resealed += 1
