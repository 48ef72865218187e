"""Disk tier: one checksummed, optionally encrypted file per block that survives a restart.

File layout (little-endian)::

    +-------------------------------- header (AES-GCM associated data) -------------------+
    | magic "SSKV" | version u16 | flags u16 | model-id hash 16B | block hash 16B |       |
    | dtype 16B (ASCII, NUL-padded) | ndim u8 | shape 8 x u64 | body length u64 |         |
    | key id 8B (zeros: plaintext) | nonce 12B                                            |
    +----------------------------------------------------------------------------------------+
    | checksum u64: xxh3_64(header || body)                                                |
    | body: payload, or AES-GCM(payload) + 16-byte tag when a key is configured            |
    +----------------------------------------------------------------------------------------+

The checksum covers the stored bytes, so a flipped byte is caught (and counted) before any
decryption; with a key, AES-GCM also authenticates the header, so a block cannot be moved
to another hash or model, or claim another key, without the key. The key id names the key
of the key file (``keyfile``) that sealed the block; re-sealing (``reseal``) changes only
the key id, the nonce, the checksum and the body, never the file's size.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from splitserve.kvstore.base import (
    MAX_NDIM,
    BlockHash,
    BlockMeta,
    KVTier,
    StoredBlock,
    TierUsage,
    to_block,
)
from splitserve.kvstore.keyring import (
    KEY_ID_BYTES,
    NO_KEY,
    NONCE_BYTES,
    TAG_BYTES,
    KeyRing,
    SealError,
    new_nonce,
)

MAGIC = b"SSKV"
FORMAT_VERSION = 2  # 1: no key id; such files are dropped at the scan (and recomputed)
FLAG_ENCRYPTED = 1
HASH_BYTES = 16  # xxh3-128, as common.kv_hash produces
_HEADER = struct.Struct(f"<4sHH16s16s16sB{MAX_NDIM}QQ{KEY_ID_BYTES}s{NONCE_BYTES}s")
_CHECKSUM = struct.Struct("<Q")
PREFIX_BYTES = _HEADER.size + _CHECKSUM.size
SUFFIX = ".kvb"


class BlockFileError(Exception):
    """A block file that must be treated as a miss; ``reason`` names the counter it bumps,
    ``missing_key`` says it is sealed with a key the key file no longer holds."""

    def __init__(self, reason: str, detail: str, missing_key: bool = False) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.missing_key = missing_key


@dataclass(slots=True)
class DiskStats:
    """Why disk reads missed; the worker exports these as metrics."""

    checksum_failures: int = 0
    header_failures: int = 0
    decrypt_failures: int = 0
    io_errors: int = 0
    dropped_at_scan: int = 0


@dataclass(slots=True)
class _Header:
    flags: int
    model_hash: bytes
    block_hash: bytes
    meta: BlockMeta
    body_len: int
    key_id: bytes
    nonce: bytes

    @property
    def encrypted(self) -> bool:
        return bool(self.flags & FLAG_ENCRYPTED)

    def pack(self) -> bytes:
        shape = list(self.meta.shape) + [0] * (MAX_NDIM - len(self.meta.shape))
        dtype = self.meta.dtype.encode("ascii")
        return _HEADER.pack(
            MAGIC, FORMAT_VERSION, self.flags, self.model_hash, self.block_hash, dtype,
            len(self.meta.shape), *shape, self.body_len, self.key_id, self.nonce,
        )  # fmt: skip

    @classmethod
    def unpack(cls, raw: bytes) -> _Header:
        magic, version, flags, model, bhash, dtype, ndim, *rest = _HEADER.unpack(raw)
        shape, (body_len, kid, nonce) = rest[:MAX_NDIM], rest[MAX_NDIM:]
        if magic != MAGIC or version != FORMAT_VERSION or ndim > MAX_NDIM:
            raise BlockFileError("header_failures", f"magic {magic!r} version {version}")
        try:
            meta = BlockMeta(dtype.rstrip(b"\0").decode("ascii"), tuple(shape[:ndim]))
        except (UnicodeDecodeError, ValueError) as e:
            raise BlockFileError("header_failures", str(e)) from None
        return cls(flags, model, bhash, meta, body_len, kid, nonce)

    def sealed_by(self, ring: KeyRing | None) -> _Header:
        """This header for the body sealed by ``ring``'s current key (plaintext if None)."""
        if ring is None:
            return _Header(0, self.model_hash, self.block_hash, self.meta,
                           self.payload_len(), NO_KEY, bytes(NONCE_BYTES))  # fmt: skip
        return _Header(FLAG_ENCRYPTED, self.model_hash, self.block_hash, self.meta,
                       self.payload_len() + TAG_BYTES, ring.current, new_nonce())  # fmt: skip

    def payload_len(self) -> int:
        """The payload's length, from the body's."""
        return self.body_len - (TAG_BYTES if self.encrypted else 0)


