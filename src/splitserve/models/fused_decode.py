"""A fused decode step for a few single-token sequences on CPU, compiled with numba.

A batch-1 decode step of the torch model runs ~600 small ops (norms, RoPE, the paged gather,
SDPA, glue), ~10 ms of overhead on this project's reference box, and MKL runs its one-row
weight products on one core, at one core's share of the memory bandwidth. This path runs the
whole step (every layer: RMSNorm, qkv product, RoPE, KV write into the paged cache, attention
over the block table with GQA, output product, residual, RMSNorm, gate/up product, SiLU * up,
down product, residual; then the final norm and the output projection) in two compiled calls,
and splits each weight product by columns over ``parts`` blocks that the threads stream in
parallel::

    W^T [in, out], row-major:   | part 0 columns | part 1 columns |   one thread each
    y[r, j] = sum over i of x[r, i] * W^T[i, j], i in blocks of 8, in increasing order

Every output element is summed by one thread in a fixed order that depends neither on how
many rows share the step, nor on how many threads run the parts, nor on the other parts: a
sequence gets bit-identical logits alone or with others on this path, at any thread count.
Against the torch path (MKL, SDPA) results agree to float32 rounding.

numba is optional: without it (or on a model this path does not cover) ``unavailable_reason``
says why and the model runner keeps the torch path.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

try:
    import numba
    import numba.typed
    from numba import njit, prange
except ImportError as exc:  # the torch path covers everything; numba is an accelerator
    numba = None
    _IMPORT_ERROR: str | None = f"numba is not importable ({exc})"
else:
    _IMPORT_ERROR = None

# Reassociation lets LLVM vectorise the dot products and the 8-term sums; contraction gives FMAs.
# Neither makes a result depend on anything but the compiled code, so outputs stay deterministic.
_FAST = {"reassoc", "contract"}
# numba's parallel runtime may not be entered by two Python threads at once (its workqueue
# layer aborts the process); engines in one process share it through this lock.
NUMBA_LOCK = threading.Lock()
# Only the explicit prange loops run in parallel: each is one fork/join per call, worth it for
# a weight product, not for the small elementwise steps between them.
_PARALLEL = {
    "prange": True,
    **dict.fromkeys(
        ("comprehension", "reduction", "inplace_binop", "setitem", "numpy", "stencil", "fusion"),
        False,
    ),
}


def unavailable_reason(model: torch.nn.Module, device: torch.device) -> str | None:
    """Why the fused path cannot run this model, or ``None`` if it can."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if device.type != "cpu":
        return f"it runs on CPU only, the model is on {device}"
    if getattr(model, "dtype", None) != torch.float32:
        return f"it runs float32 weights only, the model has {getattr(model, 'dtype', None)}"
    return None


def _typed_list(arrays: list[np.ndarray]) -> Any:
    # Built by cached compiled helpers: numba.typed.List's own methods compile afresh in
    # every process (~2 s of a worker's start).
    out = _list_of(arrays[0])
    for array in arrays[1:]:
        _append(out, array)
    return out


