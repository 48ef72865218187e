"""bfloat16 weight products on AMX tiles: a C++ kernel (``csrc/amx_linear.cpp``, built by
``models.native`` where the CPU has AMX-TILE and AMX-BF16).

A weight ``[out, in]`` is packed once into tiles ``[out / 16, in / 32, 16, 32]``: tile
``(p, c)`` holds output columns ``16p .. 16p + 15`` times input features ``32c .. 32c + 31``
in the pair-interleaved layout the tile instruction reads. Each output element is one float32
sum over the feature chunks in order, plus the bias, rounded once to bfloat16. A row's result
is therefore the same alone or among any others, at any row count and thread count, so
prefill needs no fixed-size row pieces (oneDNN's bfloat16 products change a row's sum order
above 32 rows; ``llama.BATCH_INVARIANT_ROWS``).
"""

from __future__ import annotations

import functools

import torch

from splitserve.models import native

COLUMNS = 16  # a tile's output columns
DEPTH = 32  # a tile's input features


@functools.cache
def available() -> bool:
    """Whether the kernel is built and loaded, and the OS lets this process use AMX tiles."""
    return native.load("amx_linear") is None and bool(torch.ops.splitserve.amx_ready())


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` ``[out, in]`` (bfloat16, CPU) as tiles ``[out / 16, in / 32, 16, 32]``, or
    ``None`` where the kernel does not take it (another dtype or device, ``out`` not a multiple
    of 16 or ``in`` of 32, or no AMX)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    out, width = weight.shape
    if out % COLUMNS or width % DEPTH or not available():
        return None
    panels, chunks = out // COLUMNS, width // DEPTH
    pairs = weight.reshape(panels, COLUMNS, chunks, DEPTH // 2, 2)  # [p, column, c, pair, 2]
    return pairs.permute(0, 2, 3, 1, 4).reshape(panels, chunks, DEPTH // 2, 2 * COLUMNS)


def linear(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for ``x`` ``[rows, in]`` bfloat16 and ``pack(W)``, on torch's
    intra-op threads."""
    return torch.ops.splitserve.amx_linear(x.contiguous(), tiles, bias)


def silu_linear(x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """``silu(x @ gate^T) * (x @ up^T)`` for ``tiles = pack(gate_up)`` (gate's rows, then up's,
    each half a multiple of 16 rows): ``silu_mul`` of ``linear(x, tiles)`` in one product, with
    the same bits."""
    return torch.ops.splitserve.amx_silu_linear(x.contiguous(), tiles)


def linear_add_(out: torch.Tensor, x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """``out += x @ W^T`` in place for ``tiles = pack(W)`` and ``out`` contiguous bfloat16: the
    bits of ``out + linear(x, tiles)``, without the product's own tensor."""
    return torch.ops.splitserve.amx_linear_add_(out, x.contiguous(), tiles)