def pack_file(header: _Header, payload: bytes, ring: KeyRing | None) -> bytes:
    """A whole block file: ``header`` (from ``sealed_by``), checksum, body."""
    header_raw = header.pack()
    body = ring.seal(header.nonce, payload, header_raw) if header.encrypted else payload
    checksum = xxhash.xxh3_64(header_raw)
    checksum.update(body)
    return header_raw + _CHECKSUM.pack(checksum.intdigest()) + body


def parse_file(prefix: bytes, body: bytes) -> tuple[_Header, bytes]:
    """A block file's header, its checksum verified, and the header's raw bytes."""
    if len(prefix) < PREFIX_BYTES:
        raise BlockFileError("header_failures", "truncated file")
    header_raw = prefix[: _HEADER.size]
    (stored_checksum,) = _CHECKSUM.unpack_from(prefix, _HEADER.size)
    checksum = xxhash.xxh3_64(header_raw)
    checksum.update(body)
    if checksum.intdigest() != stored_checksum:
        raise BlockFileError("checksum_failures", "checksum mismatch")
    header = _Header.unpack(header_raw)
    if header.body_len != len(body):
        raise BlockFileError("header_failures", "length does not match the file size")
    return header, header_raw


def open_body(header: _Header, header_raw: bytes, body: bytes, ring: KeyRing | None) -> bytes:
    """The payload of a parsed block file (decrypted with ``ring`` when it is sealed)."""
    if not header.encrypted:
        return body
    if ring is None:
        raise BlockFileError("decrypt_failures", "sealed, and no key is configured")
    try:
        return ring.open(header.key_id, header.nonce, body, header_raw)
    except SealError as e:
        raise BlockFileError("decrypt_failures", str(e), e.missing_key) from None


def model_id_hash(model_id: str) -> bytes:
    return xxhash.xxh3_128(b"splitserve-kv-model\0" + model_id.encode()).digest()


