"""float32 weight products on column panels: a C++ kernel (``csrc/panel_linear.cpp``, built by
``models.native`` with AVX-512 or AVX2 + FMA).

A weight ``[out, in]`` is packed once into ``[out / 16, in, 16]``: panel ``p`` holds output
columns ``16p .. 16p + 15`` as ``in`` rows of 16 floats, so a row of ``x`` times a panel is 16
fused-multiply-add chains over ``in``, each in the order ``k = 0, 1, ...``. A row's result is
therefore the same alone or among any others and at any thread count, and a decode step's few
rows read each weight once (oneDNN's float32 kernels for few rows run at about two thirds of
the speed on the same cores; ``benchmarks/decode_kernels.py --products``).
"""

from __future__ import annotations

import torch

from splitserve.models import native

COLUMNS = 16  # a panel's width: one 16-float vector of the kernel


def available() -> bool:
    """Whether the kernel is built and loaded."""
    return native.load("panel_linear") is None


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` ``[out, in]`` (float32, CPU) as 64-byte aligned panels ``[out / 16, in, 16]``,
    or ``None`` where the kernel does not take it (another dtype or device, ``out`` not a
    multiple of 16, or the kernel not built)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    out, width = weight.shape
    if out % COLUMNS or not available():
        return None
    size = out * width
    # torch aligns large buffers to 64 bytes; cut an aligned window from one 16 floats longer
    # so the kernel's aligned loads hold wherever the allocator puts it.
    buffer = torch.empty(size + COLUMNS, dtype=torch.float32)
    skip = (-(buffer.data_ptr() // 4)) % COLUMNS
    panels = buffer[skip : skip + size].view(out // COLUMNS, width, COLUMNS)
    panels.copy_(weight.reshape(out // COLUMNS, COLUMNS, width).transpose(1, 2))
    return panels


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for ``x`` ``[rows, in]`` float32 and ``pack(W)``, on torch's
    intra-op threads."""
    return torch.ops.splitserve.panel_linear(
        x.contiguous(), panels, bias, panels.shape[0] * COLUMNS
    )
