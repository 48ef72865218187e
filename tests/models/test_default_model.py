"""The default model (SmolLM2-135M-Instruct Q4_1) greedy-decodes exactly like transformers
running on the same dequantized GGUF weights."""

from __future__ import annotations

import pytest
import torch
from hf_reference import load_transformers_default_model

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.plan import ScheduledChunk, StepPlan

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about distributed systems.",
    "List three prime numbers and explain why they are prime.",
]
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def hf_model():
    """transformers on the same GGUF, through its own dequantization and q/k un-permutation."""
    model, result = load_transformers_default_model()
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]  # tied
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def greedy_with_runner(runner: ModelRunner, prompt_ids: list[int], n: int) -> list[int]:
    """Prefill then decode one token at a time, ignoring EOS."""
    table = list(range(runner.num_blocks))[: -(-(len(prompt_ids) + n) // runner.block_size)]
    out: list[int] = []
    chunk = ScheduledChunk("r", prompt_ids, 0, table, True, GREEDY)
    for _ in range(n):
        token = runner.execute(StepPlan([chunk])).sampled["r"]
        out.append(token)
        chunk = ScheduledChunk("r", [token], chunk.context_len, table, True, GREEDY, len(out))
    return out


def test_greedy_replies_match_transformers(default_model, hf_model):
    runner = ModelRunner(default_model, block_size=16, kv_cache_bytes=32 * 2**20)
    tok = default_model.tokenizer
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
        ours = greedy_with_runner(runner, ids, NEW_TOKENS)
        with torch.no_grad():
            generated = hf_model.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS
            )
        theirs = generated[0, len(ids) :].tolist()
        # transformers stops at EOS (and includes it); our loop does not stop.
        assert len(theirs) == NEW_TOKENS or theirs[-1] in tok.eos_token_ids
        assert ours[: len(theirs)] == theirs, (prompt, tok.decode(ours), tok.decode(theirs))
