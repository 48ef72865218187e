"""Attention over a paged KV cache for a flat batch of tokens from many sequences.

The flat batch is laid out decodes first, then prefill chunks::

    tokens:  [ d0 d1 ... dD-1 | p0 p0 p0 ... | p1 p1 ... | ... ]
              one token each    chunk of seq p0 (positions start_pos .. context_len-1)

KV cache of one layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``; the token at
position ``pos`` of a sequence lives in slot ``block_table[pos // B] * B + pos % B`` of the
cache viewed as ``[num_blocks * B, kvh, hd]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk: flat-batch rows ``[offset, offset + num_tokens)`` at positions
    ``start_pos ..``. ``block_table`` covers ``[0, context_len)``: the torch path needs it only
    when ``start_pos > 0`` (a chunk starting at 0 attends to its own k/v alone), the C++
    kernel always."""

    offset: int
    num_tokens: int
    start_pos: int
    block_table: torch.Tensor | None = None
    causal_mask: torch.Tensor | None = None  # [num_tokens, context_len], True = attend

    @property
    def context_len(self) -> int:
        return self.start_pos + self.num_tokens


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows ``[offset, offset + num_seqs)`` of the flat batch, attended together.

    ``block_tables`` is ``[num_seqs, max_blocks]`` (padded with any valid block id) and
    ``mask`` ``[num_seqs, 1, 1, max_blocks * B]`` is True for positions ``< context_len``.
    """

    offset: int
    block_tables: torch.Tensor
    mask: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]


@dataclass(slots=True)
class AttentionContext:
    """Per-step attention metadata, built once by the model runner and shared by all layers.

    The decodes come in small groups, each padded to its own longest context, so that a
    group's gathered keys and values stay in cache until its SDPA reads them (see
    ``_decode_attention``).
    """

    slot_mapping: torch.Tensor  # [T] long
    num_decodes: int = 0
    decode_groups: tuple[DecodeGroup, ...] = ()
    prefills: tuple[PrefillSpan, ...] = ()
    # Set instead of decode_groups: every decode row goes to the in-place kernel
    # (models.paged_decode), with these int64 block tables [num_decodes, w] and lengths.
    decode_tables: np.ndarray | None = None
    decode_lens: np.ndarray | None = None
    decode_threads: int = 1


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's k/v ``[T, kvh, hd]`` into their slots: one indexed copy per cache."""
    kvh, hd = k.shape[1], k.shape[2]
    k_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx: AttentionContext,
    scale: float,
) -> torch.Tensor:
    """Attention for every token of the flat batch. ``q`` is ``[T, h, hd]``, ``k``/``v`` the
    step's own ``[T, kvh, hd]`` (already written to the cache). Returns ``[T, h, hd]``."""
    parts = []
    if ctx.decode_tables is not None:
        from splitserve.models import paged_decode  # numba: imported once a runner asks

        parts.append(
            paged_decode.decode_attention(
                q[: ctx.num_decodes],
                k_cache,
                v_cache,
                ctx.decode_tables,
                ctx.decode_lens,
                scale,
                ctx.decode_threads,
            )
        )
    for group in ctx.decode_groups:
        rows = slice(group.offset, group.offset + group.num_seqs)
        parts.append(_decode_attention(q[rows], k_cache, v_cache, group, scale))
    for span in ctx.prefills:
        rows = slice(span.offset, span.offset + span.num_tokens)
        parts.append(_prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, span, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
) -> torch.Tensor:
    """One new token per sequence, batched: gather each sequence's pages into a padded
    ``[n, kvh, S, hd]`` and mask positions past its context length.

    The ``g = h / kvh`` query heads that share a kv head go in as ``g`` query rows of that kv
    head (``[n, kvh, g, hd]``): with one token per sequence and a mask that depends only on
    the key position, that is the same attention, and SDPA then runs without expanding the
    keys and values ``g`` times for GQA."""
    tables = group.block_tables
    n, kvh, hd = tables.shape[0], k_cache.shape[2], k_cache.shape[3]
    keys = _gather(k_cache, tables.view(-1)).view(n, -1, kvh, hd).transpose(1, 2)
    values = _gather(v_cache, tables.view(-1)).view(n, -1, kvh, hd).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.view(n, kvh, -1, hd), keys, values, attn_mask=group.mask, scale=scale
    )
    return out.view(n, -1, hd)


# The longest context a float32 prefill chunk attends through the C++ kernel (SDPA beyond).
FLOAT32_NATIVE_PREFILL_CONTEXT = 1024


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: PrefillSpan,
    scale: float,
) -> torch.Tensor:
    dtype = q.dtype
    # bfloat16 on CPU: SDPA's bfloat16 kernels block a query's sums by the span's length (its
    # products, on AMX, by the row count), so the same token would attend differently in a
    # chunk after a cache hit than in a whole prompt. The C++ kernel gives each query the
    # bits a decode row at its position gets; without it, float32 through one masked kernel
    # for every span, whose result for a query depends on the span for a few query counts.
    # In float32 the kernel beats SDPA's blocked products on short contexts only (a 256-token
    # prompt's attention 1.5x; 2,048 tokens of context 0.9x).
    on_cpu = q.device.type == "cpu"
    invariant = dtype == torch.bfloat16 and on_cpu
    native = invariant or (
        on_cpu and dtype == torch.float32 and span.context_len <= FLOAT32_NATIVE_PREFILL_CONTEXT
    )
    if native and span.block_table is not None:
        from splitserve.models import paged_decode  # imported once a runner asks

        if paged_decode.native_fits(q.shape[1], k_cache):
            return paged_decode.prefill_attention(
                q, k_cache, v_cache, span.block_table, span.start_pos, scale
            )
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, h, n, hd]
    if span.start_pos == 0:
        keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        if not invariant:
            out = F.scaled_dot_product_attention(
                qh, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
            return out.squeeze(0).transpose(0, 1)
    else:
        # Earlier positions are in the cache (and so is this chunk, just written). SDPA's
        # is_causal aligns the triangle top-left, which is wrong when queries start at
        # start_pos, so the mask is explicit.
        n_ctx = span.context_len
        keys = _gather(k_cache, span.block_table)[:n_ctx].transpose(0, 1).unsqueeze(0)
        values = _gather(v_cache, span.block_table)[:n_ctx].transpose(0, 1).unsqueeze(0)
    if invariant:
        qh, keys, values = qh.float(), keys.float(), values.float()
    out = F.scaled_dot_product_attention(
        qh, keys, values, attn_mask=span.causal_mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(0).transpose(0, 1).to(dtype)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The blocks' tokens, in order, as ``[len(block_ids) * B, kvh, hd]``. index_select, not
    ``cache[ids]``: on CPU it is several times faster for this row-gather."""
    return cache.index_select(0, block_ids).view(-1, *cache.shape[2:])


def offset_causal_mask(start_pos: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    """``[num_tokens, start_pos + num_tokens]`` bool: query i (at position start_pos + i)
    sees keys at positions ``<= start_pos + i``."""
    keys = torch.arange(start_pos + num_tokens, device=device)
    queries = torch.arange(start_pos, start_pos + num_tokens, device=device)
    return keys.unsqueeze(0) <= queries.unsqueeze(1)
