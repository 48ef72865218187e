"""Decode attention that reads K/V in place from the paged cache: a C++ kernel
(``csrc/paged_decode.cpp``, built by ``models.native`` with AVX-512 or AVX2 + FMA) where the
CPU has either, numba elsewhere.

The torch path gathers each decode group's pages into a padded ``[n, kvh, S, hd]`` copy and
runs SDPA with a mask; for one query token per sequence that is mostly copying and per-call
overhead. Here one compiled call attends every decode row of the step: each (sequence,
kv head) is one work item, which reads its blocks straight from the cache through the block
table and serves the ``g = h / kvh`` query heads that share that kv head::

    item (r, kh):  for each block b of sequence r, each position p in it:
                       k = cache[table[r, b], p, kh]          one row, widened to float32
                       s[j, b*B + p] = (q[r, kh*g + j] * scale) . k      for j < g
                   softmax over each s[j, :len_r], then out[r, kh*g + j] = sum_p s[j, p] v_p

bfloat16 rows are widened to float32 by placing their bits in the upper half of a 32-bit
word (exact); float32 rows are taken as they are. Sums run in float32 in a fixed order that
depends only on the sequence itself, so a sequence gets the same result alone or in any
batch, at any thread count. The C++ kernel does the same work 16 positions at a time: their
rows read once (bfloat16 widened), each query head's 16 dot products summed across lanes by one
fixed tree (in 16-float vectors: one AVX-512 register or two AVX2 ones, ``csrc/vec16.h``),
the softmax's exp vectorised; its threads are torch's own (the engine's OpenMP team).
"""

from __future__ import annotations

import numpy as np
import torch

from splitserve.models import native
from splitserve.models.fused_decode import NUMBA_LOCK

try:
    import numba
    from numba import njit, prange
except ImportError:  # the torch path covers everything; this is an accelerator
    numba = None

# Reassociation lets LLVM vectorise the dot products; no result depends on anything but the
# compiled code, so outputs stay deterministic.
_FAST = {"reassoc", "contract", "nnan", "ninf", "nsz"}
# The cache's element type -> (the unsigned type its bits are read as, the shift to float32).
_BITS = {torch.bfloat16: (torch.int16, np.uint16, 16), torch.float32: (torch.int32, np.uint32, 0)}


# The C++ kernel's shapes: head_dim / 16 in NATIVE_CHUNKS, at most NATIVE_MAX_GROUP query heads
# per kv head.
NATIVE_CHUNKS = (1, 2, 4, 6, 8, 16)
NATIVE_MAX_GROUP = 8


def available(cache: torch.Tensor) -> bool:
    """Whether a kernel here can attend over ``cache`` (CPU, bf16 or fp32; the C++ kernel
    built, or numba importable)."""
    if cache.device.type != "cpu" or cache.dtype not in _BITS:
        return False
    return numba is not None or native.load("paged_decode") is None


def native_fits(heads: int, k_cache: torch.Tensor) -> bool:
    """Whether the C++ kernel is built and takes ``heads`` query heads over ``k_cache``."""
    kvh, hd = k_cache.shape[2], k_cache.shape[3]
    return (
        k_cache.device.type == "cpu"
        and k_cache.dtype in _BITS
        and k_cache.is_contiguous()
        and hd % 16 == 0
        and hd // 16 in NATIVE_CHUNKS
        and heads % kvh == 0
        and heads // kvh <= NATIVE_MAX_GROUP
        and native.load("paged_decode") is None
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: np.ndarray,
    lens: np.ndarray,
    scale: float,
    threads: int,
    use_native: bool = True,
) -> torch.Tensor:
    """Attention of ``q`` ``[n, h, hd]`` (one token per sequence) over sequence ``r``'s first
    ``lens[r]`` cached positions, whose blocks are ``tables[r]`` (int64 ``[n, w]``). The caches
    are one layer's ``[num_blocks, B, kvh, hd]``. Returns ``[n, h, hd]`` in ``q``'s dtype.
    ``use_native=False`` takes the numba kernel even where the C++ one fits."""
    if use_native and native_fits(q.shape[1], k_cache):
        return _native(q, k_cache, v_cache, tables, lens, scale, threads)
    signed, unsigned, shift = _BITS[k_cache.dtype]
    kc = k_cache.view(signed).numpy().view(unsigned)
    vc = v_cache.view(signed).numpy().view(unsigned)
    qf = q.float().contiguous().numpy()
    out = np.empty(qf.shape, dtype=np.float32)
    with NUMBA_LOCK:
        numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
        _attend(qf, kc, vc, tables, lens, np.float32(scale), np.uint32(shift), out)
    return torch.from_numpy(out).to(q.dtype)


