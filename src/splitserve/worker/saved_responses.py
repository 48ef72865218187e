"""Stored responses on disk, next to the disk KV tier: a chain survives a worker restart.

A worker with a disk tier keeps each stored response (``store: true``) in a file in the
tier's directory too, so that after a restart ``previous_response_id`` still finds the
conversation, and the chain's KV, which the disk tier kept, is read back instead of computed::

    <disk dir>/responses/<xxh3-128(tenant) hex>/<xxh3-128(response id) hex>
        '{...}'                        the record as JSON: id, chain, body, context
        0x01 | key id | nonce | AES-GCM(JSON)   sealed with the disk tier's current key when
                                       it has one (the tenant's digest and the file's
                                       name as associated data: a file cannot be moved to
                                       another; ``kv reencrypt`` re-seals it in place)

Names appear only as digests, as in the owner log. A file's modification time orders its
tenant's files by use (a read touches it). Bounds, per tenant: at most ``max_per_tenant``
files and ``max_bytes``; past them the least recently used go. Deleting a response deletes
its file; erasing a tenant's KV removes its directory. A file that cannot be read (sealed
with a key no longer in the key file, torn, tampered) is deleted, as if forgotten.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import xxhash

from splitserve.kvstore.disk import write_atomic
from splitserve.kvstore.keyring import KEY_ID_BYTES, NONCE_BYTES, KeyRing, SealError, new_nonce
from splitserve.kvstore.owner_log import tenant_digest
from splitserve.kvstore.reseal import ResealReport

RESPONSES_DIR = "responses"
DEFAULT_MAX_BYTES = 64 * 2**20  # per tenant
SEALED = b"\x01"


class SavedResponses:
    """The on-disk copy of a worker's stored responses (``response_store.ResponseStore``
    reads it on a miss and writes it on every change). Records are plain dicts here:
    ``{"id", "chain", "body", "context"}``. Used from one thread (the event loop)."""

    def __init__(
        self,
        directory: str | Path,
        max_per_tenant: int,
        ring: KeyRing | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        fsync: bool = True,
    ) -> None:
        if max_per_tenant < 1 or max_bytes < 1:
            raise ValueError("the saved responses need room for at least one per tenant")
        self.directory = Path(directory) / RESPONSES_DIR
        self.max_per_tenant = max_per_tenant
        self.max_bytes = max_bytes
        self.ring = ring
        self._fsync = fsync
        # Per tenant digest: file name -> size, least recently used first (read from the
        # directory on the tenant's first use).
        self._index: dict[str, OrderedDict[str, int]] = {}

    def save(self, tenant: str, record: dict[str, Any]) -> None:
        """Keep ``record`` (replacing one of the same id), then drop what the bounds exclude."""
        owner = tenant_digest(tenant)
        raw = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
        name = _name(record["id"])
        if self.ring is not None:
            raw = _seal(self.ring, raw, owner, name)
        index = self._tenant(owner)
        folder = self.directory / owner.hex()
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / name, raw, self._fsync, mode=0o600)
        index[name] = len(raw)
        index.move_to_end(name)
        while len(index) > 1 and (
            len(index) > self.max_per_tenant or sum(index.values()) > self.max_bytes
        ):
            oldest, _ = index.popitem(last=False)
            (folder / oldest).unlink(missing_ok=True)

    def load(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        """The record of ``tenant``'s ``response_id`` (now the most recently used), or None."""
        owner = tenant_digest(tenant)
        name = _name(response_id)
        if name not in self._tenant(owner):
            return None
        path = self.directory / owner.hex() / name
        try:
            raw = path.read_bytes()
            if raw[:1] == SEALED:
                raw = self._open(raw, owner, response_id)
            elif self.ring is not None:
                raise SealError("plaintext, and this worker seals its disk tier", False)
            record = json.loads(raw)
            if record.get("id") != response_id:
                raise ValueError("the file holds another response")
        except (OSError, SealError, ValueError):
            self.delete(tenant, response_id)
            return None
        self.touch(tenant, response_id)
        return record

    def touch(self, tenant: str, response_id: str) -> None:
        """Mark ``tenant``'s ``response_id`` the most recently used (it was read)."""
        owner, name = tenant_digest(tenant), _name(response_id)
        index = self._tenant(owner)
        if name in index:
            index.move_to_end(name)
            try:
                os.utime(self.directory / owner.hex() / name)
            except FileNotFoundError:
                del index[name]

    def delete(self, tenant: str, response_id: str) -> bool:
        owner = tenant_digest(tenant)
        if self._tenant(owner).pop(_name(response_id), None) is None:
            return False
        (self.directory / owner.hex() / _name(response_id)).unlink(missing_ok=True)
        return True

    def forget_tenant(self, tenant: str) -> int:
        """Delete every response of ``tenant``; how many there were."""
        owner = tenant_digest(tenant)
        count = len(self._tenant(owner))
        del self._index[owner.hex()]
        shutil.rmtree(self.directory / owner.hex(), ignore_errors=True)
        return count

    def __len__(self) -> int:
        if not self.directory.is_dir():
            return 0
        return sum(len(self._tenant(bytes.fromhex(d.name))) for d in self.directory.iterdir())

    def _tenant(self, owner: bytes) -> OrderedDict[str, int]:
        index = self._index.get(owner.hex())
        if index is None:
            folder = self.directory / owner.hex()
            files = []
            if folder.is_dir():
                for entry in os.scandir(folder):
                    if entry.is_file() and not entry.name.startswith("."):  # (a torn write)
                        stat = entry.stat()
                        files.append((stat.st_mtime_ns, entry.name, stat.st_size))
            index = OrderedDict((name, size) for _, name, size in sorted(files))
            self._index[owner.hex()] = index
        return index

    def _open(self, raw: bytes, owner: bytes, response_id: str) -> bytes:
        if self.ring is None:
            raise SealError("sealed, and this worker has no key", True)
        try:
            return _open(self.ring, raw, owner, _name(response_id))
        except SealError:  # sealed before the name was the associated data
            return _open(self.ring, raw, owner, _name(response_id), _legacy_aad(owner, response_id))


