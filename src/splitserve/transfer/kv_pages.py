"""Gather and scatter whole KV blocks of the engine's paged cache.

The cache is one tensor ``[L, 2, num_blocks, bs, kvh, hd]``; block ``b`` of every layer is
``kv_cache[:, :, b]``. A transfer moves blocks as ``[n, L, 2, bs, kvh, hd]``, block-major, so
each block's bytes are contiguous (one checksum call, one ``sendall`` slice per block)::

    kv_cache (per layer l, k|v)      payload
    [ b0 | b1 | b2 | b3 ... ]        [ b1: l0k l0v l1k l1v ... | b3: l0k l0v ... ]
           ^^        ^^   gather ->
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

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


class KVCacheBlocks:
    """A ``BlockSource`` and ``BlockSink`` over an engine's ``kv_cache`` tensor.

    Reads and writes run on the transfer's thread. Reading a leased block is safe while the
    engine runs because leased blocks are never rewritten; writes go to blocks the decode
    engine reserved for the transfer and does not read until the pull returns. ``lock``, if
    given, is held around each copy for engines that need more than that.
    """

    def __init__(self, kv_cache: torch.Tensor, lock: AbstractContextManager | None = None) -> None:
        self.kv_cache = kv_cache
        self.block_shape = block_shape(kv_cache)
        self.dtype = kv_cache.dtype
        self.block_nbytes = block_nbytes(kv_cache)
        self._lock = lock if lock is not None else nullcontext()

    def read_into(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        with self._lock:
            gather_blocks(self.kv_cache, block_ids, out=out)

    def write(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        with self._lock:
            scatter_blocks(self.kv_cache, block_ids, data)


class BufferPool:
    """Reusable ``[n, *block_shape]`` staging buffers, shared by a transport's threads.

    Fresh buffers cost a page fault per 4 KiB on first touch, which at transfer sizes is as
    much as the copy itself; a few kept buffers make every later pull fault-free.
    """

    def __init__(self, keep: int = 4) -> None:
        self._free: list[torch.Tensor] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, n: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer of at least ``n`` blocks (slice it to ``[:n]``)."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.shape[0] >= n and tuple(buf.shape[1:]) == shape and buf.dtype == dtype:
                    return self._free.pop(i)
        return torch.empty((n, *shape), dtype=dtype)

    def give_back(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            # Keep the largest few: they serve every smaller pull too.
            self._free.sort(key=lambda b: b.numel(), reverse=True)
            del self._free[self._keep :]
