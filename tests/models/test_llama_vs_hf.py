"""Our paged-KV decoder against transformers on small random models, in float32."""

from __future__ import annotations

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.plan import ScheduledChunk, StepPlan
from splitserve.models.loader import load_model

ATOL = 1e-3
BLOCK = 4  # small, so a 40-token sequence spans ten pages
GREEDY = SamplingParams(temperature=0)


VARIANTS = ("llama", "llama3_tied", "qwen2")


def hf_last_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, -1].float()


def save_hf_model(model, directory, max_shard_size: str | None = None) -> str:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return str(directory)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def chunk(rid: str, tokens: list[int], start: int, table: list[int], n_out: int = 0):
    return ScheduledChunk(rid, tokens, start, table, True, GREEDY, n_out)


def runner_for(directory: str, **kwargs) -> ModelRunner:
    loaded = load_model(directory, load_tokenizer=False)
    return ModelRunner(loaded, block_size=BLOCK, kv_cache_bytes=kwargs.pop("kv", 2**20), **kwargs)


@pytest.fixture(scope="module", params=VARIANTS)
def pair(request, tmp_path_factory, hf_model_factory):
    """(hf model, our runner) for each variant."""
    hf = hf_model_factory(request.param)
    directory = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf, runner_for(directory)


def test_prefill_then_greedy_decode_matches_hf(pair):
    hf, runner = pair
    tokens = prompt(20, seed=1)
    table = list(range(20, 31))  # not starting at block 0: slots must follow the table
    logits = runner.last_logits(StepPlan([chunk("a", tokens, 0, table)]))["a"]
    for step in range(20):
        expected = hf_last_logits(hf, tokens)
        assert (logits - expected).abs().max().item() < ATOL, f"step {step}"
        tokens.append(int(expected.argmax()))
        plan = StepPlan([chunk("a", tokens[-1:], len(tokens) - 1, table, step + 1)])
        logits = runner.last_logits(plan)["a"]


def test_chunked_prefill_matches_single_prefill_and_hf(pair):
    hf, runner = pair
    tokens = prompt(20, seed=2)
    table = [5, 3, 9, 1, 7]
    whole = runner.last_logits(StepPlan([chunk("a", tokens, 0, table)]))["a"]
    table2 = [8, 2, 6, 4, 0]
    for start, end in ((0, 7), (7, 14), (14, 20)):
        part = runner.last_logits(StepPlan([chunk("b", tokens[start:end], start, table2)]))["b"]
    assert (part - whole).abs().max().item() < 1e-5
    assert (part - hf_last_logits(hf, tokens)).abs().max().item() < ATOL


def test_mixed_batch_equals_each_alone(pair):
    """One step holding a fresh prefill, a decode and a continued prefill gives each the
    logits it gets when run alone."""
    _, runner = pair
    a, b, c = prompt(9, seed=3), prompt(13, seed=4), prompt(17, seed=5)
    tables = {"a": [0, 1, 2], "b": [3, 4, 5, 6], "c": [7, 8, 9, 10, 11]}
    # Before the step: b has 12 tokens cached (decodes its 13th), c has 6 (prefills 11 more).
    runner.execute(
        StepPlan([chunk("b", b[:12], 0, tables["b"]), chunk("c", c[:6], 0, tables["c"])])
    )
    step = [
        chunk("a", a, 0, tables["a"]),
        chunk("b", b[12:], 12, tables["b"], 1),
        chunk("c", c[6:], 6, tables["c"]),
    ]
    together = runner.last_logits(StepPlan(step))
    for one in step:
        alone = runner.last_logits(StepPlan([one]))  # rewrites the same slots, same values
        assert (alone[one.request_id] - together[one.request_id]).abs().max().item() < 1e-5


def test_batched_greedy_decode_matches_hf(pair):
    """Three sequences decoded together for 8 steps, each checked against HF."""
    hf, runner = pair
    seqs = {"a": prompt(5, 6), "b": prompt(11, 7), "c": prompt(18, 8)}
    tables = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7, 8], "c": [9, 10, 11, 12, 13, 14, 15]}
    plan = StepPlan([chunk(r, t, 0, tables[r]) for r, t in seqs.items()])
    for step in range(8):
        logits = runner.last_logits(plan)
        for rid, tokens in seqs.items():
            expected = hf_last_logits(hf, tokens)
            assert (logits[rid] - expected).abs().max().item() < ATOL, (rid, step)
            tokens.append(int(expected.argmax()))
        plan = StepPlan(
            [chunk(r, t[-1:], len(t) - 1, tables[r], step + 1) for r, t in seqs.items()]
        )


def test_sharded_checkpoint_loads(tmp_path, hf_model_factory):
    hf = hf_model_factory("llama", seed=3)
    directory = save_hf_model(hf, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    runner = runner_for(directory)
    tokens = prompt(12, seed=9)
    logits = runner.last_logits(StepPlan([chunk("a", tokens, 0, [0, 1, 2])]))["a"]
    assert (logits - hf_last_logits(hf, tokens)).abs().max().item() < ATOL


def test_bfloat16_is_close(tmp_path, hf_model_factory):
    hf = hf_model_factory("qwen2", seed=4)
    directory = save_hf_model(hf, tmp_path)
    runner = ModelRunner(
        load_model(directory, dtype="bfloat16", load_tokenizer=False),
        block_size=BLOCK,
        kv_cache_bytes=2**20,
    )
    assert runner.kv_cache.dtype == torch.bfloat16
    tokens = prompt(12, seed=10)
    logits = runner.last_logits(StepPlan([chunk("a", tokens, 0, [0, 1, 2])]))["a"]
    expected = hf_last_logits(hf, tokens)
    assert logits.dtype == torch.float32
    assert (logits - expected).abs().max().item() < 0.1 * expected.abs().max().item()
