"""The bfloat16 AMX tile product (``csrc/amx_linear.cpp``) against a float32 product, and its
rows' independence of the batch and the thread count."""

from __future__ import annotations

import pytest
import torch

from splitserve.models import amx_linear, native
from splitserve.models.llama import packed_linear, packed_weight

pytestmark = pytest.mark.skipif(
    not amx_linear.available(), reason=str(native.load("amx_linear") or "no AMX tile state")
)


def weights(out: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, width, generator=g) * 0.05
    return w.to(torch.bfloat16), torch.randn(out, generator=g).to(torch.bfloat16)


def rows(count: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(count, width, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (48, 64)])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
def test_matches_a_float32_product_rounded_once(shape, bias_dtype):
    """A float32 sum of the exact products, + bias, rounded to bfloat16: within the final
    rounding (half a unit in the last place, one here) and float32's error on the sum of the
    terms' sizes (it dominates where the terms cancel)."""
    out, width = shape
    w, b = weights(out, width, seed=1)
    bias = None if bias_dtype is None else b.to(bias_dtype)
    tiles = amx_linear.pack(w)
    assert tiles is not None and tiles.shape == (out // 16, width // 32, 16, 32)
    for count in (1, 5, 16, 17, 33, 131):
        x = rows(count, width, seed=count)
        got = amx_linear.linear(x, tiles, bias)
        assert got.shape == (count, out) and got.dtype == torch.bfloat16
        exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
        ulp = exact.abs().float().bfloat16().double() * 2**-7
        sizes = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.abs())
        assert ((got.double() - exact).abs() <= ulp + sizes * 2**-20).all(), count


@pytest.mark.parametrize("out", [576, 720])  # 720: an odd count of 16-column panels
def test_every_row_gets_its_result_alone_at_any_row_count_and_thread_count(out):
    w, b = weights(out, 576, seed=2)
    packed = packed_weight(w)
    assert packed is not None and packed.dim() == 4  # the tiles, not oneDNN's layout
    x = rows(100, 576, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([packed_linear(x[i : i + 1], packed, b) for i in range(x.shape[0])])
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for start, count in ((0, 2), (0, 16), (3, 17), (5, 32), (10, 90), (0, 100)):
                got = packed_linear(x[start : start + count], packed, b)
                assert torch.equal(got, alone[start : start + count]), (threads, start, count)
    finally:
        torch.set_num_threads(before)


def test_shapes_the_tiles_do_not_take_are_left_to_onednn():
    assert amx_linear.pack(torch.randn(64, 64)) is None  # float32: the panels' dtype
    assert amx_linear.pack(torch.randn(40, 64).bfloat16()) is None  # 40 outputs: not 16s
    assert amx_linear.pack(torch.randn(64, 48).bfloat16()) is None  # 48 inputs: not 32s
    assert packed_weight(torch.randn(64, 48).bfloat16()).dim() == 2  # oneDNN's layout


def test_bad_operands_raise_a_clear_error():
    tiles = amx_linear.pack(weights(64, 64, seed=4)[0])
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        amx_linear.linear(torch.randn(2, 64), tiles)  # float32 rows
    with pytest.raises(RuntimeError, match="for x's in"):
        amx_linear.linear(rows(2, 96, seed=5), tiles)
    with pytest.raises(RuntimeError, match="bias"):
        amx_linear.linear(rows(2, 64, seed=5), tiles, torch.zeros(63))


@pytest.mark.parametrize(("inter", "width"), [(1536, 576), (16, 64), (48, 96)])
def test_silu_linear_gives_silu_mul_of_the_product_bit_for_bit(inter, width):
    """gate and up in one product, silu(gate) * up in its epilogue: the bits of
    ``fused_ops.silu_mul`` over the plain product, at any row count and thread count (the
    decode step's bfloat16 MLP runs the same product)."""
    from splitserve.models import fused_ops

    w, _ = weights(2 * inter, width, seed=4)
    tiles = amx_linear.pack(w)
    assert fused_ops.fits(w), native.load("fused_ops")
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for count in (1, 7, 16, 33, 70):
                x = rows(count, width, seed=count + 40) * 4  # silu's negative side too
                got = amx_linear.silu_linear(x, tiles)
                assert got.shape == (count, inter)
                assert torch.equal(got, fused_ops.silu_mul(amx_linear.linear(x, tiles))), count
    finally:
        torch.set_num_threads(before)


def test_linear_add_gives_the_bits_of_adding_the_product():
    """``out += x W^T`` in the product's epilogue: the product rounded to bfloat16, then added as
    torch adds two bfloat16 tensors (the residual add after an MLP), at any row count."""
    w, _ = weights(576, 1536, seed=5)
    tiles = amx_linear.pack(w)
    for count in (1, 16, 33, 70):
        x, base = rows(count, 1536, seed=count + 60), rows(count, 576, seed=count + 80) * 8
        expected = base + amx_linear.linear(x, tiles)
        out = base.clone()
        assert amx_linear.linear_add_(out, x, tiles) is out
        assert torch.equal(out, expected), count
