"""A decoder layer's elementwise steps as single passes over the rows, float32 or bfloat16 on
CPU: a C++ kernel (``csrc/fused_ops.cpp``, built by ``models.native``) where it is built,
torch's ops elsewhere (``fits`` says which). A bfloat16 row is computed in float32 and each
output rounded once: the float32 op's result on the widened inputs, rounded (tested).

The torch path runs RMSNorm as about six ops, the residual add, RoPE and the two K/V writes as
five more, each a pass over the step's rows with its own dispatch; a decode step's few rows
spend more on those passes than on the arithmetic. Each fused op gives a row the same result
alone or batched, at any thread count.
"""

from __future__ import annotations

import torch

from splitserve.models import native

FUSED_DTYPES = (torch.float32, torch.bfloat16)


def fits(x: torch.Tensor) -> bool:
    """Whether the fused ops take ``x`` (float32 or bfloat16 on CPU, the kernel built)."""
    return x.dtype in FUSED_DTYPES and x.device.type == "cpu" and native.load("fused_ops") is None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x / sqrt(mean(x^2) + eps)) * weight`` per row of ``x`` ``[rows, hidden]``."""
    return torch.ops.splitserve.rms_norm(x.contiguous(), weight, eps)


def add_rms_norm_(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x += delta`` in place (``x`` contiguous), then ``rms_norm(x)``: a residual add and
    the next norm in one pass."""
    return torch.ops.splitserve.add_rms_norm_(x, delta.contiguous(), weight, eps)


def rope_fits(qkv: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``rope_write_kv_`` takes this layer (caches in ``qkv``'s dtype, head_dim a
    multiple of 32)."""
    return fits(qkv) and k_cache.dtype == qkv.dtype and k_cache.shape[-1] % 32 == 0


def rope_write_kv_(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> None:
    """RoPE on the q and k heads of ``qkv`` ``[T, (heads + 2 kv_heads) * head_dim]`` in place
    (``cos`` and the signed ``sin`` of ``llama.Rotary``), then each row's k and v into its slot
    of the paged caches: ``apply_rope`` and ``attention.write_kv`` in one pass."""
    torch.ops.splitserve.rope_write_kv_(
        qkv, cos.contiguous(), sin.contiguous(), k_cache, v_cache, slots, heads, kv_heads
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[rows, 2 n]`` (the gate's ``n`` columns first):
    the MLP's activation in one pass, ``[rows, n]``."""
    return torch.ops.splitserve.silu_mul(gate_up.contiguous())


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of a ``[rows, n]`` tensor, the same indices (the first of equal
    values, a NaN counting as the largest), in one vector pass per row where the kernel takes
    ``x``: torch's CPU argmax reads a vocabulary-wide row about 7x slower."""
    if x.dim() == 2 and x.shape[1] > 0 and x.dtype == torch.float32 and fits(x):
        return torch.ops.splitserve.argmax_rows(x.contiguous())
    return x.argmax(dim=-1)