def _native(q, k_cache, v_cache, tables, lens, scale, threads) -> torch.Tensor:
    with native.intra_op_threads(threads):
        return torch.ops.splitserve.paged_decode(
            q.contiguous(),
            k_cache,
            v_cache,
            torch.from_numpy(np.ascontiguousarray(tables, dtype=np.int64)),
            torch.from_numpy(np.ascontiguousarray(lens, dtype=np.int64)),
            scale,
        )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    start: int,
    scale: float,
) -> torch.Tensor:
    """Attention of a prefill chunk's queries ``q`` ``[n, h, hd]`` at positions ``start ..``
    of one sequence whose blocks are ``table`` (int64 ``[w]``), its own K/V already in the
    caches; the C++ kernel only (check ``native_fits``). Each query gets the bits a decode
    row at its position gets from ``decode_attention``."""
    return torch.ops.splitserve.paged_prefill(
        q.contiguous(), k_cache, v_cache, table.contiguous(), start, scale
    )


def warm_up() -> None:
    """Build the C++ kernels (a few seconds each) and compile the numba one for every cache
    type into numba's on-disk cache (~15 s), once, so that no worker pays for either on its
    first step."""
    native.load_all()
    for dtype in _BITS:
        cache = torch.zeros(1, 1, 1, 1, dtype=dtype)
        table, length = np.zeros((1, 1), dtype=np.int64), np.ones(1, dtype=np.int64)
        q = torch.zeros(1, 1, 1, dtype=dtype)
        decode_attention(q, cache, cache, table, length, 1.0, 1, use_native=False)


if numba is not None:

    @njit(parallel=True, fastmath=_FAST, boundscheck=False, nogil=True, cache=True)
    def _attend(q, kc, vc, tables, lens, scale, shift, out):
        n, h, hd = q.shape
        kvh = kc.shape[2]
        g = h // kvh
        for item in prange(n * kvh):
            r = item // kvh
            kh = item - r * kvh
            length = lens[r]
            scores = np.empty((g, length), dtype=np.float32)
            bits = np.empty(hd, dtype=np.uint32)
            row = bits.view(np.float32)
            qloc = np.empty((g, hd), dtype=np.float32)
            for j in range(g):
                qrow = q[r, kh * g + j]
                for d in range(hd):
                    qloc[j, d] = qrow[d] * scale
            _scores(kc, tables[r], length, kh, shift, qloc, bits, row, scores)
            _softmax_rows(scores)
            acc = np.zeros((g, hd), dtype=np.float32)
            _weighted_values(vc, tables[r], length, kh, shift, scores, bits, row, acc)
            for j in range(g):
                orow = out[r, kh * g + j]
                for d in range(hd):
                    orow[d] = acc[j, d]

    @njit(fastmath=_FAST, boundscheck=False, nogil=True, cache=True)
    def _scores(kc, table, length, kh, shift, qloc, bits, row, scores):
        """``scores[j, p] = qloc[j] . k_p`` for the sequence's first ``length`` positions."""
        bs, hd, g = kc.shape[1], kc.shape[3], qloc.shape[0]
        for b in range((length + bs - 1) // bs):
            block = kc[table[b]]
            for p in range(min(bs, length - b * bs)):
                krow = block[p, kh]
                for d in range(hd):
                    bits[d] = np.uint32(krow[d]) << shift
                for j in range(g):
                    qj = qloc[j]
                    s = np.float32(0.0)
                    for d in range(hd):
                        s += qj[d] * row[d]
                    scores[j, b * bs + p] = s

    @njit(fastmath=_FAST, boundscheck=False, nogil=True, cache=True)
    def _softmax_rows(scores):
        for j in range(scores.shape[0]):
            sj = scores[j]
            best = np.float32(-np.inf)
            for p in range(sj.shape[0]):
                best = max(best, sj[p])
            total = np.float32(0.0)
            for p in range(sj.shape[0]):
                e = np.exp(sj[p] - best)
                sj[p] = e
                total += e
            inv = np.float32(1.0) / total
            for p in range(sj.shape[0]):
                sj[p] *= inv

    @njit(fastmath=_FAST, boundscheck=False, nogil=True, cache=True)
    def _weighted_values(vc, table, length, kh, shift, weights, bits, row, acc):
        """``acc[j] += weights[j, p] * v_p`` over the sequence's first ``length`` positions."""
        bs, hd, g = vc.shape[1], vc.shape[3], acc.shape[0]
        for b in range((length + bs - 1) // bs):
            block = vc[table[b]]
            for p in range(min(bs, length - b * bs)):
                vrow = block[p, kh]
                for d in range(hd):
                    bits[d] = np.uint32(vrow[d]) << shift
                for j in range(g):
                    w = weights[j, b * bs + p]
                    aj = acc[j]
                    for d in range(hd):
                        aj[d] += w * row[d]
