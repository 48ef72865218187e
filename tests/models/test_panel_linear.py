"""The float32 panel product (``csrc/panel_linear.cpp``) against ``F.linear``, and its rows'
independence of the batch and the thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.models import native, panel_linear
from splitserve.models.llama import packed_linear, packed_weight

pytestmark = pytest.mark.skipif(
    native.load("panel_linear") is not None, reason=str(native.load("panel_linear"))
)


def weights(out: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, width, generator=g) * 0.05, torch.randn(out, generator=g)


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (48, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(shape, with_bias):
    out, width = shape
    w, b = weights(out, width, seed=1)
    bias = b if with_bias else None
    panels = panel_linear.pack(w)
    assert panels is not None and panels.shape == (out // 16, width, 16)
    assert panels.data_ptr() % 64 == 0
    for rows in (1, 5, 6, 7, 64, 131):
        x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
        got = panel_linear.linear(x, panels, bias)
        assert got.shape == (rows, out)
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out", [576, 720])  # 720: an odd count of panels, one left unpaired
def test_every_row_gets_its_result_alone_at_any_row_count_and_thread_count(out):
    """One fused-multiply-add chain per element, in the order of the input features: the
    same bits alone, in any batch (one panel a pass or two) and at any thread count."""
    w, b = weights(out, 576, seed=2)
    packed = packed_weight(w)
    assert packed is not None and packed.dim() == 3  # the panels, not oneDNN's layout
    x = torch.randn(100, 576, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([packed_linear(x[i : i + 1], packed, b) for i in range(x.shape[0])])
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for start, rows in ((0, 2), (0, 16), (3, 17), (10, 90), (0, 100)):
                got = packed_linear(x[start : start + rows], packed, b)
                assert torch.equal(got, alone[start : start + rows]), (threads, start, rows)
    finally:
        torch.set_num_threads(before)


def test_columns_past_a_multiple_of_16_are_cut_from_the_last_panel():
    """The kernel takes any output width (``pack`` asks for multiples of 16, as every model
    here has): the last panel's padding is computed and not written."""
    out, width = 37, 24
    w, b = weights(out, width, seed=4)
    padded = torch.zeros(48, width)
    padded[:out] = w
    panels = panel_linear.pack(padded)
    x = torch.randn(9, width, generator=torch.Generator().manual_seed(5))
    got = torch.ops.splitserve.panel_linear(x, panels, b, out)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_what_it_does_not_take():
    assert panel_linear.pack(torch.randn(40, 8)) is None  # 40 columns: not whole panels
    assert panel_linear.pack(torch.randn(32, 8).to(torch.bfloat16)) is None
    panels = panel_linear.pack(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="x: contiguous float32"):
        torch.ops.splitserve.panel_linear(torch.randn(3, 8).double(), panels, None, 32)
    with pytest.raises(RuntimeError, match="panels"):
        torch.ops.splitserve.panel_linear(torch.randn(3, 9), panels, None, 32)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.splitserve.panel_linear(torch.randn(3, 8), panels, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.splitserve.panel_linear(torch.randn(3, 8), panels, torch.randn(31), 32)
