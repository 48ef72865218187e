"""The cost model against rooflines worked out by hand from the datasheets and configs."""

from __future__ import annotations

import math

import pytest

from splitserve.sim.cost_model import CostModel, StepShape
from splitserve.sim.hardware import get_hardware
from splitserve.sim.models import get_model

H100_BF16 = 989e12 * 0.6  # FLOP/s at the profile's compute efficiency
H100_BW = 3350e9 * 0.8  # bytes/s at its memory efficiency


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [
        ("llama3-8b", 8.03e9, 8.03e9),
        ("llama3-70b", 70.6e9, 70.6e9),
        ("qwen3-235b-a22b", 235e9, 22e9),
        ("smollm2-135m", 134.5e6, 134.5e6),
    ],
)
def test_parameter_counts_match_the_published_totals(name, total, active):
    m = get_model(name)
    assert m.total_params == pytest.approx(total, rel=0.01)
    assert m.active_params == pytest.approx(active, rel=0.02)


def test_llama3_8b_decode_step_is_memory_bound_at_batch_one():
    # Per layer: attention 2*4096*4096 + 2*4096*1024 = 41,943,040; MLP 3*4096*14336 =
    # 176,160,768; 32 layers -> 6,979,321,856 parameters without embeddings.
    # FLOPs: 2 * 6,979,321,856 + LM head 2 * 128256 * 4096 + attention 4 * 32 * 32 * 128 * 1000
    #      = 15,533,604,864 -> 26.18 us at 593.4 TFLOP/s.
    # Bytes: (6,979,321,856 + 525,336,576 LM head) * 2 = 15,009,316,864 of weights plus the
    # KV of 1001 tokens * 131,072 B = 131,203,072 -> 5.6494 ms at 2.68 TB/s; + 2 ms overhead.
    cost = CostModel(get_model("llama3-8b"), get_hardware("h100"))
    shape = StepShape(tokens=1, sampled=1, attended=1000, kv_read=1000, chunks=1)
    assert cost.compute_time(shape) == pytest.approx(15_533_604_864 / H100_BF16, rel=1e-12)
    assert cost.memory_time(shape) == pytest.approx(15_140_519_936 / H100_BW, rel=1e-12)
    assert cost.step_time(shape) == pytest.approx(15_140_519_936 / H100_BW + 2e-3, rel=1e-12)
    assert cost.step_time(shape) == pytest.approx(7.6494e-3, rel=1e-4)


def test_llama3_8b_prefill_is_compute_bound():
    # 2048 tokens from position 0: 2 * 6,979,321,856 * 2048 + 1,050,673,152 (one LM head)
    # + 4 * 32 * 32 * 128 * (2048 * 2049 / 2) = 28,587,302,322,176 + 1,050,673,152
    # + 1,100,048,498,688 = 29,688,401,494,016 FLOPs -> 50.03 ms at 593.4 TFLOP/s.
    cost = CostModel(get_model("llama3-8b"), get_hardware("h100"))
    shape = StepShape(tokens=2048, sampled=1, attended=2048 * 2049 / 2, kv_read=2048, chunks=1)
    flops = 29_688_401_494_016
    assert cost.compute_time(shape) == pytest.approx(flops / H100_BF16, rel=1e-12)
    assert cost.compute_time(shape) > cost.memory_time(shape)
    assert cost.step_time(shape) == pytest.approx(flops / H100_BF16 + 2e-3, rel=1e-12)


def test_qwen3_moe_at_tp4_fp8_reads_only_the_picked_experts():
    # One token picks 8 of 128 experts per layer. Per GPU (TP4, 1 byte per weight):
    # dense = 94 * (71,303,168 attention + 4096*128 router) + 151936*4096 LM head
    #       = 94 * 71,827,456 + 622,329,856 = 7,374,110,720 bytes / 4
    # experts = 94 * 8 * 3*4096*1536 = 14,193,524,736 bytes / 4; two all-reduces per layer.
    hw = get_hardware("mi300x")
    cost = CostModel(get_model("qwen3-235b-a22b"), hw, tp=4, dtype="fp8")
    weights = (7_374_110_720 + 14_193_524_736) / 4
    assert cost.weight_time(1) == pytest.approx(weights / (5300e9 * 0.8), rel=1e-12)
    assert cost.experts_touched(1) == pytest.approx(8)
    assert cost.experts_touched(10_000) == pytest.approx(128)
    # KV: 4 KV heads over 4 GPUs, one each: 94 layers * 2 * 128 * 1 byte per token per GPU.
    assert cost.kv_bytes_per_token_gpu == 94 * 2 * 128
    comm = 2 * 94 * (8e-6 + 2 * 3 / 4 * 4096 * 2 / 448e9)
    assert cost.fixed_time(1, 1) == pytest.approx(2e-3 + comm, rel=1e-12)