class DiskTier(KVTier):
    """Blocks as files under ``directory/<first hash byte hex>/<hash hex>.kvb``.

    Capacity counts whole files (header included). The index lives in memory and is rebuilt
    from the directory when the tier is opened; files that do not parse, belong to another
    model or disagree with the key configuration are deleted then. Checksums and decryption
    are checked on read, where any failure (a block sealed with a key the ring lacks too) is
    a miss that deletes the file. Evicted blocks are deleted, not reported: disk is the last
    tier. ``key``: a raw key or a ``KeyRing`` (new files are sealed with its current key).
    While open the tier holds a shared lock on the directory, which re-sealing (``reseal``)
    needs exclusively.
    """

    def __init__(
        self,
        directory: str | Path,
        capacity_bytes: int,
        model_id: str,
        key: bytes | KeyRing | None = None,
        fsync: bool = True,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.stats = DiskStats()
        self._model_hash = model_id_hash(model_id)
        self._ring = KeyRing.of(key) if isinstance(key, bytes) else key
        self._fsync = fsync
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> file size, LRU first
        self._bytes_used = 0
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._dir_lock = DirectoryLock(self.directory, exclusive=False)
        self._scan()

    @property
    def ring(self) -> KeyRing | None:
        """The keys files are sealed with (None: plaintext)."""
        return self._ring

    def close(self) -> None:
        """Let ``splitserve kv reencrypt`` have the directory (the process exiting does too)."""
        self._dir_lock.close()

    # -- paths and encoding ------------------------------------------------------------

    def _path(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.directory / name[:2] / f"{name}{SUFFIX}"

    def _encode(self, block_hash: BlockHash, block: StoredBlock) -> bytes:
        plain = _Header(0, self._model_hash, block_hash, block.meta, len(block.data),
                        NO_KEY, bytes(NONCE_BYTES))  # fmt: skip
        return pack_file(plain.sealed_by(self._ring), block.data, self._ring)

    def _check_header(self, header: _Header, block_hash: BlockHash, file_size: int) -> None:
        # A key id missing from the ring is not checked here: the scan keeps such a file
        # and its first read counts it as a decrypt failure, like a wrong key.
        if header.model_hash != self._model_hash or header.block_hash != block_hash:
            raise BlockFileError("header_failures", "other model or block hash")
        if header.encrypted != (self._ring is not None):
            raise BlockFileError("decrypt_failures", "encryption does not match the key config")
        if PREFIX_BYTES + header.body_len != file_size:
            raise BlockFileError("header_failures", "length does not match the file size")

    def _decode(self, block_hash: BlockHash, prefix: bytes, body: bytes) -> StoredBlock:
        """A block from its file's prefix (header and checksum) and body, read apart so that
        the body is never copied out of a larger buffer."""
        header, header_raw = parse_file(prefix, body)
        self._check_header(header, block_hash, PREFIX_BYTES + len(body))
        return to_block(open_body(header, header_raw, body, self._ring), header.meta)

    # -- start-up scan -----------------------------------------------------------------

    def _scan(self) -> None:
        found: list[tuple[float, BlockHash, int]] = []
        # Block files live in two-hex-digit folders; other folders are not the tier's own
        # (the owner log of ``kvstore.owner_log`` keeps its files next to the blocks).
        for path in self.directory.glob("[0-9a-f][0-9a-f]/*"):
            entry = self._scan_file(path)
            if entry is not None:
                found.append(entry)
        found.sort()  # oldest access first: the LRU order survives the restart
        with self._lock:
            for _, block_hash, size in found:
                self._index[block_hash] = size
                self._bytes_used += size
            self._make_room(0)

    def _scan_file(self, path: Path) -> tuple[float, BlockHash, int] | None:
        try:
            block_hash = bytes.fromhex(path.name.removesuffix(SUFFIX))
            if not path.name.endswith(SUFFIX) or len(block_hash) != HASH_BYTES:
                raise BlockFileError("header_failures", "not a block file name")
            st = path.stat()
            with open(path, "rb") as f:
                header = _Header.unpack(f.read(_HEADER.size).ljust(_HEADER.size, b"\0"))
            self._check_header(header, block_hash, st.st_size)
        except (BlockFileError, ValueError, OSError, struct.error):
            # Leftover temp files of a crashed write land here too.
            self.stats.dropped_at_scan += 1
            path.unlink(missing_ok=True)
            return None
        return st.st_mtime, block_hash, st.st_size

    # -- the tier interface ------------------------------------------------------------

    def put(
        self,
        block_hash: BlockHash,
        data: bytes | bytearray | memoryview | np.ndarray,
        meta: BlockMeta | None = None,
    ) -> bool:
        if len(block_hash) != HASH_BYTES:
            raise ValueError(f"block hash must be {HASH_BYTES} bytes, got {len(block_hash)}")
        if self._touch(block_hash):
            return True
        raw = self._encode(block_hash, to_block(data, meta))
        if len(raw) > self.capacity_bytes:
            return False
        try:
            self._write_atomic(self._path(block_hash), raw)
        except OSError:
            self.stats.io_errors += 1
            return False
        with self._lock:
            if block_hash not in self._index:
                self._make_room(len(raw))
                self._index[block_hash] = len(raw)
                self._bytes_used += len(raw)
        return True

    def _write_atomic(self, path: Path, raw: bytes) -> None:
        path.parent.mkdir(exist_ok=True)
        write_atomic(path, raw, self._fsync)

    def _make_room(self, size: int) -> None:
        """Delete least-recently-used files until ``size`` more bytes fit; holds the lock."""
        while self._index and self._bytes_used + size > self.capacity_bytes:
            victim, victim_size = self._index.popitem(last=False)
            self._bytes_used -= victim_size
            self._path(victim).unlink(missing_ok=True)

    def _touch(self, block_hash: BlockHash) -> bool:
        with self._lock:
            if block_hash not in self._index:
                return False
            self._index.move_to_end(block_hash)
        try:
            os.utime(self._path(block_hash))  # the access time a restart orders LRU by
        except OSError:
            pass
        return True

    def load(self, block_hash: BlockHash) -> StoredBlock | None:
        if not self._touch(block_hash):
            return None
        try:
            with open(self._path(block_hash), "rb", buffering=0) as f:
                prefix = f.read(PREFIX_BYTES)
                return self._decode(block_hash, prefix, f.read())
        except BlockFileError as e:
            setattr(self.stats, e.reason, getattr(self.stats, e.reason) + 1)
        except (OSError, ValueError):
            self.stats.io_errors += 1
        self.evict(block_hash)
        return None

    def contains(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._index

    def evict(self, block_hash: BlockHash) -> bool:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is None:
                return False
            self._bytes_used -= size
            self._path(block_hash).unlink(missing_ok=True)
            return True

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self._bytes_used, self.capacity_bytes, len(self._index))


class DirectoryLock:
    """An ``flock`` on a directory itself (no file of its own in it): shared for a disk tier
    (several may open one directory), exclusive for re-sealing, which fails at once while
    any tier holds it. Released by ``close``, or when the object or its process goes."""

    _fd = -1  # set only once the lock is held: ``close`` never closes another's fd

    def __init__(self, directory: Path, exclusive: bool) -> None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            # Shared: waits out a re-seal under way; exclusive: never waits.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_atomic(path: Path, raw: bytes, fsync: bool, mode: int = 0o666) -> None:
    """Write then rename: a reader or a restart sees the whole file or none of it.

    ``mode`` (less the umask) is the file's from its creation on."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
