"""Picking the next token per sequence from its logits: penalties, greedy, temperature, top-k,
top-p; and the log-probabilities of what was picked.

Sampling uses the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. per vocab
entry draws from ``p``. The noise for a seeded request comes from its own generator, seeded
from ``(seed, num_output_tokens)``, so its draws do not depend on batch mates, on batch order,
or on whether it was preempted and recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.plan import TokenLogprobs
from splitserve.models.fused_ops import argmax

_SEED_MIX = 1_000_003
_SEED_MASK = (1 << 63) - 1


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], num_output_tokens: Sequence[int]
) -> list[int]:
    """One token id per row of ``logits`` (``[N, vocab]``, float32).

    ``num_output_tokens[i]`` is how many tokens row i's request has generated so far; it
    indexes a seeded request's random stream.
    """
    if logits.shape[0] != len(params) or len(params) != len(num_output_tokens):
        raise ValueError(
            f"sample: {logits.shape[0]} logit rows for {len(params)} params and "
            f"{len(num_output_tokens)} output counts"
        )
    tokens = argmax(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        picked = [params[i] for i in rows]
        counts = [num_output_tokens[i] for i in rows]
        index = torch.tensor(rows, device=logits.device)
        tokens[index] = _sample_rows(logits[index], picked, counts)
    return tokens.tolist()


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], counts: list[int]
) -> torch.Tensor:
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
        logits = apply_top_k_top_p(
            logits,
            torch.tensor(top_k, device=device),
            torch.tensor(top_p, device=device, dtype=logits.dtype),
        )
    probs = logits.softmax(dim=-1)
    noise = _exponential_noise(probs, params, counts)
    return argmax(probs / noise)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k (``k <= 0``: all) and then outside the
    smallest set of top tokens whose probability reaches ``top_p`` (the best always stays)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    sorted_logits = sorted_logits.masked_fill(ranks.unsqueeze(0) >= k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _exponential_noise(
    probs: torch.Tensor, params: list[SamplingParams], counts: list[int]
) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_()  # global RNG for unseeded rows
    for i, (p, n) in enumerate(zip(params, counts, strict=True)):
        if p.seed is not None:
            noise[i].exponential_(generator=request_generator(p.seed, n, probs.device))
    # Exp(1) can round to 0; dividing by it must not turn a zero probability into a pick.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def request_generator(
    seed: int, num_output_tokens: int, device: torch.device | str = "cpu"
) -> torch.Generator:
    """The generator for a seeded request's ``num_output_tokens``-th sampled token."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * _SEED_MIX + num_output_tokens) & _SEED_MASK)
    return g


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int] | None],
    outputs: Sequence[Sequence[int] | None],
) -> torch.Tensor:
    """``logits`` with each penalized row's presence, frequency and repetition penalties
    applied (see ``SamplingParams``); ``prompts[i]`` and ``outputs[i]`` are row i's prompt
    and generated ids. Returns ``logits`` itself when no row is penalized."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i in rows:
        p, row = params[i], logits[i]
        out = torch.tensor(list(outputs[i] or ()), dtype=torch.long, device=logits.device)
        if p.repetition_penalty != 1:
            seen = torch.tensor(
                sorted(set(prompts[i] or ()) | set(outputs[i] or ())),
                dtype=torch.long,
                device=logits.device,
            )
            values = row[seen]
            penalty = p.repetition_penalty
            row[seen] = torch.where(values > 0, values / penalty, values * penalty)
        if out.numel() and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], num_top: Sequence[int | None]
) -> list[TokenLogprobs | None]:
    """Per row with ``num_top[i]`` set: the log-probability of ``tokens[i]`` under
    ``log_softmax(logits[i])`` and the ``num_top[i]`` most likely tokens with theirs."""
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    rows = [i for i, k in enumerate(num_top) if k is not None]
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    logprobs = logits[index].float().log_softmax(dim=-1)
    picked = torch.tensor([tokens[i] for i in rows], device=logits.device)
    chosen = logprobs.gather(1, picked.unsqueeze(1)).squeeze(1).tolist()
    k_max = max(num_top[i] for i in rows)
    top_values, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
    for j, i in enumerate(rows):
        k = num_top[i]
        top = []
        if k:
            top = list(zip(top_ids[j, :k].tolist(), top_values[j, :k].tolist(), strict=True))
        out[i] = TokenLogprobs(tokens[i], chosen[j], top)
    return out
