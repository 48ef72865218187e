"""The fused decode path (models/fused_decode.py) against the torch path it replaces for small
decode-only steps: logits over the paged cache, greedy tokens, batch invariance, fallback."""

from __future__ import annotations

import logging

import pytest
import torch

from splitserve.engine import model_runner as model_runner_module
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.plan import StepPlan
from splitserve.models import fused_decode
from splitserve.models.loader import load_model
from tests.models.plans import chunk, decode_steps, greedy_run, prompt

pytest.importorskip("numba")

ATOL = 1e-3  # as the transformers comparisons
BLOCK = 4  # so that a few decode steps cross block boundaries


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama3_tied"])
def runners(request, tmp_path_factory, hf_model_factory):
    """(torch-path runner, fused runner, loaded model): same weights, a cache each."""
    directory = tmp_path_factory.mktemp(request.param)
    hf_model_factory(request.param).save_pretrained(directory, safe_serialization=True)
    loaded = load_model(str(directory), load_tokenizer=False)
    make = lambda fused: ModelRunner(  # noqa: E731
        loaded, block_size=BLOCK, kv_cache_bytes=2**20, threads=2, fused_decode=fused
    )
    plain, fused = make(False), make(True)
    assert plain.fused is None and fused.fused is not None
    return plain, fused, loaded


def test_logits_match_the_torch_path_over_decode_steps(runners):
    plain, fused, _ = runners
    for step, plan in enumerate(decode_steps((plain, fused))):
        assert fused._fused_applies(plan) and not plain._fused_applies(plan)
        expected, got = plain.last_logits(plan), fused.last_logits(plan)
        for rid in expected:
            diff = (got[rid] - expected[rid]).abs().max().item()
            assert diff < ATOL, (rid, step, diff)
    assert (fused.kv_cache - plain.kv_cache).abs().max().item() < 1e-5


def test_a_sequence_gets_identical_logits_alone_and_with_others(runners):
    _, fused, _ = runners
    seqs = {"a": prompt(5, 4), "b": prompt(9, 5), "c": prompt(2, 6), "d": prompt(7, 7)}
    tables = {rid: list(range(6 * i, 6 * i + 6)) for i, rid in enumerate(seqs)}
    fused.execute(StepPlan([chunk(r, t, 0, tables[r]) for r, t in seqs.items()]))
    step = [chunk(r, [t[-1] + 1], len(t), tables[r], 1) for r, t in seqs.items()]
    together = fused.last_logits(StepPlan(step))
    for one in step:
        for threads in (1, 2):
            fused.threads = threads
            alone = fused.last_logits(StepPlan([one]))  # rewrites the same slot, same values
            assert torch.equal(alone[one.request_id], together[one.request_id])
    fused.threads = 2


def test_greedy_tokens_are_the_same_with_the_path_on_and_off(runners):
    plain, fused, _ = runners
    assert greedy_run(plain) == greedy_run(fused)


def test_larger_or_mixed_steps_keep_the_torch_path(runners):
    _, fused, _ = runners
    many = [
        chunk(str(i), [1], 3, [i]) for i in range(model_runner_module.FUSED_DECODE_MAX_SEQS + 1)
    ]
    assert not fused._fused_applies(StepPlan(many))
    mixed = [chunk("a", [1], 3, [0]), chunk("b", [1, 2], 0, [1])]
    assert not fused._fused_applies(StepPlan(mixed))
    assert fused._fused_applies(StepPlan(many[:1]))


def test_falls_back_to_torch_with_a_log_line_when_unavailable(runners, monkeypatch, caplog) -> None:
    plain, _, loaded = runners
    monkeypatch.setattr(fused_decode, "_IMPORT_ERROR", "numba is not importable (test)")
    with caplog.at_level(logging.WARNING, logger=model_runner_module.__name__):
        runner = ModelRunner(loaded, block_size=BLOCK, kv_cache_bytes=2**20, fused_decode=True)
    assert runner.fused is None
    assert "fused decode is off" in caplog.text and "numba is not importable" in caplog.text
    plan = StepPlan([chunk("a", [1, 2, 3], 0, [0])])
    assert runner.execute(plan).sampled == plain.execute(plan).sampled


def test_bfloat16_models_keep_the_torch_path(tmp_path, hf_model_factory, caplog):
    hf_model_factory("qwen2").save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path), dtype="bfloat16", load_tokenizer=False)
    with caplog.at_level(logging.WARNING, logger=model_runner_module.__name__):
        runner = ModelRunner(loaded, block_size=BLOCK, kv_cache_bytes=2**20, fused_decode=True)
    assert runner.fused is None and "float32" in caplog.text
    with pytest.raises(RuntimeError, match="float32"):
        fused_decode.FusedDecoder(loaded.model, parts=2)


def test_the_kernels_called_from_python_release_the_gil():
    """A decode step runs for tens of milliseconds inside these two kernels; holding the GIL
    that long stalls the worker's HTTP loop and its KV mover thread for every step (found by
    the simulator's validation run: engine busy wall time far above its CPU time)."""
    for kernel in (fused_decode._decode_layers, fused_decode._final):
        assert kernel.targetoptions.get("nogil") is True, kernel.py_func.__name__
