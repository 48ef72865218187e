"""ModelRunner: KV sizing, plan -> tensors, batching invariance, sampling only where asked."""

from __future__ import annotations

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.plan import ScheduledChunk, StepPlan
from splitserve.models.config import ModelConfig
from splitserve.models.llama import LlamaForCausalLM, SplitGemv, matmul_t
from splitserve.models.loader import LoadedModel

GREEDY = SamplingParams(temperature=0)
CONFIG = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Our decoder with random weights: the runner's tests need no checkpoint."""
    config = ModelConfig(**CONFIG)
    model = LlamaForCausalLM(config, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        values = torch.randn(p.shape, generator=g) * (0.1 if "norm" in name else 0.3)
        p.data.copy_(values + (1 if "norm" in name else 0))
    return LoadedModel(model.eval(), config, None)


@pytest.fixture
def runner() -> ModelRunner:
    return ModelRunner(tiny_model(), block_size=4, kv_cache_bytes=64 * 2**10)


def chunk(rid, tokens, start, table, sample=True, params=GREEDY, n_out=0) -> ScheduledChunk:
    return ScheduledChunk(rid, tokens, start, table, sample, params, n_out)


def test_kv_cache_sizing(runner):
    # 2 (k, v) * 2 layers * 2 kv heads * 8 dims * 4 bytes = 256 bytes per token
    assert runner.bytes_per_block == 256 * 4
    assert runner.num_blocks == 64 * 2**10 // 1024 == 64
    assert runner.kv_cache.shape == (2, 2, 64, 4, 2, 8)
    with pytest.raises(ValueError, match="less than one KV block"):
        ModelRunner(tiny_model(), block_size=4, kv_cache_bytes=1000)


def test_bf16_halves_block_bytes():
    assert (
        ModelRunner(
            tiny_model(dtype=torch.bfloat16), block_size=4, kv_cache_bytes=2**16
        ).bytes_per_block
        == 512
    )


def test_samples_only_chunks_that_ask(runner):
    plan = StepPlan(
        [chunk("a", [1, 2, 3], 0, [0]), chunk("b", [4, 5, 6, 7, 8], 0, [1, 2], sample=False)]
    )
    assert set(runner.execute(plan).sampled) == {"a"}
    assert runner.execute(StepPlan()).sampled == {}


def test_writes_kv_into_the_mapped_slots(runner):
    runner.execute(StepPlan([chunk("a", [1, 2, 3, 4, 5, 6], 0, [7, 3])]))
    k = runner.kv_cache[0, 0]
    assert k[7].abs().sum(-1).all() and k[3, :2].abs().sum(-1).all()  # positions 0..5
    assert not k[3, 2:].any() and not k[0].any()


def greedy_run(runner, prompts: dict[str, list[int]], steps: int, together: bool):
    """Greedy-decode prompts for ``steps`` steps, in one batch or one sequence at a time."""
    tables = {rid: list(range(8 * i, 8 * i + 8)) for i, rid in enumerate(prompts)}
    seqs = {rid: list(p) for rid, p in prompts.items()}
    plans = {rid: chunk(rid, p, 0, tables[rid]) for rid, p in seqs.items()}
    for step in range(steps):
        groups = [list(plans.values())] if together else [[c] for c in plans.values()]
        for group in groups:
            for rid, token in runner.execute(StepPlan(group)).sampled.items():
                seqs[rid].append(token)
        plans = {
            rid: chunk(rid, s[-1:], len(s) - 1, tables[rid], n_out=step + 1)
            for rid, s in seqs.items()
        }
    return seqs


def test_batch_and_alone_agree(runner):
    prompts = {"a": [5, 9, 3], "b": list(range(1, 12)), "c": [7] * 6, "d": [42]}
    alone = greedy_run(runner, prompts, steps=12, together=False)
    assert greedy_run(runner, prompts, steps=12, together=True) == alone


def test_runners_sharing_a_model_keep_their_own_cache():
    loaded = tiny_model()
    first = ModelRunner(loaded, block_size=4, kv_cache_bytes=2**14)
    second = ModelRunner(loaded, block_size=4, kv_cache_bytes=2**14)
    first.execute(StepPlan([chunk("a", [1, 2, 3], 0, [0])]))
    assert first.kv_cache.any() and not second.kv_cache.any()
    second.execute(StepPlan([chunk("a", [1, 2, 3], 0, [0])]))
    assert torch.equal(first.kv_cache, second.kv_cache)


def test_seeded_sampling_ignores_batch_mates(runner):
    seeded = SamplingParams(temperature=1.0, seed=77)
    alone = runner.execute(StepPlan([chunk("s", [1, 2, 3, 4, 5], 0, [0, 1], params=seeded)]))
    mates = [
        chunk("x", [9, 8, 7], 0, [2], params=SamplingParams(temperature=1.0)),
        chunk("s", [1, 2, 3, 4, 5], 0, [0, 1], params=seeded),
        chunk("y", [6], 0, [3]),
    ]
    assert runner.execute(StepPlan(mates)).sampled["s"] == alone.sampled["s"]


@pytest.mark.parametrize(
    "bad,message",
    [
        (chunk("a", [1, 2, 3, 4, 5], 0, [0]), "block table has 1 blocks"),
        (chunk("a", [1, 2], 0, [64]), "block id out of range"),
        (chunk("a", [], 0, [0]), "needs >= 1 token"),
    ],
)
def test_rejects_bad_chunks(runner, bad, message):
    with pytest.raises(ValueError, match=message):
        runner.execute(StepPlan([bad]))


def test_rejects_too_many_sequences():
    small = ModelRunner(tiny_model(), block_size=4, kv_cache_bytes=2**14, max_num_seqs=1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        small.execute(StepPlan([chunk("a", [1], 0, [0]), chunk("b", [2], 0, [1])]))


def test_shared_kv_cache_lives_in_shared_memory_until_close():
    # What a prefill worker on the shm transport runs with: decode workers copy from it.
    import os

    shared = ModelRunner(tiny_model(), block_size=4, kv_cache_bytes=64 * 2**10, shared_kv=True)
    name = shared.kv_segment.name
    assert os.path.exists(f"/dev/shm/{name}") and name.startswith(
        f"splitserve-kv-cache-{os.getpid()}-"
    )
    assert shared.kv_cache.shape == (2, 2, 64, 4, 2, 8) and not shared.kv_cache.any()
    private = ModelRunner(tiny_model(), block_size=4, kv_cache_bytes=64 * 2**10)
    plan = StepPlan([chunk("a", [5, 6, 7, 8, 9], 0, [3, 4])])
    assert shared.execute(plan).sampled == private.execute(plan).sampled
    assert torch.equal(shared.kv_cache, private.kv_cache)
    shared.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    assert private.kv_segment is None
    private.close()  # nothing to unlink


def test_shared_kv_cache_needs_host_memory():
    from splitserve.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_shm"):
        EngineConfig(device="cuda", kv_cache_shm=True)


@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize("out", [96, 97])  # 97 columns do not split in two: plain product
def test_split_gemv_matches_the_plain_product(rows: int, out: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w_t = torch.randn(rows, 64, generator=g), torch.randn(64, out, generator=g)
    before = torch.get_num_threads()
    with SplitGemv.over(2):
        split = matmul_t(x, w_t)
    assert torch.get_num_threads() == before and SplitGemv.parts == 1
    torch.testing.assert_close(split, x @ w_t, rtol=1e-6, atol=1e-5)


def test_small_steps_split_their_products_and_keep_greedy_tokens() -> None:
    before = torch.get_num_threads()
    try:
        runner = ModelRunner(
            tiny_model(), block_size=4, kv_cache_bytes=64 * 2**10, threads=2, split_gemv=True
        )
        with runner._threads_for(1):
            assert (SplitGemv.parts, torch.get_num_threads()) == (2, 1)
        with runner._threads_for(32):
            assert (SplitGemv.parts, torch.get_num_threads()) == (2, 2)
        with runner._threads_for(64):
            assert (SplitGemv.parts, torch.get_num_threads()) == (1, 2)
        assert SplitGemv.parts == 1
        prompts = {"a": [5, 9, 3], "b": list(range(1, 12)), "c": [7] * 6}
        split = greedy_run(runner, prompts, steps=10, together=False)
        runner.split_gemv = False
        assert greedy_run(runner, prompts, steps=10, together=False) == split
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                reason="oneDNN computes no bfloat16 on this CPU: nothing to pack",
            ),
        ),
    ],
)
def test_packed_weights_keep_every_thread_in_small_steps(dtype) -> None:
    """On packed weights a small step runs on the runner's threads (no per-product thread
    switching); greedy tokens stay the same alone and batched."""
    before = torch.get_num_threads()
    try:
        loaded = tiny_model(dtype=dtype)
        loaded.model.pack_weights()
        runner = ModelRunner(loaded, block_size=4, kv_cache_bytes=64 * 2**10, threads=2)
        assert runner.packed and not runner.split_gemv
        with runner._threads_for(1):
            assert (SplitGemv.parts, torch.get_num_threads()) == (1, 2)
        with runner._threads_for(1, fused=True):
            assert torch.get_num_threads() == 1
        prompts = {"a": [5, 9, 3], "b": list(range(1, 12)), "c": [7] * 6, "d": [42]}
        alone = greedy_run(runner, prompts, steps=10, together=False)
        assert greedy_run(runner, prompts, steps=10, together=True) == alone
    finally:
        torch.set_num_threads(before)
