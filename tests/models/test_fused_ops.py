"""The fused elementwise ops (``csrc/fused_ops.cpp``) against the torch ops they replace, and
their rows' independence of the batch and the thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.models import fused_ops, native
from splitserve.models.attention import write_kv
from splitserve.models.llama import apply_rope

pytestmark = pytest.mark.skipif(
    native.load("fused_ops") is not None, reason=str(native.load("fused_ops"))
)


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("hidden", [576, 40])  # 40: a last vector of 8 columns
def test_rms_norm_matches_torch(hidden):
    x, w = rand(7, hidden, seed=1), rand(hidden, seed=2)
    got = fused_ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (hidden,), w, 1e-5), rtol=1e-5, atol=1e-6)


def test_add_rms_norm_adds_in_place_and_normalises_the_sum():
    x, d, w = rand(5, 576, seed=3), rand(5, 576, seed=4), rand(576, seed=5)
    expected_sum = x + d
    y = fused_ops.add_rms_norm_(x, d, w, 1e-6)
    assert torch.equal(x, expected_sum)
    torch.testing.assert_close(y, F.rms_norm(expected_sum, (576,), w, 1e-6), rtol=1e-5, atol=1e-6)


def test_a_row_gets_its_norm_alone_in_any_batch_at_any_thread_count():
    x, w = rand(200, 576, seed=6), rand(576, seed=7)
    alone = torch.cat([fused_ops.rms_norm(x[i : i + 1], w, 1e-5) for i in range(200)])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(fused_ops.rms_norm(x, w, 1e-5), alone), threads
    finally:
        torch.set_num_threads(before)


def test_rope_and_kv_write_match_apply_rope_and_write_kv():
    heads, kv_heads, hd, tokens, blocks, block = 9, 3, 64, 6, 4, 4
    qkv = rand(tokens, (heads + 2 * kv_heads) * hd, seed=8)
    angles = rand(tokens, 1, hd, seed=9)
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([13, 2, 7, 0, 15, 8])
    caches = [torch.zeros(blocks, block, kv_heads, hd) for _ in range(4)]

    # The torch path.
    qk = qkv[:, : (heads + kv_heads) * hd].view(tokens, heads + kv_heads, hd)
    roped = apply_rope(qk, cos, sin)
    v = qkv[:, (heads + kv_heads) * hd :].view(tokens, kv_heads, hd)
    write_kv(caches[0], caches[1], roped[:, heads:], v, slots)

    fused = qkv.clone()
    fused_ops.rope_write_kv_(fused, cos, sin, caches[2], caches[3], slots, heads, kv_heads)
    q = fused[:, : heads * hd].view(tokens, heads, hd)
    torch.testing.assert_close(q, roped[:, :heads], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(caches[2], caches[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(caches[3], caches[1])  # v is copied as it is
    assert torch.equal(fused[:, (heads + kv_heads) * hd :], qkv[:, (heads + kv_heads) * hd :])


@pytest.mark.parametrize("width", [1536, 40])  # 40: a last vector of 8 columns
def test_silu_mul_matches_torch_over_the_whole_range(width):
    gate_up = rand(9, 2 * width, seed=10) * 12  # SiLU's tails on both sides, and near zero
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 100.0, -100.0])
    gate, up = gate_up.split(width, dim=-1)
    expected = F.silu(gate) * up
    got = fused_ops.silu_mul(gate_up)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-7)
    alone = torch.cat([fused_ops.silu_mul(gate_up[i : i + 1]) for i in range(9)])
    assert torch.equal(got, alone)


@pytest.mark.parametrize("width", [49152, 1025, 17, 1])  # a vocabulary, chunk and lane tails
def test_argmax_gives_torchs_index_ties_nans_and_infinities_included(width):
    x = rand(8, width, seed=11)
    ints = torch.randint(-2, 3, (8, width), generator=torch.Generator().manual_seed(12)).float()
    assert torch.equal(fused_ops.argmax(x), x.argmax(-1))
    assert torch.equal(fused_ops.argmax(ints), ints.argmax(-1))  # many equal maxima
    if width < 17:
        return
    odd = -torch.ones(9, width)
    odd[0, [3, width - 1]] = 2.0  # equal maxima: the first
    odd[1, [5, width - 2]] = torch.tensor([-0.0, 0.0])  # equal zeros of both signs
    odd[2, [1, width - 1]] = torch.tensor([5.0, float("nan")])  # a NaN beats any number
    odd[3] = float("-inf")
    odd[4, [7, 8]] = float("inf")
    odd[5, [width - 2, 6]] = float("nan")  # the first NaN
    odd[6] = float("nan")
    odd[7, 0] = float("-inf")
    odd[8, width - 1] = 1.0  # in the tail past the last full vector
    assert torch.equal(fused_ops.argmax(odd), odd.argmax(-1))


def bits(x: torch.Tensor) -> torch.Tensor:
    """The bfloat16 bits, every NaN as one (torch's own conversion keeps a NaN's sign)."""
    return torch.where(x.isnan(), torch.nan, x).view(torch.int16)


@pytest.mark.parametrize("hidden", [576, 40])
def test_bfloat16_ops_are_the_float32_ops_on_widened_inputs_rounded_once(hidden):
    """Each bfloat16 output is the float32 op's on the same values, rounded to nearest even:
    the norm, the residual add (x rounded, then normalised), SiLU * up, RoPE and the K/V
    writes; NaN, infinities and values that round up to infinity included."""
    x, d, w = (rand(7, hidden, seed=s).mul(4).bfloat16() for s in (20, 21, 22))
    w = w[0]
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -3.39e38, 3.39e38])
    assert torch.equal(
        bits(fused_ops.rms_norm(x, w, 1e-5)),
        bits(fused_ops.rms_norm(x.float(), w.float(), 1e-5).bfloat16()),
    )
    x32 = x.float()
    y32 = fused_ops.add_rms_norm_(x32, d.float(), w.float(), 1e-5)
    y = fused_ops.add_rms_norm_(x, d, w, 1e-5)
    assert torch.equal(bits(x), bits(x32.bfloat16()))
    assert torch.equal(bits(y), bits(fused_ops.rms_norm(x.float(), w.float(), 1e-5).bfloat16()))
    assert y32.shape == y.shape
    gate_up = rand(9, 2 * hidden, seed=23).mul(12).bfloat16()
    assert torch.equal(
        bits(fused_ops.silu_mul(gate_up)), bits(fused_ops.silu_mul(gate_up.float()).bfloat16())
    )

    heads, kv_heads, hd, tokens = 9, 3, 64, 6
    qkv = rand(tokens, (heads + 2 * kv_heads) * hd, seed=24).bfloat16()
    angles = rand(tokens, 1, hd, seed=25)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    slots = torch.tensor([13, 2, 7, 0, 15, 8])
    caches = [
        torch.zeros(4, 4, kv_heads, hd, dtype=dt)
        for dt in (torch.bfloat16,) * 2 + (torch.float32,) * 2
    ]
    wide = qkv.float()
    fused_ops.rope_write_kv_(qkv, cos, sin, caches[0], caches[1], slots, heads, kv_heads)
    fused_ops.rope_write_kv_(
        wide, cos.float(), sin.float(), caches[2], caches[3], slots, heads, kv_heads
    )
    assert torch.equal(bits(qkv), bits(wide.bfloat16()))
    assert torch.equal(bits(caches[0]), bits(caches[2].bfloat16()))
    assert torch.equal(bits(caches[1]), bits(caches[3].bfloat16()))


def test_bfloat16_ops_are_within_rounding_of_torchs_and_a_row_alone_is_the_row_batched():
    x, w = rand(64, 576, seed=26).bfloat16(), rand(576, seed=27).bfloat16()
    gate_up = rand(64, 2 * 1536, seed=28).mul(4).bfloat16()
    gate, up = gate_up.split(1536, dim=-1)
    cases = [
        (fused_ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5)),
        (fused_ops.silu_mul(gate_up), F.silu(gate) * up),
    ]
    for got, theirs in cases:
        torch.testing.assert_close(got, theirs, rtol=2**-7, atol=2**-7)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for op, arg in (
                (lambda t: fused_ops.rms_norm(t, w, 1e-5), x),
                (fused_ops.silu_mul, gate_up),
            ):
                alone = torch.cat([op(arg[i : i + 1]) for i in range(64)])
                assert torch.equal(bits(op(arg)), bits(alone)), threads
    finally:
        torch.set_num_threads(before)


def test_bad_input_is_refused():
    w = torch.ones(8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        fused_ops.rms_norm(torch.ones(2, 8).double(), w.double(), 1e-5)
    with pytest.raises(RuntimeError, match="every tensor in BFloat16"):
        fused_ops.rms_norm(torch.ones(2, 8).bfloat16(), w, 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        fused_ops.rms_norm(torch.ones(2, 8), torch.ones(9), 1e-5)
    cache = torch.zeros(2, 4, 1, 32)
    qkv = torch.zeros(3, 3 * 32)
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused_ops.rope_write_kv_(
            qkv, torch.ones(3, 1, 32), torch.ones(3, 1, 32), cache, cache.clone(),
            torch.tensor([0, 1, 8]), 1, 1,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="gate_up"):
        fused_ops.silu_mul(torch.ones(2, 7))
    with pytest.raises(RuntimeError, match="n >= 1"):
        torch.ops.splitserve.argmax_rows(torch.ones(2, 0))
