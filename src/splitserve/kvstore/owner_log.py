"""Who owns the disk tier's blocks, on disk: what lets erasure find them after a restart.

Block files are content-addressed and say nothing of their owner. Next to them, one
append-only file per tenant lists the blocks that tenant's requests made, 32 bytes a record::

    <disk dir>/owners/<xxh3-128(tenant) hex>.own
    record:  session digest (16 B, zeros: no session) | block hash (16 B)

Names and session ids appear only as digests. Records are appended when a request starts
(its prompt's blocks, before any is computed, let alone written) and when it ends (its
output's), so a block file lands after its record, except the output blocks of a request
whose worker dies before it ends. A torn last record (a crash mid-append) is ignored. A file
is rewritten without a session's records when the session is erased, removed when its tenant
is, and compacted (duplicates and blocks no tier holds dropped) when it has doubled since
its last compaction.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import xxhash

from splitserve.kvstore.base import BlockHash
from splitserve.kvstore.disk import write_atomic

OWNERS_DIR = "owners"
SUFFIX = ".own"
DIGEST_BYTES = 16
RECORD_BYTES = 2 * DIGEST_BYTES
NO_SESSION = bytes(DIGEST_BYTES)
COMPACT_MIN_BYTES = 64 * 1024
Record = tuple[bytes, BlockHash]  # (session digest, block hash)


def tenant_digest(tenant: str) -> bytes:
    return xxhash.xxh3_128(b"splitserve-kv-tenant\0" + tenant.encode()).digest()


def session_digest(session: str | None) -> bytes:
    if session is None:
        return NO_SESSION
    return xxhash.xxh3_128(b"splitserve-kv-session\0" + session.encode()).digest()


class OwnerLog:
    """The per-tenant owner files under ``directory`` (the disk tier's directory).

    ``keep(hash)``: whether a block still needs its record (some tier or the caller's memory
    holds it); compaction drops the records of the rest. Thread-safe.
    """

    def __init__(
        self,
        directory: str | Path,
        keep: Callable[[BlockHash], bool] = lambda h: True,
        fsync: bool = True,
    ) -> None:
        self.directory = Path(directory) / OWNERS_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._fsync = fsync
        self._lock = threading.Lock()
        self._compacted: dict[str, int] = {}  # tenant -> file size after its last compaction

    def _path(self, tenant: str) -> Path:
        return self.directory / f"{tenant_digest(tenant).hex()}{SUFFIX}"

    def append(self, tenant: str, session: str | None, hashes: Iterable[BlockHash]) -> None:
        """Record that ``tenant``'s ``session`` (None: a request without one) made ``hashes``."""
        digest = session_digest(session)
        raw = b"".join(digest + h for h in hashes)
        if not raw:
            return
        with self._lock:
            path = self._path(tenant)
            with open(path, "ab") as f:
                f.write(raw)
                f.flush()
                if self._fsync:
                    os.fsync(f.fileno())
                size = f.tell()
            if size > 2 * self._compacted.setdefault(tenant, 0) + COMPACT_MIN_BYTES:
                self._compact(tenant, path)

    def records(self, tenant: str) -> list[Record]:
        """Every whole record of ``tenant``'s file, oldest first."""
        with self._lock:
            return self._read(self._path(tenant))

    def drop_session(self, tenant: str, session: str) -> int:
        """Remove ``session``'s records; returns how many there were."""
        digest = session_digest(session)
        with self._lock:
            path = self._path(tenant)
            records = self._read(path)
            kept = [r for r in records if r[0] != digest]
            if len(kept) != len(records):
                self._rewrite(tenant, path, kept)
            return len(records) - len(kept)

    def drop_tenant(self, tenant: str) -> bool:
        """Remove ``tenant``'s file; False if there was none."""
        with self._lock:
            self._compacted.pop(tenant, None)
            try:
                self._path(tenant).unlink()
            except FileNotFoundError:
                return False
            return True

    # -- holding the lock ----------------------------------------------------------------

    def _read(self, path: Path) -> list[Record]:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return []
        end = len(raw) - len(raw) % RECORD_BYTES
        return [
            (raw[i : i + DIGEST_BYTES], raw[i + DIGEST_BYTES : i + RECORD_BYTES])
            for i in range(0, end, RECORD_BYTES)
        ]

    def _compact(self, tenant: str, path: Path) -> None:
        records = dict.fromkeys(r for r in self._read(path) if self.keep(r[1]))
        self._rewrite(tenant, path, list(records))

    def _rewrite(self, tenant: str, path: Path, records: list[Record]) -> None:
        if not records:
            path.unlink(missing_ok=True)
            self._compacted[tenant] = 0
            return
        raw = b"".join(s + h for s, h in records)
        write_atomic(path, raw, self._fsync)
        self._compacted[tenant] = len(raw)