def reseal_responses(
    disk_dir: Path, ring: KeyRing, report: ResealReport | None = None
) -> ResealReport:
    """Re-seal the stored responses in a disk tier's directory with ``ring.current`` (for
    ``kv reencrypt``, which holds the directory's lock), counted into ``report``; plaintext
    ones are sealed too, one that cannot be opened is left (a worker deletes it as
    forgotten)."""
    report = ResealReport() if report is None else report
    for path in sorted((Path(disk_dir) / RESPONSES_DIR).glob("*/*")):
        if not path.is_file() or path.name.startswith("."):
            continue
        try:
            owner, raw, st = bytes.fromhex(path.parent.name), path.read_bytes(), os.stat(path)
            if raw[:1] != SEALED:
                json.loads(raw)  # a plaintext record: sealed as it is
            elif raw[1 : 1 + KEY_ID_BYTES] == ring.current:
                report.already_current += 1
                continue
            else:
                raw = _open(ring, raw, owner, path.name)
        except SealError as e:
            report.missing_key += e.missing_key
            report.unreadable += not e.missing_key
            continue
        except (OSError, ValueError):
            report.unreadable += 1
            continue
        write_atomic(path, _seal(ring, raw, owner, path.name), True, mode=0o600)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        report.resealed += 1
    return report


def _seal(ring: KeyRing, raw: bytes, owner: bytes, name: str) -> bytes:
    nonce = new_nonce()
    return SEALED + ring.current + nonce + ring.seal(nonce, raw, _aad(owner, name))


def _open(ring: KeyRing, raw: bytes, owner: bytes, name: str, aad: bytes | None = None) -> bytes:
    kid = raw[1 : 1 + KEY_ID_BYTES]
    nonce = raw[1 + KEY_ID_BYTES : 1 + KEY_ID_BYTES + NONCE_BYTES]
    body = raw[1 + KEY_ID_BYTES + NONCE_BYTES :]
    return ring.open(kid, nonce, body, _aad(owner, name) if aad is None else aad)


def _name(response_id: str) -> str:
    return xxhash.xxh3_128(response_id.encode()).hexdigest()


def _aad(owner: bytes, name: str) -> bytes:
    return b"splitserve-response\1" + owner + name.encode()


def _legacy_aad(owner: bytes, response_id: str) -> bytes:
    return b"splitserve-response\0" + owner + response_id.encode()
