"""bfloat16: what ``--dtype auto`` picks on CPU, and our decoder against transformers run in
bfloat16 too (the rest of tests/models compares float32 with float32)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.plan import StepPlan
from splitserve.models import loader
from tests.models.test_llama_vs_hf import BLOCK, chunk, prompt, save_hf_model

# bfloat16 keeps 8 bits of mantissa: two implementations that sum in different orders agree
# to a few units in the last place of the largest logit, not to float32's 1e-3.
REL_TOL = 0.03

# oneDNN computes bfloat16 with AVX-512 BW/VL/DQ or AVX-NE-CONVERT; elsewhere weights are not
# packed and torch's own (emulated) kernels run the products.
needs_onednn_bf16 = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="oneDNN computes no bfloat16 on this CPU, so no packed bfloat16 product",
)
# The bundled model in bfloat16 on a CPU without native bfloat16 (AMX, AVX-512 BF16) takes
# many minutes per test; ``--dtype auto`` serves float32 there.
# (The CPU's own flags: tests/conftest.py sets SPLITSERVE_CPU_BF16=0 for "auto".)
needs_native_bf16 = pytest.mark.skipif(
    loader.cpu_flags().isdisjoint(loader.NATIVE_BF16_FLAGS),
    reason="no native bfloat16 on this CPU: the default model in bfloat16 runs emulated",
)


def hf_bf16_last_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, -1].float()


@pytest.fixture(scope="module", params=("llama", "qwen2"))
def bf16_pair(request, tmp_path_factory, hf_model_factory):
    hf = hf_model_factory(request.param, seed=11)
    directory = save_hf_model(hf, tmp_path_factory.mktemp(f"{request.param}-bf16"))
    runner = ModelRunner(
        loader.load_model(directory, dtype="bfloat16", load_tokenizer=False),
        block_size=BLOCK,
        kv_cache_bytes=2**20,
    )
    return hf.to(torch.bfloat16), runner


def cpuinfo(tmp_path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    return str(path)


@pytest.mark.parametrize(
    "flags, native",
    [
        ("fpu sse4_2 avx avx2 avx512f avx512_bf16 avx512_vnni", True),
        ("fpu avx2 avx512f amx_bf16 amx_tile", True),
        ("fpu sse4_2 avx avx2 avx512f avx512bw", False),  # AVX-512 without BF16: emulated
        ("fpu sse4_2 avx avx2 fma", False),
    ],
)
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, monkeypatch, flags, native):
    monkeypatch.delenv("SPLITSERVE_CPU_BF16", raising=False)
    assert loader.cpu_has_native_bf16(cpuinfo(tmp_path, flags)) is native


def test_unreadable_cpuinfo_means_no_native_bf16(tmp_path, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_CPU_BF16", raising=False)
    assert loader.cpu_has_native_bf16(str(tmp_path / "missing")) is False


def test_auto_dtype_follows_the_cpu(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CPU_BF16", "1")
    assert loader.resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setenv("SPLITSERVE_CPU_BF16", "0")
    assert loader.resolve_dtype("auto", "cpu") == torch.float32
    assert loader.resolve_dtype("bfloat16", "cpu") == torch.bfloat16  # names are not touched


def test_greedy_decode_matches_transformers_in_bf16(bf16_pair):
    """Prefill then 16 greedy steps: logits within bfloat16's tolerance of transformers in
    bfloat16, and the same token wherever transformers' top two are further apart than that
    tolerance (closer ones are ties at this precision)."""
    hf, runner = bf16_pair
    tokens = prompt(20, seed=21)
    table = list(range(10, 20))
    logits = runner.last_logits(StepPlan([chunk("a", tokens, 0, table)]))["a"]
    decided = 0
    for step in range(16):
        expected = hf_bf16_last_logits(hf, tokens)
        tol = REL_TOL * expected.abs().max().item()
        assert (logits - expected).abs().max().item() < tol, f"step {step}"
        top2 = expected.topk(2).values
        if (top2[0] - top2[1]).item() > 2 * tol:
            assert int(logits.argmax()) == int(expected.argmax()), f"step {step}"
            decided += 1
        tokens.append(int(expected.argmax()))
        plan = StepPlan([chunk("a", tokens[-1:], len(tokens) - 1, table, step + 1)])
        logits = runner.last_logits(plan)["a"]
    assert decided >= 8  # the comparison decided most steps, it did not skip them all


def test_bf16_batch_gives_each_sequence_its_logits_alone(bf16_pair):
    """A decode batched with a prefill and another decode gets the logits it gets alone,
    exactly: greedy output must not depend on batch mates in bfloat16 either."""
    _, runner = bf16_pair
    a, b, c = prompt(9, seed=23), prompt(13, seed=24), prompt(17, seed=25)
    tables = {"a": [0, 1, 2], "b": [3, 4, 5, 6], "c": [7, 8, 9, 10, 11]}
    runner.execute(
        StepPlan([chunk("b", b[:12], 0, tables["b"]), chunk("c", c[:16], 0, tables["c"])])
    )
    step = [
        chunk("a", a, 0, tables["a"]),
        chunk("b", b[12:], 12, tables["b"], 1),
        chunk("c", c[16:], 16, tables["c"], 1),
    ]
    together = runner.last_logits(StepPlan(step))
    for one in step[1:]:
        alone = runner.last_logits(StepPlan([one]))
        assert torch.equal(alone[one.request_id], together[one.request_id]), one.request_id


@needs_onednn_bf16
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576)])
def test_a_bf16_product_gives_each_row_its_result_alone_at_any_row_count(shape, monkeypatch):
    """oneDNN sums a row of a larger bfloat16 product in another order (on AMX); the pieces of
    ``packed_linear`` keep every row at its result alone (here on oneDNN, not the AMX tiles)."""
    from splitserve.models import amx_linear
    from splitserve.models.llama import BATCH_INVARIANT_ROWS, packed_linear, packed_weight

    monkeypatch.setattr(amx_linear, "pack", lambda weight: None)
    torch.manual_seed(3)
    k, n = shape
    weight = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    packed = packed_weight(weight)
    assert packed.dim() == 2  # oneDNN's layout
    x = torch.randn(3 * BATCH_INVARIANT_ROWS + 5, k).to(torch.bfloat16)
    alone = torch.cat([packed_linear(x[i : i + 1], packed) for i in range(x.shape[0])])
    for rows in (2, BATCH_INVARIANT_ROWS, BATCH_INVARIANT_ROWS + 1, 70, x.shape[0]):
        assert torch.equal(packed_linear(x[:rows], packed), alone[:rows]), rows


@needs_native_bf16
def test_bf16_greedy_tokens_alone_equal_batched_with_the_default_model():
    """The bundled model in bfloat16, 40 prompts at once (decode steps of more rows than
    ``BATCH_INVARIANT_ROWS``, prefills split over steps) against each prompt alone."""
    import random

    from splitserve import LLM, SamplingParams

    llm = LLM(dtype="bfloat16", kv_cache_gb=0.25)
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(60, 200))] for _ in range(40)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batched = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    for i in range(0, 40, 4):
        llm.engine.block_manager.reset_prefix_cache()
        alone = list(llm.generate([prompts[i]], params)[0].outputs[0].token_ids)
        assert alone == batched[i], i


def test_bf16_a_token_gets_its_logits_however_its_prompt_was_prefilled(bf16_pair):
    """With the C++ attention kernel a token's logits depend only on the tokens before it:
    the prompt in one chunk, in chunks (as after a prefix-cache hit, or under a token
    budget), or its last token as a decode row give the same bits."""
    from splitserve.models import paged_decode

    _, runner = bf16_pair
    heads = runner.model.config.num_heads
    if not paged_decode.native_fits(heads, runner.kv_cache[0, 0]):
        pytest.skip("the C++ attention kernel is not built here")
    blocks = 100 // BLOCK
    for seed, size in ((31, 7), (32, 33), (33, 34)):
        tokens = prompt(99, seed=seed)
        whole = runner.last_logits(StepPlan([chunk("a", tokens, 0, list(range(blocks)))]))["a"]
        table = list(range(blocks, 2 * blocks))
        for start in range(0, len(tokens), size):
            chunked = runner.last_logits(
                StepPlan([chunk("b", tokens[start : start + size], start, table)])
            )["b"]
        table = list(range(2 * blocks, 3 * blocks))
        runner.execute(StepPlan([chunk("c", tokens[:-1], 0, table)]))
        plan = StepPlan([chunk("c", tokens[-1:], len(tokens) - 1, table, 1)])
        decoded = runner.last_logits(plan)["c"]
        assert torch.equal(whole, chunked), (seed, size)
        assert torch.equal(whole, decoded), seed


@needs_native_bf16
def test_bf16_second_turn_equals_a_fresh_prefill_with_the_default_model():
    """An agent's second turn reuses the first turn's cached blocks, generated tokens
    included (their KV computed by decode steps); its greedy tokens equal those of the same
    prompt prefilled from scratch."""
    import random

    from splitserve import LLM, SamplingParams
    from splitserve.models import paged_decode

    llm = LLM(dtype="bfloat16", kv_cache_gb=0.25)
    runner = llm.engine.runner
    if not paged_decode.native_fits(runner.config.num_heads, runner.kv_cache[0, 0]):
        pytest.skip("the C++ attention kernel is not built here")
    rng = random.Random(2)
    first = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    second = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i in range(12):
        llm.engine.block_manager.reset_prefix_cache()
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(40, 160))]
        answer = list(llm.generate([prompt], first)[0].outputs[0].token_ids)
        turn = prompt + answer + [rng.randrange(100, 40000) for _ in range(rng.randint(2, 30))]
        reused = llm.generate([turn], second)[0]
        assert reused.num_cached_tokens > len(prompt), i
        llm.engine.block_manager.reset_prefix_cache()
        fresh = llm.generate([turn], second)[0]
        assert list(reused.outputs[0].token_ids) == list(fresh.outputs[0].token_ids), i
