"""Describing a batch of blocks on the wire: layout, and per block its position in the
lease, hash, checksum (xxh3_64 over its bytes) and, when encrypted, its AES-GCM nonce.

Meta layout (little-endian)::

    u8 dtype  u8 ndim  u32[ndim] block_shape  u16+utf8 segment  u32 n
    n x { u32 index  u8 has_hash  16B hash  u64 checksum  12B nonce }
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import xxhash

from splitserve.transfer.errors import ChecksumMismatch, ProtocolError
from splitserve.transfer.wire import pack_str, unpack_str

_DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
_ENTRY = struct.Struct("<IB16sQ12s")
_NO_HASH = bytes(16)
_NO_NONCE = bytes(12)


class BlockEntry(NamedTuple):
    index: int  # position in the lease (== position in remote_block_ids)
    hash: bytes | None
    checksum: int
    nonce: bytes = _NO_NONCE


class BatchMeta(NamedTuple):
    dtype: str
    block_shape: tuple[int, ...]
    entries: list[BlockEntry]
    segment: str = ""  # shm segment name; empty for socket payloads


def checksum(data: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def verify(entry: BlockEntry, data: memoryview) -> None:
    """Raise ``ChecksumMismatch`` if ``data`` is not the block ``entry`` describes."""
    got = checksum(data)
    if got != entry.checksum:
        raise ChecksumMismatch(
            f"block at position {entry.index} has checksum {got:016x}, "
            f"expected {entry.checksum:016x}"
        )


def pack_batch(meta: BatchMeta) -> bytes:
    head = struct.pack(
        f"<BB{len(meta.block_shape)}I",
        _DTYPE_CODES[meta.dtype],
        len(meta.block_shape),
        *meta.block_shape,
    )
    parts = [head, pack_str(meta.segment), struct.pack("<I", len(meta.entries))]
    parts += [
        _ENTRY.pack(e.index, e.hash is not None, e.hash or _NO_HASH, e.checksum, e.nonce)
        for e in meta.entries
    ]
    return b"".join(parts)


def unpack_batch(data: bytes) -> BatchMeta:
    try:
        code, ndim = struct.unpack_from("<BB", data, 0)
        shape = struct.unpack_from(f"<{ndim}I", data, 2)
        segment, offset = unpack_str(data, 2 + 4 * ndim)
        (n,) = struct.unpack_from("<I", data, offset)
    except struct.error as exc:
        raise ProtocolError(f"truncated block batch meta ({exc})") from exc
    offset += 4
    if len(data) != offset + n * _ENTRY.size:
        raise ProtocolError("block batch meta has the wrong length")
    names = {v: k for k, v in _DTYPE_CODES.items()}
    if code not in names:
        raise ProtocolError(f"unknown dtype code {code}")
    entries = []
    for i in range(n):
        index, has_hash, h, check, nonce = _ENTRY.unpack_from(data, offset + i * _ENTRY.size)
        entries.append(BlockEntry(index, h if has_hash else None, check, nonce))
    return BatchMeta(names[code], tuple(shape), entries, segment)


def check_batch(
    meta: BatchMeta,
    dtype: str,
    block_shape: tuple[int, ...],
    indices: Sequence[int],
    hashes: Sequence[bytes | None],
) -> None:
    """The batch must be laid out like the local cache and carry exactly the planned blocks,
    in order, under the planned hashes (where known)."""
    if meta.dtype != dtype or meta.block_shape != block_shape:
        raise ProtocolError(
            f"peer sent {meta.dtype} blocks of {meta.block_shape}, "
            f"local cache holds {dtype} blocks of {block_shape}"
        )
    if [e.index for e in meta.entries] != list(indices):
        raise ProtocolError("peer sent other blocks than requested")
    for entry, expected in zip(meta.entries, hashes, strict=True):
        if expected is not None and entry.hash != expected:
            raise ChecksumMismatch(f"block at position {entry.index} has an unexpected hash")