def test_kv_pool_and_transfer_time():
    # H100, llama3-8b bf16: 80 GB * 0.9 - 16,060,522,496 B of weights, 131,072 B per token.
    cost = CostModel(get_model("llama3-8b"), get_hardware("h100"))
    weights = get_model("llama3-8b").total_params * 2
    assert cost.kv_pool_tokens() == int((72e9 - weights) // 131_072)
    # 1000 tokens over the node's link (450 GB/s, 10 us) or the network (50 GB/s, 50 us).
    assert cost.transfer_time(1000, same_node=True) == pytest.approx(10e-6 + 131_072_000 / 450e9)
    assert cost.transfer_time(1000, same_node=False) == pytest.approx(50e-6 + 131_072_000 / 50e9)
    with pytest.raises(ValueError, match="does not fit"):
        CostModel(get_model("llama3-70b"), get_hardware("h100")).kv_pool_tokens()


@pytest.mark.parametrize("batch,context", [(1, 10), (64, 64 * 3000), (256, 256 * 500)])
def test_decode_line_sums_match_step_by_step(batch, context):
    cost = CostModel(get_model("llama3-8b"), get_hardware("h100"))
    line = cost.decode_line(batch, context)
    total = 0.0
    for k in range(400):
        shape = StepShape(batch, batch, context + k * batch, context + k * batch, batch)
        step = cost.step_time(shape)
        assert line.step(k) == pytest.approx(step, rel=1e-12)
        total += step
        assert line.total(k + 1) == pytest.approx(total, rel=1e-9)
    assert line.steps_within(line.total(123), 400) == 123
    assert line.steps_within(line.total(123) - 1e-9, 400) == 122
    assert math.isclose(line.total(0), 0.0)


def test_decode_line_across_the_compute_memory_crossover():
    # Large batches on a long context start memory-bound and stay so; a line with a compute
    # term that grows faster crosses over: total() must follow max() on both sides.
    from splitserve.sim.cost_model import DecodeLine

    line = DecodeLine(c0=1.0, c1=0.5, m0=5.0, m1=0.1, fixed=0.25)
    expected = sum(max(1.0 + 0.5 * k, 5.0 + 0.1 * k) + 0.25 for k in range(30))
    assert line.total(30) == pytest.approx(expected, rel=1e-12)


def test_the_multi_row_overhead_costs_steps_of_more_than_one_token():
    # cpu-local: a 1-token decode step runs its weight products as GEMV, any larger step as
    # a GEMM that packs the weights (here without the fused path, below). The GPU profiles
    # carry no such term.
    model = get_model("smollm2-135m")
    plain = get_hardware("cpu-local").with_fit(multi_row_overhead_s=0.0, fused_decode_max_seqs=0)
    cost = CostModel(model, plain.with_fit(multi_row_overhead_s=0.05), 1, "fp32")
    without = CostModel(model, plain, 1, "fp32")
    for batch in (1, 4):
        step = StepShape(batch, batch, batch * 129, batch * 129, batch)
        extra = 0.05 if batch > 1 else 0.0
        assert cost.step_time(step) == pytest.approx(without.step_time(step) + extra, rel=1e-12)
        assert cost.decode_line(batch, batch * 129).step(0) == pytest.approx(
            cost.step_time(step), rel=1e-12
        )
    prefill = StepShape(32, 1, 32 * 33 / 2, 32, 1)
    assert cost.step_time(prefill) == pytest.approx(without.step_time(prefill) + 0.05)
    gpus = [get_hardware(n) for n in ("h100", "h200", "mi300x", "b200")]
    assert all(g.multi_row_overhead_s == 0.0 and g.attention_eff is None for g in gpus)
    assert all(g.fused_decode_max_seqs == 0 for g in gpus)


def test_decode_steps_small_enough_for_the_fused_path_pay_no_multi_row_overhead():
    # An engine that runs decode-only steps of up to 4 sequences on its fused path (one
    # weight read for all rows, no GEMM; the numba step): a fifth sequence, or any prefill
    # token, leaves it.
    model = get_model("smollm2-135m")
    plain = get_hardware("cpu-local").with_fit(multi_row_overhead_s=0.0, fused_decode_max_seqs=4)
    cost = CostModel(model, plain.with_fit(multi_row_overhead_s=0.05), 1, "fp32")
    without = CostModel(model, plain, 1, "fp32")
    for batch, extra in ((1, 0.0), (2, 0.0), (4, 0.0), (5, 0.05), (16, 0.05)):
        step = StepShape(batch, batch, batch * 129, batch * 129, batch)
        assert cost.step_time(step) == pytest.approx(without.step_time(step) + extra, rel=1e-12)
        assert cost.decode_line(batch, batch * 129).step(0) == pytest.approx(
            cost.step_time(step), rel=1e-12
        )
    # Three decodes beside a 16-token prefill chunk: four chunks, but not decode-only.
    mixed = StepShape(19, 4, 3 * 129 + 16 * 17 / 2, 3 * 129 + 16, 4)
    assert cost.step_time(mixed) == pytest.approx(without.step_time(mixed) + 0.05, rel=1e-12)
    # Without the fused path (an engine run with --no-fused-decode) every multi-row step pays.
    torch_only = CostModel(
        model, plain.with_fit(multi_row_overhead_s=0.05, fused_decode_max_seqs=0), 1, "fp32"
    )
    pair = StepShape(2, 2, 2 * 129, 2 * 129, 2)
    assert torch_only.step_time(pair) == pytest.approx(without.step_time(pair) + 0.05, rel=1e-12)
    with pytest.raises(ValueError, match="fused_decode_max_seqs"):
        plain.with_fit(fused_decode_max_seqs=-1)


def test_the_fused_path_computes_at_its_own_efficiency():
    # smollm2-135m in float32 on cpu-local, one thread (90 GFLOP/s): a decode step of 4
    # sequences at 128 tokens of context on the fused path does 2 x 4 x (weights without
    # embeddings) + the LM head 4 times + attention over 4 x 129 positions, all at
    # fused_compute_eff; a fifth sequence leaves the path and computes at compute_eff and
    # attention_eff again. The weight read is at memory_eff either way.
    model = get_model("smollm2-135m")
    hw = (
        get_hardware("cpu-local")
        .with_peaks((90e9, 16.6e9))
        .with_fit(
            fused_decode_max_seqs=4,
            compute_eff=1.0,
            attention_eff=0.5,
            memory_eff=1.0,
            fused_compute_eff=0.05,
            step_overhead_s=0.0,
            seq_overhead_s=0.0,
            multi_row_overhead_s=0.0,
        )
    )
    cost = CostModel(model, hw, 1, "fp32")
    per_token = 2 * model.layers * (model.attention_params + model.active_mlp_params)
    head = 2 * model.vocab * model.hidden
    per_position = 4 * model.layers * model.heads * model.head_dim

    def flops(b: int) -> float:
        return b * per_token + b * head + b * 129 * per_position

    for b in (1, 4):
        step = StepShape(b, b, b * 129, b * 129, b)
        expected = flops(b) / (90e9 * 0.05)
        assert cost.compute_time(step) == pytest.approx(expected, rel=1e-9)
        assert expected > cost.memory_time(step)  # so it is the step's time
        assert cost.step_time(step) == pytest.approx(expected, rel=1e-9)
        assert cost.decode_line(b, b * 129).step(0) == pytest.approx(expected, rel=1e-9)
    five = StepShape(5, 5, 5 * 129, 5 * 129, 5)
    expected = (5 * per_token + 5 * head) / 90e9 + 5 * 129 * per_position / (90e9 * 0.5)
    assert cost.compute_time(five) == pytest.approx(expected, rel=1e-9)
    # Without its own efficiency (older calibrations, the GPU profiles) as any other step.
    same = CostModel(model, hw.with_fit(fused_compute_eff=None), 1, "fp32")
    one = StepShape(1, 1, 129, 129, 1)
    assert same.compute_time(one) == pytest.approx(
        (per_token + head) / 90e9 + 129 * per_position / (90e9 * 0.5), rel=1e-9
    )
    assert all(get_hardware(n).fused_compute_eff is None for n in ("h100", "mi300x", "b200"))
    with pytest.raises(ValueError, match="fused_compute_eff"):
        hw.with_fit(fused_compute_eff=1.5)


def test_attention_at_its_own_efficiency():
    # Attention's FLOPs at attention_eff, the weight products' at compute_eff: a prefill
    # after a 512-token context pays for the context's attention alone at the slower rate.
    model = get_model("smollm2-135m")
    hw = get_hardware("cpu-local").with_peaks((90e9, 16.6e9))
    hw = hw.with_fit(compute_eff=0.8, attention_eff=0.4)
    cost = CostModel(model, hw, 1, "fp32")
    same = CostModel(model, hw.with_fit(attention_eff=None), 1, "fp32")
    after, fresh = StepShape(128, 1, 128 * 512 + 128 * 129 / 2, 640, 1), StepShape(128, 1, 0, 0, 1)
    attention = 4 * model.layers * model.heads * model.head_dim * after.attended / 90e9
    assert cost.compute_time(after) - cost.compute_time(fresh) == pytest.approx(attention / 0.4)
    assert same.compute_time(after) - same.compute_time(fresh) == pytest.approx(attention / 0.8)


@pytest.mark.parametrize("scale", [0.98, 1.1])
def test_a_profile_with_steps_scaled_scales_every_step_exactly(scale):
    # cpu-local at TP1 (no all-reduce latency): compute- and memory-bound steps, one
    # token or many, each exactly `scale` times as long; the link is not a step.
    hw = get_hardware("cpu-local").with_fit(multi_row_overhead_s=0.03, seq_overhead_s=0.002)
    base = CostModel(get_model("smollm2-135m"), hw, 1, "fp32")
    scaled = CostModel(get_model("smollm2-135m"), hw.steps_scaled(scale), 1, "fp32")
    for shape in (StepShape(1, 1, 300, 300, 1), StepShape(512, 1, 512 * 513 / 2, 512, 1)):
        assert scaled.step_time(shape) == pytest.approx(scale * base.step_time(shape), rel=1e-12)
    assert scaled.transfer_time(1000, True) == base.transfer_time(1000, True)
    with pytest.raises(ValueError, match="scale must be > 0"):
        hw.steps_scaled(0.0)
