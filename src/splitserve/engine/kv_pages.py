"""Whole KV blocks of the engine's paged cache: gathered, scattered, or read in place.

The cache is one tensor ``[L, 2, num_blocks, bs, kvh, hd]``; block ``b`` of every layer is
``kv_cache[:, :, b]``. A transfer moves blocks block-major, ``[n, L, 2, bs, kvh, hd]``, one
block's bytes after another::

    kv_cache (per layer l, k|v)      payload
    [ b0 | b1 | b2 | b3 ... ]        [ b1: l0k l0v l1k l1v ... | b3: l0k l0v ... ]
           ^^        ^^   gather ->

The transports do not gather: ``PagedBytes`` hands them each block as its runs in the cache,
which they send, receive and checksum in place (see there). ``gather_blocks`` and
``scatter_blocks`` serve the KV tiers and the benchmarks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def _block_major(kv_cache: torch.Tensor) -> torch.Tensor:
    """A view of the cache with the block dimension first (no copy)."""
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [L, 2, blocks, bs, kvh, hd], got {kv_cache.shape}")
    return kv_cache.permute(2, 0, 1, 3, 4, 5)


def _cache_order(blocks: torch.Tensor) -> torch.Tensor:
    """A view of ``[n, L, 2, ...]`` blocks in the cache's dim order ``[L, 2, n, ...]``."""
    return blocks.permute(1, 2, 0, 3, 4, 5)


