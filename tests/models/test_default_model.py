"""The default model (SmolLM2-135M-Instruct Q4_1) greedy-decodes exactly like transformers
running on the same dequantized GGUF weights."""

from __future__ import annotations

import os

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.plan import ScheduledChunk, StepPlan
from splitserve.models.loader import default_model_path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about distributed systems.",
    "List three prime numbers and explain why they are prime.",
]
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def hf_model():
    """transformers' own GGUF path (its dequantization and q/k un-permutation), built without
    ``from_pretrained``, which insists on the ``accelerate`` package for GGUF files."""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    directory, name = os.path.split(path)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    model = LlamaForCausalLM(config).float()
    result = model.load_state_dict(tensors, strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]  # tied
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


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
