"""The decode step in one C++ call (models/decode_step.py) against the model's torch path on
the same packed weights: the same bits for logits and cache, alone or batched, at any thread
count; bad input refused; the models it does not take keep another path."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from splitserve.engine import model_runner as model_runner_module
from splitserve.engine.core_share import CoreShare
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.plan import StepPlan
from splitserve.models import amx_linear, decode_step, native
from splitserve.models.decode_step import DecodeStep
from splitserve.models.loader import load_model
from tests.models.plans import chunk, decode_steps, greedy_run, prompt

pytestmark = pytest.mark.skipif(
    native.load("decode_step") is not None, reason=str(native.load("decode_step"))
)

BLOCK = 4  # so that a few decode steps cross block boundaries
# head_dim 32 (the RoPE kernel's multiple), two query heads per kv head.
SHAPE = dict(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2)


def saved(tmp_path_factory, hf_model_factory, variant: str, **shape) -> str:
    directory = tmp_path_factory.mktemp(variant)
    hf_model_factory(variant, **shape).save_pretrained(directory, safe_serialization=True)
    return str(directory)


# bfloat16 runs on AMX tiles only (models/amx_linear.py).
no_amx = pytest.mark.skipif(not amx_linear.available(), reason="no AMX: no bfloat16 step")


@pytest.fixture(
    scope="module",
    params=[
        ("llama", "float32"),
        ("qwen2", "float32"),
        ("llama3_tied", "float32"),
        pytest.param(("qwen2", "bfloat16"), marks=no_amx),  # qkv bias, rounded once in float32
        pytest.param(("llama3_tied", "bfloat16"), marks=no_amx),
    ],
    ids="-".join,
)
def runners(request, tmp_path_factory, hf_model_factory):
    """(torch-path runner, native-step runner): the same weights, a cache each."""
    variant, dtype = request.param
    directory = saved(tmp_path_factory, hf_model_factory, variant, **SHAPE)
    loaded = load_model(directory, dtype=dtype, load_tokenizer=False)
    make = lambda on: ModelRunner(  # noqa: E731
        loaded, block_size=BLOCK, kv_cache_bytes=2**20, threads=2, fused_decode=on
    )
    plain, native_step = make(False), make(True)
    assert plain.fused is None and isinstance(native_step.fused, DecodeStep)
    return plain, native_step


def test_logits_and_cache_are_the_torch_paths_bit_for_bit(runners):
    plain, native_step = runners
    for step, plan in enumerate(decode_steps(runners)):
        assert native_step._fused_applies(plan) and not plain._fused_applies(plan)
        expected, got = plain.last_logits(plan), native_step.last_logits(plan)
        for rid in expected:
            assert torch.equal(got[rid], expected[rid]), (rid, step)
    assert torch.equal(native_step.kv_cache, plain.kv_cache)


def test_a_sequence_gets_identical_logits_alone_and_with_others_at_any_thread_count(runners):
    _, native_step = runners
    seqs = {"a": prompt(5, 4), "b": prompt(9, 5), "c": prompt(2, 6), "d": prompt(7, 7)}
    tables = {rid: list(range(6 * i, 6 * i + 6)) for i, rid in enumerate(seqs)}
    native_step.execute(StepPlan([chunk(r, t, 0, tables[r]) for r, t in seqs.items()]))
    step = [chunk(r, [t[-1] + 1], len(t), tables[r], 1) for r, t in seqs.items()]
    together = native_step.last_logits(StepPlan(step))
    try:
        for one in step:
            for threads in (1, 2, 3):
                native_step.threads = threads
                alone = native_step.last_logits(StepPlan([one]))  # rewrites its slot, same values
                assert torch.equal(alone[one.request_id], together[one.request_id])
    finally:
        native_step.threads = 2


def test_greedy_tokens_are_the_same_with_the_path_on_and_off(runners):
    plain, native_step = runners
    assert greedy_run(plain) == greedy_run(native_step)


def test_bad_input_is_refused_before_the_cache_is_touched(runners):
    _, native_step = runners
    step, cache = native_step.fused, native_step.kv_cache
    before = cache.clone()
    ok = dict(slots=np.array([5]), block_tables=np.array([[1, 2]]), context_lens=np.array([6]))
    call = lambda ids, **kw: step.forward(torch.tensor(ids), **{**ok, **kw}, threads=1)  # noqa: E731
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        call([256])
    with pytest.raises(RuntimeError, match="slot .* outside the cache"):
        call([3], slots=np.array([cache.shape[2] * BLOCK]))
    with pytest.raises(RuntimeError, match="outside its block table"):
        call([3], context_lens=np.array([9]))
    with pytest.raises(RuntimeError, match="block outside the cache"):
        call([3], block_tables=np.array([[1, cache.shape[2]]]))
    cos, sin = step.rope_tables(6)
    with pytest.raises(RuntimeError, match="past the RoPE tables"):
        step.impl.step(
            torch.tensor([3]), cos[:5], sin[:5], torch.tensor([5]), torch.tensor([[1, 2]]),
            torch.tensor([6]), cache,
        )  # fmt: skip
    assert torch.equal(cache, before)
    assert call([3]).shape == (1, 256)


def test_rope_tables_hold_the_rows_rotary_gives_each_position_alone(runners):
    step = runners[1].fused
    first = step.rope_tables(1)[0].shape[0]
    cos, sin = step.rope_tables(first + 1)  # grown
    assert cos.shape[0] > first
    for p in (0, 1, 17, first - 1, first, cos.shape[0] - 1):
        alone_cos, alone_sin = step.model.rotary(torch.tensor([p]), step.model.dtype)
        assert torch.equal(cos[p], alone_cos[0, 0]) and torch.equal(sin[p], alone_sin[0, 0]), p


def test_models_it_does_not_take_keep_another_path(
    tmp_path_factory, hf_model_factory, caplog, monkeypatch
):
    narrow = load_model(saved(tmp_path_factory, hf_model_factory, "llama"), load_tokenizer=False)
    with caplog.at_level(logging.INFO, logger=model_runner_module.__name__):
        runner = ModelRunner(narrow, block_size=BLOCK, kv_cache_bytes=2**20, fused_decode=True)
    assert "head_dim 16 is not a multiple of 32" in caplog.text
    assert runner.fused is None or not isinstance(runner.fused, DecodeStep)
    directory = saved(tmp_path_factory, hf_model_factory, "qwen2", **SHAPE)
    monkeypatch.setattr(amx_linear, "pack", lambda weight: None)  # as on a CPU without AMX
    bf16 = load_model(directory, dtype="bfloat16", load_tokenizer=False)
    ModelRunner(bf16, block_size=BLOCK, kv_cache_bytes=2**20)  # binds its cache
    assert "AMX tiles" in decode_step.unavailable_reason(bf16.model)
    with pytest.raises(RuntimeError, match="AMX tiles"):
        DecodeStep(bf16.model)


def test_every_decode_only_step_takes_it_and_mixed_steps_do_not(runners):
    _, native_step = runners
    many = StepPlan([chunk(str(i), [1], 3, [i]) for i in range(40)])
    assert native_step._fused_applies(many)
    mixed = StepPlan([chunk("a", [1], 3, [0]), chunk("b", [1, 2], 0, [1])])
    assert not native_step._fused_applies(mixed)


def test_only_small_steps_take_their_threads_from_core_share(runners):
    """CoreShare compares the times of small steps to pick their threads; a larger step keeps
    every thread and is neither sampled nor recorded."""
    _, native_step = runners
    share = native_step.core_share = CoreShare(interval_s=1e-9)  # samples on every call
    tables = {str(i): [2 * i, 2 * i + 1] for i in range(8)}
    native_step.execute(StepPlan([chunk(r, prompt(3, int(r)), 0, t) for r, t in tables.items()]))
    big = StepPlan([chunk(r, [1], 3, t, 1) for r, t in tables.items()])
    before = share._last
    native_step.execute(big)
    assert share._last is before
    native_step.execute(StepPlan(big.chunks[:1]))
    assert share._last is not before
