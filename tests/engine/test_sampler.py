"""Sampler: greedy, top-k/top-p edges, and seeded reproducibility independent of batch mates."""

from __future__ import annotations

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.sampler import apply_penalties, apply_top_k_top_p, sample, token_logprobs

VOCAB = 1000


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = logits(5)
    assert sample(x, [SamplingParams(temperature=0)] * 5, [0] * 5) == x.argmax(-1).tolist()


def test_top_k_one_is_greedy():
    x = logits(6)
    params = [SamplingParams(temperature=1.3, top_k=1)] * 6
    assert sample(x, params, list(range(6))) == x.argmax(-1).tolist()


def test_tiny_top_p_is_greedy():
    x = logits(6, seed=1)
    params = [SamplingParams(temperature=2.0, top_p=1e-6, seed=s) for s in range(6)]
    assert sample(x, params, [0] * 6) == x.argmax(-1).tolist()


def test_seeded_is_reproducible_and_independent_of_batch_mates():
    x = logits(4, seed=2)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = sample(x[2:3], [seeded], [7])
    mates = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0),
        seeded,
        SamplingParams(temperature=1.5, top_k=50, seed=9),
    ]
    for _ in range(3):
        assert sample(x, mates, [0, 3, 7, 1])[2] == alone[0]
    reordered = sample(x[[2, 0]], [seeded, mates[0]], [7, 0])
    assert reordered[0] == alone[0]


def test_seed_stream_advances_with_output_count():
    x = torch.zeros(1, VOCAB)  # uniform: draws differ from step to step
    p = SamplingParams(temperature=1.0, seed=5)
    draws = [sample(x, [p], [n])[0] for n in range(8)]
    assert len(set(draws)) > 4
    assert draws == [sample(x, [p], [n])[0] for n in range(8)]


def test_sampling_follows_the_distribution():
    torch.manual_seed(0)
    x = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    drawn = torch.tensor(sample(x, [SamplingParams(temperature=1.0)] * 4000, [0] * 4000))
    freq = torch.bincount(drawn, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_top_k_and_top_p_masks():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = apply_top_k_top_p(x, torch.tensor([2, -1]), torch.tensor([1.0, 0.75]))
    kept = torch.isfinite(out)
    # row 0: top-2; row 1: 0.5 + 0.3 reaches 0.75, so the third token is dropped
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False]]
    assert torch.equal(out[kept], x[kept])


def test_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="logit rows"):
        sample(logits(2), [SamplingParams()], [0])


def test_presence_and_frequency_penalties_subtract_per_generated_token():
    x = torch.zeros(2, VOCAB)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(x, [p, SamplingParams()], [[1, 2], [3]], [[7, 7, 9], [7]])
    assert out[0, 7].item() == pytest.approx(-(0.5 + 2 * 0.25))
    assert out[0, 9].item() == pytest.approx(-(0.5 + 0.25))
    assert out[0, 1].item() == 0  # prompt tokens are not penalized by these two
    assert out[1].abs().sum().item() == 0  # the unpenalized row is untouched
    assert x.abs().sum().item() == 0  # the input is not modified


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    x = torch.zeros(1, VOCAB)
    x[0, 1], x[0, 2], x[0, 3] = 2.0, -2.0, 2.0
    out = apply_penalties(x, [SamplingParams(repetition_penalty=2.0)], [[1]], [[2]])
    assert out[0, :4].tolist() == [0.0, 1.0, -4.0, 2.0]


def test_penalties_change_the_greedy_pick():
    x = torch.zeros(1, VOCAB)
    x[0, 5], x[0, 6] = 3.0, 2.5
    p = SamplingParams(temperature=0, frequency_penalty=1.0)
    assert sample(apply_penalties(x, [p], [[]], [[5]]), [p], [1]) == [6]


def test_token_logprobs_of_the_pick_and_the_top():
    x = logits(3, seed=4)
    tokens = x.argmax(-1).tolist()
    out = token_logprobs(x, tokens, [None, 0, 3])
    assert out[0] is None and out[1].top == []
    ref = x.log_softmax(-1)
    assert out[2].logprob == pytest.approx(ref[2, tokens[2]].item(), abs=1e-6)
    assert [t for t, _ in out[2].top] == ref[2].topk(3).indices.tolist()
    assert out[2].top[0] == (tokens[2], pytest.approx(out[2].logprob))
