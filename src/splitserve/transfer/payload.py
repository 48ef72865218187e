"""Describing a batch of blocks on the wire: layout, and per block its position in the
lease, hash, checksum (xxh3_64 over its bytes) and, when encrypted, its AES-GCM nonce.

Meta layout (little-endian)::

    u8 dtype  u8 ndim  u32[ndim] block_shape  u16+utf8 segment  u32 segment_blocks  u32 n
    n x { u32 index  u8 has_hash  16B hash  u64 checksum  12B nonce }
    n x u32 source_block                                   (only when a segment is named)

An ``shm`` batch names the segment the blocks lie in: a paged cache of ``segment_blocks``
blocks (the prefill worker's own cache, or a staging segment), block ``source_block``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
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
    segment_blocks: int = 0  # blocks in the segment's paged layout
    source_blocks: tuple[int, ...] = ()  # per entry, its block in the segment


def checksum(parts: Iterable[memoryview]) -> int:
    """xxh3_64 of a block's bytes, given as consecutive parts (its runs in a paged cache, or
    one contiguous buffer): the same value either way."""
    state = xxhash.xxh3_64()
    for part in parts:
        state.update(part)
    return state.intdigest()


def verify(entry: BlockEntry, parts: Iterable[memoryview]) -> None:
    """Raise ``ChecksumMismatch`` if ``parts`` are not the block ``entry`` describes."""
    got = checksum(parts)
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
    n = len(meta.entries)
    if len(meta.source_blocks) != (n if meta.segment else 0):
        raise ValueError("a segment batch needs one source block per entry, others none")
    parts = [head, pack_str(meta.segment), struct.pack("<II", meta.segment_blocks, n)]
    parts += [
        _ENTRY.pack(e.index, e.hash is not None, e.hash or _NO_HASH, e.checksum, e.nonce)
        for e in meta.entries
    ]
    parts.append(struct.pack(f"<{len(meta.source_blocks)}I", *meta.source_blocks))
    return b"".join(parts)


def unpack_batch(data: bytes) -> BatchMeta:
    try:
        code, ndim = struct.unpack_from("<BB", data, 0)
        shape = struct.unpack_from(f"<{ndim}I", data, 2)
        segment, offset = unpack_str(data, 2 + 4 * ndim)
        segment_blocks, n = struct.unpack_from("<II", data, offset)
    except struct.error as exc:
        raise ProtocolError(f"truncated block batch meta ({exc})") from exc
    offset += 8
    num_sources = n if segment else 0
    if len(data) != offset + n * _ENTRY.size + 4 * num_sources:
        raise ProtocolError("block batch meta has the wrong length")
    names = {v: k for k, v in _DTYPE_CODES.items()}
    if code not in names:
        raise ProtocolError(f"unknown dtype code {code}")
    entries = []
    for i in range(n):
        index, has_hash, h, check, nonce = _ENTRY.unpack_from(data, offset + i * _ENTRY.size)
        entries.append(BlockEntry(index, h if has_hash else None, check, nonce))
    sources = struct.unpack_from(f"<{num_sources}I", data, offset + n * _ENTRY.size)
    return BatchMeta(names[code], tuple(shape), entries, segment, segment_blocks, sources)


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