def _np(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a contiguous CPU tensor."""
    if not t.is_contiguous():
        raise ValueError("fused decode needs contiguous weights")
    return t.detach().numpy()


class FusedDecoder:
    """The fused step for one ``LlamaForCausalLM``; holds numpy views of its weights, no copies.

    ``parts`` is how many column blocks each weight product is cut into (the most threads it
    can use); ``forward(..., threads=t)`` runs them on ``t <= parts`` threads with the same
    result.
    """

    exact = False  # the torch path's results to rounding only: small steps take it

    def __init__(self, model: torch.nn.Module, parts: int) -> None:
        reason = unavailable_reason(model, next(model.parameters()).device)
        if reason is not None:
            raise RuntimeError(f"fused decode unavailable: {reason}")
        if parts < 1:
            raise ValueError(f"parts must be >= 1, got {parts}")
        cfg = model.config
        self.model, self.parts = model, parts
        self.eps = float(cfg.rms_norm_eps)
        self.dims = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        layers = model.layers
        attn = [layer.self_attn for layer in layers]
        mlp = [layer.mlp for layer in layers]
        empty = np.zeros(0, dtype=np.float32)
        # Typed lists (views, no copies), not tuples: a tuple's type holds its length, and every
        # model depth would compile the kernel again.
        self.weights: tuple[Any, ...] = tuple(
            _typed_list(arrays)
            for arrays in (
                [_np(layer.input_layernorm.weight) for layer in layers],
                [_np(a.qkv_proj.weight.t()) for a in attn],
                [empty if a.qkv_proj.bias is None else _np(a.qkv_proj.bias) for a in attn],
                [_np(a.o_proj.weight.t()) for a in attn],
                [empty if a.o_proj.bias is None else _np(a.o_proj.bias) for a in attn],
                [_np(layer.post_attention_layernorm.weight) for layer in layers],
                [_np(m.gate_up_proj.weight.t()) for m in mlp],
                [_np(m.down_proj.weight.t()) for m in mlp],
            )
        )
        self.final_norm = _np(model.norm.weight)
        self.lm_head = _np(model.lm_head_t)

    def forward(
        self,
        input_ids: torch.Tensor,
        slots: np.ndarray,
        block_tables: np.ndarray,
        context_lens: np.ndarray,
        threads: int,
    ) -> torch.Tensor:
        """Float32 logits ``[n, vocab]`` of ``n`` single-token sequences, each at position
        ``context_lens[r] - 1`` with its k/v written to ``slots[r]`` of the model's bound cache;
        ``block_tables`` ``[n, w]`` int64 covers every context (padding is never read).
        """
        model = self.model
        positions = torch.from_numpy(np.asarray(context_lens, dtype=np.int64) - 1)
        cos, sin = model.rotary(positions, torch.float32)  # [n, 1, hd], HF's exact tables
        x = model.embed_tokens.index_select(0, input_ids).numpy()
        kv = _np(model.kv_cache)
        logits = np.empty((x.shape[0], self.lm_head.shape[1]), dtype=np.float32)
        num_heads, num_kv_heads, head_dim = self.dims
        with NUMBA_LOCK:
            numba.set_num_threads(max(1, min(threads, self.parts, numba.config.NUMBA_NUM_THREADS)))
            hidden = _decode_layers(
                x,
                *self.weights,
                kv,
                cos[:, 0].numpy(),
                sin[:, 0].numpy(),
                slots,
                block_tables,
                context_lens,
                num_heads,
                num_kv_heads,
                head_dim,
                self.eps,
                self.parts,
            )
            _final(hidden, self.final_norm, self.lm_head, logits, self.eps, self.parts)
        return torch.from_numpy(logits)


if numba is not None:

    @njit(cache=True)
    def _list_of(first):
        out = numba.typed.List()
        out.append(first)
        return out

    @njit(cache=True)
    def _append(out, array):
        out.append(array)

    @njit(fastmath=_FAST, boundscheck=False, cache=True)
    def _gemv_cols(x, w, y, j0, j1):
        """``y[:, j0:j1] = x @ w[:, j0:j1]``, ``w`` read once, in row order, for all rows."""
        n, k = x.shape
        m = j1 - j0
        acc = np.zeros((n, m), dtype=np.float32)
        k8 = k - k % 8
        for i in range(0, k8, 8):
            w0, w1, w2, w3 = w[i, j0:j1], w[i + 1, j0:j1], w[i + 2, j0:j1], w[i + 3, j0:j1]
            w4, w5, w6, w7 = w[i + 4, j0:j1], w[i + 5, j0:j1], w[i + 6, j0:j1], w[i + 7, j0:j1]
            for r in range(n):
                x0, x1, x2, x3 = x[r, i], x[r, i + 1], x[r, i + 2], x[r, i + 3]
                x4, x5, x6, x7 = x[r, i + 4], x[r, i + 5], x[r, i + 6], x[r, i + 7]
                a = acc[r]
                for j in range(m):
                    a[j] += (x0 * w0[j] + x1 * w1[j] + x2 * w2[j] + x3 * w3[j]) + (
                        x4 * w4[j] + x5 * w5[j] + x6 * w6[j] + x7 * w7[j]
                    )
        for i in range(k8, k):
            wi = w[i, j0:j1]
            for r in range(n):
                xi = x[r, i]
                a = acc[r]
                for j in range(m):
                    a[j] += xi * wi[j]
        y[:, j0:j1] = acc

    @njit(boundscheck=False, cache=True)
    def _rms_norm(x, w, eps):
        n, h = x.shape
        out = np.empty_like(x)
        for r in range(n):
            ss = np.float32(0.0)
            for j in range(h):
                ss += x[r, j] * x[r, j]
            inv = np.float32(1.0) / np.sqrt(ss / np.float32(h) + np.float32(eps))
            for j in range(h):
                out[r, j] = x[r, j] * inv * w[j]
        return out

    @njit(boundscheck=False, cache=True)
    def _add(y, b):
        """``y += b`` for ``b`` of ``y``'s shape or one row of it (broadcast); no-op if empty."""
        if b.size == 0:
            return
        n, m = y.shape[0], y.shape[1]
        flat = b.reshape(-1, m)
        for r in range(n):
            row = flat[r if flat.shape[0] > 1 else 0]
            for j in range(m):
                y[r, j] += row[j]

    @njit(boundscheck=False, cache=True)
    def _rope(v, cos, sin):
        """In place on one head ``v[hd]``: ``v * cos + swap_halves(v) * signed_sin``."""
        half = v.shape[0] // 2
        for d in range(half):
            a, b = v[d], v[d + half]
            v[d] = a * cos[d] + b * sin[d]
            v[d + half] = b * cos[d + half] + a * sin[d + half]

    @njit(fastmath=_FAST, boundscheck=False, cache=True)
    def _attend(q, kc, vc, table, length, kv_head, scale, out):
        """One query head ``q[hd]`` over ``length`` cached positions of one sequence."""
        bs = kc.shape[1]
        scores = np.empty(length, dtype=np.float32)
        best = np.float32(-np.inf)
        for p in range(length):
            key = kc[table[p // bs], p % bs, kv_head]
            s = np.float32(0.0)
            for d in range(q.shape[0]):
                s += q[d] * key[d]
            s *= scale
            scores[p] = s
            best = max(best, s)
        total = np.float32(0.0)
        for p in range(length):
            e = np.exp(scores[p] - best)
            scores[p] = e
            total += e
        out[:] = 0.0
        for p in range(length):
            val = vc[table[p // bs], p % bs, kv_head]
            wt = scores[p]
            for d in range(out.shape[0]):
                out[d] += wt * val[d]
        for d in range(out.shape[0]):
            out[d] /= total

    @njit(parallel=_PARALLEL, nogil=True, boundscheck=False, cache=True)
    def _decode_layers(
        x,
        in_norms,
        qkv_ws,
        qkv_bs,
        o_ws,
        o_bs,
        post_norms,
        gate_up_ws,
        down_ws,
        kv,
        cos,
        sin,
        slots,
        tables,
        lens,
        num_heads,
        num_kv_heads,
        head_dim,
        eps,
        parts,
    ):
        n = x.shape[0]
        bs = kv.shape[3]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        group = num_heads // num_kv_heads
        scale = np.float32(head_dim**-0.5)
        x = x.copy()
        for layer in range(len(qkv_ws)):
            kc, vc = kv[layer, 0], kv[layer, 1]
            # attention block
            h = _rms_norm(x, in_norms[layer], eps)
            wqkv, qkv_b = qkv_ws[layer], qkv_bs[layer]
            qkv = np.empty((n, wqkv.shape[1]), dtype=np.float32)
            for p in prange(parts):
                j0, j1 = wqkv.shape[1] * p // parts, wqkv.shape[1] * (p + 1) // parts
                _gemv_cols(h, wqkv, qkv, j0, j1)
            _add(qkv, qkv_b)
            for r in range(n):
                for head in range(num_heads + num_kv_heads):
                    _rope(qkv[r, head * head_dim : (head + 1) * head_dim], cos[r], sin[r])
                block, offset = slots[r] // bs, slots[r] % bs
                for g in range(num_kv_heads):
                    k0 = q_size + g * head_dim
                    kc[block, offset, g] = qkv[r, k0 : k0 + head_dim]
                    vc[block, offset, g] = qkv[r, k0 + kv_size : k0 + kv_size + head_dim]
            att = np.empty((n, q_size), dtype=np.float32)
            for item in prange(n * num_heads):
                r, head = item // num_heads, item % num_heads
                lo = head * head_dim
                _attend(
                    qkv[r, lo : lo + head_dim],
                    kc,
                    vc,
                    tables[r],
                    lens[r],
                    head // group,
                    scale,
                    att[r, lo : lo + head_dim],
                )
            wo, o_b = o_ws[layer], o_bs[layer]
            o = np.empty((n, wo.shape[1]), dtype=np.float32)
            for p in prange(parts):
                j0, j1 = wo.shape[1] * p // parts, wo.shape[1] * (p + 1) // parts
                _gemv_cols(att, wo, o, j0, j1)
            _add(o, o_b)
            _add(x, o)
            # MLP block
            h2 = _rms_norm(x, post_norms[layer], eps)
            wgu = gate_up_ws[layer]
            gu = np.empty((n, wgu.shape[1]), dtype=np.float32)
            for p in prange(parts):
                j0, j1 = wgu.shape[1] * p // parts, wgu.shape[1] * (p + 1) // parts
                _gemv_cols(h2, wgu, gu, j0, j1)
            inter = wgu.shape[1] // 2
            act = np.empty((n, inter), dtype=np.float32)
            for r in range(n):
                for j in range(inter):
                    gate = gu[r, j]
                    act[r, j] = gate / (np.float32(1.0) + np.exp(-gate)) * gu[r, inter + j]
            wd = down_ws[layer]
            d = np.empty((n, wd.shape[1]), dtype=np.float32)
            for p in prange(parts):
                j0, j1 = wd.shape[1] * p // parts, wd.shape[1] * (p + 1) // parts
                _gemv_cols(act, wd, d, j0, j1)
            _add(x, d)
        return x

    @njit(parallel=_PARALLEL, nogil=True, boundscheck=False, cache=True)
    def _final(x, norm, lm_head, logits, eps, parts):
        h = _rms_norm(x, norm, eps)
        out = lm_head.shape[1]
        for p in prange(parts):
            _gemv_cols(h, lm_head, logits, out * p // parts, out * (p + 1) // parts)