def _index(block_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(block_ids, dtype=torch.long, device=device)


def block_shape(kv_cache: torch.Tensor) -> tuple[int, ...]:
    """Shape of one block as transferred: ``(L, 2, bs, kvh, hd)``."""
    return tuple(_block_major(kv_cache).shape[1:])


def block_nbytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one block across all layers, K and V."""
    shape = block_shape(kv_cache)
    return kv_cache.element_size() * int(torch.Size(shape).numel())


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: Sequence[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy blocks out of the cache as a contiguous ``[n, L, 2, bs, kvh, hd]`` tensor.

    One indexed copy; ``out`` (contiguous, right shape and dtype) avoids the allocation, e.g.
    to gather straight into a shared-memory segment or a reused send buffer.
    """
    shape = (len(block_ids), *block_shape(kv_cache))
    if out is None:
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    elif tuple(out.shape) != shape or out.dtype != kv_cache.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {kv_cache.dtype} tensor of shape {shape}")
    # Selecting along the cache's own block dim into a permuted view of ``out`` copies whole
    # per-layer runs; selecting along dim 0 of a permuted cache copies element by element
    # (measured 20x slower).
    torch.index_select(kv_cache, 2, _index(block_ids, kv_cache.device), out=_cache_order(out))
    return out


def scatter_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int], data: torch.Tensor) -> None:
    """Write ``data`` (``[n, L, 2, bs, kvh, hd]``) into blocks ``block_ids`` of the cache.

    One indexed copy; the inverse of ``gather_blocks``.
    """
    view = _block_major(kv_cache)
    if tuple(data.shape) != (len(block_ids), *view.shape[1:]):
        raise ValueError(
            f"data shape {tuple(data.shape)} does not match {len(block_ids)} blocks of "
            f"{tuple(view.shape[1:])}"
        )
    if data.dtype != kv_cache.dtype:
        raise ValueError(f"data dtype {data.dtype} does not match cache dtype {kv_cache.dtype}")
    # Same reason as in gather_blocks: index along the cache's block dim, not a permuted one.
    idx = _index(block_ids, kv_cache.device)
    kv_cache.index_copy_(2, idx, _cache_order(data.to(kv_cache.device)))


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def zero_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> None:
    """Overwrite blocks ``block_ids`` of the cache with zeros (erased KV)."""
    kv_cache.index_fill_(2, _index(block_ids, kv_cache.device), 0)


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a cache dtype (``"float32"``, ``"bfloat16"``, ...)."""
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported KV cache dtype {dtype}")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV cache dtype {name!r}") from None


def as_bytes(blocks: torch.Tensor) -> np.ndarray:
    """The raw bytes of contiguous CPU blocks as a ``[n, block_nbytes]`` uint8 array sharing
    their memory (goes through ``uint8`` because numpy has no bfloat16)."""
    return blocks.reshape(blocks.shape[0], -1).view(torch.uint8).numpy()


class PagedBytes:
    """A paged cache's bytes, block by block, without gathering them.

    Viewed as ``[rows, num_blocks, run]`` bytes (``rows = L * 2``; a run is one layer's K or
    V of one block), block ``b`` is ``rows`` contiguous runs, one per (layer, K|V)::

        row 0 (l0 k): [ b0 | b1 | b2 ... ]     block 1 = runs (0,1) (1,1) (2,1) ...
        row 1 (l0 v): [ b0 | b1 | b2 ... ]     = its block-major bytes, in that order
        ...

    Taken in row order the runs are exactly the block's block-major bytes, so a streaming
    checksum over them equals the checksum of the gathered block, and a socket can send or
    receive them in place (``sendmsg``/``recvmsg_into``). ``buf`` may be read-only (a peer's
    cache mapped with ``PROT_READ``); then only reading works.
    """

    def __init__(self, buf: object, rows: int, num_blocks: int, run: int) -> None:
        self.rows, self.num_blocks, self.run = rows, num_blocks, run
        count = rows * num_blocks * run
        self.array = np.frombuffer(buf, np.uint8, count=count).reshape(rows, num_blocks, run)
        self._flat = memoryview(self.array.reshape(-1))
        self._row_stride = num_blocks * run

    @classmethod
    def of_cache(cls, kv_cache: torch.Tensor) -> PagedBytes:
        """The bytes of a contiguous host ``[L, 2, blocks, bs, kvh, hd]`` cache (shared)."""
        if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
            raise ValueError("KV transfer needs a contiguous KV cache in host memory")
        _block_major(kv_cache)  # checks the layout
        rows, num_blocks = kv_cache.shape[0] * 2, kv_cache.shape[2]
        flat = kv_cache.view(torch.uint8).numpy().reshape(-1)
        return cls(flat, rows, num_blocks, flat.size // (rows * num_blocks))

    @property
    def block_nbytes(self) -> int:
        return self.rows * self.run

    def runs(self, block: int) -> list[memoryview]:
        """Block ``block``'s bytes as ``rows`` views into the cache, in block-major order."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} outside a cache of {self.num_blocks} blocks")
        starts = range(block * self.run, self.rows * self._row_stride, self._row_stride)
        return [self._flat[o : o + self.run] for o in starts]

    def copy_block(self, src: PagedBytes, src_block: int, dst_block: int) -> None:
        """Copy block ``src_block`` of ``src`` into block ``dst_block`` here (one pass)."""
        self.array[:, dst_block] = src.array[:, src_block]

    def write_block(self, block: int, data: np.ndarray) -> None:
        """Copy ``data`` (``block_nbytes`` contiguous bytes) into block ``block``."""
        self.array[:, block] = data.reshape(self.rows, self.run)

    def gather(self, blocks: Sequence[int]) -> np.ndarray:
        """Blocks ``blocks`` as a new ``[n, block_nbytes]`` array, each block-major.

        Numpy copies on the calling thread alone, so a helper thread can copy blocks while the
        engine steps without opening an OpenMP team of its own (``omp_teams.py``)."""
        out = np.empty((len(blocks), self.rows, self.run), np.uint8)
        for i, block in enumerate(blocks):
            out[i] = self.array[:, block]
        return out.reshape(len(blocks), self.block_nbytes)


class KVCacheBlocks:
    """A ``BlockSource`` and ``BlockSink`` over an engine's host ``kv_cache`` tensor.

    Transports read and write its ``pages`` on their own threads. Reading a leased block is
    safe while the engine runs because leased blocks are never rewritten; writes go to blocks
    the decode engine reserved for the transfer and does not read until the pull returns.
    ``shm_segment`` names the shared-memory segment the cache lives in, if it does (see
    ``shm_cache.SharedKVCache``): the ``shm`` transport then lets peers copy straight out of it.
    """

    def __init__(self, kv_cache: torch.Tensor, shm_segment: str | None = None) -> None:
        self.kv_cache = kv_cache
        self.block_shape = block_shape(kv_cache)
        self.dtype = kv_cache.dtype
        self.pages = PagedBytes.of_cache(kv_cache)
        self.block_nbytes = self.pages.block_nbytes
        self.shm_segment = shm_segment
