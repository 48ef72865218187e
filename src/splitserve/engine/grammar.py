"""Grammar-constrained decoding: one llguidance matcher per constrained request, and the token
masks they compute, applied to the logits before sampling.

A request's ``SamplingParams.grammar`` is an llguidance grammar (what
``splitserve.common.structured`` builds). Without a ``grammar_trigger`` it constrains the whole
reply; with one it constrains only what follows each occurrence of the trigger in the output
(a tool call's body after ``<tool_call>``), and the text between stays free.

Masks are computed on a helper thread while the model runs: a mask depends only on the tokens
already consumed, which are known before the step starts, and llguidance computes them in
native code. The step waits for the masks only after its logits exist::

    engine thread:  start(ids) ─┬─ model forward ──────────── apply(logits) ─ sample ─ advance
    mask thread:                └─ compute masks (native) ─┘
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from copy import copy
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.torch
import torch

from splitserve.common.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Constraint:
    """One request's matcher, or, with a trigger, the wait for the trigger."""

    def __init__(self, tokenizer: Any, grammar: str, trigger: str | None) -> None:
        self._tokenizer = tokenizer
        self._grammar = grammar
        self._trigger = trigger.encode() if trigger else None
        self._tail = b""  # the last output bytes, to find a trigger split across tokens
        self.matcher: Any = None if trigger else self._new_matcher()

    def _new_matcher(self) -> Any:
        matcher = llguidance.LLMatcher(self._tokenizer, self._grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    @property
    def active(self) -> bool:
        return self.matcher is not None and not self.matcher.is_error()

    def advance(self, token: int) -> None:
        """Consume a sampled token (the mask allowed it, or the constraint is idle)."""
        if self.matcher is not None:
            if not self.matcher.consume_token(token):
                logger.warning("constraint left: %s", self.matcher.get_error().splitlines()[0])
            done = self.matcher.is_error() or self.matcher.is_accepting()
            if self._trigger is not None and done:
                self.matcher, self._tail = None, b""  # the call closed: free text again
        elif self._trigger is not None:
            self._watch(token)

    def replay(self, tokens: Sequence[int]) -> None:
        """Consume output sampled elsewhere under the same grammar (a resumed stream), as it
        was sampled: the matcher ends where its first worker's did, so the next mask is the
        one that worker would have computed."""
        for token in tokens:
            self.advance(token)

    def _watch(self, token: int) -> None:
        """Free text: look for the trigger, and start the matcher after it."""
        self._tail += self._tokenizer.decode_bytes([token])
        at = self._tail.find(self._trigger)
        if at < 0:
            self._tail = self._tail[-len(self._trigger) :]
            return
        rest, self._tail = self._tail[at + len(self._trigger) :], b""
        self.matcher = self._new_matcher()
        # The token that completed the trigger may carry the body's first bytes already.
        if rest and not self.matcher.consume_tokens(self._tokenizer.tokenize_bytes(rest)):
            self.matcher = None


@dataclass(slots=True)
class PendingMasks:
    """Masks being computed for the rows ``rows`` of the step's sampled logits."""

    future: Future
    bitmask: torch.Tensor  # [rows in the step, vocab / 32] int32, bit set: token allowed
    rows: list[int]


class GrammarMasks:
    """The constrained requests of one model runner, keyed by request id."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        backend = copy(tokenizer.backend)  # as llguidance reads it: no padding or truncation
        backend.no_padding()
        backend.no_truncation()
        self.tokenizer = llguidance.LLTokenizer(
            backend.to_str(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id
        )
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._constraints: dict[str, Constraint] = {}

    def add(
        self, request_id: str, grammar: str, trigger: str | None = None, replay: Sequence[int] = ()
    ) -> None:
        """Compile ``grammar`` for a request (``ValueError`` if it does not compile) and
        consume its ``replay`` tokens, the output it already has."""
        constraint = Constraint(self.tokenizer, grammar, trigger)
        constraint.replay(replay)
        self._constraints[request_id] = constraint

    def remove(self, request_id: str) -> None:
        self._constraints.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._constraints

    def start(self, request_ids: list[str]) -> PendingMasks | None:
        """Start computing the masks of the step whose sampled rows are ``request_ids``."""
        if not self._constraints:
            return None
        rows = [
            (c.matcher, i)
            for i, rid in enumerate(request_ids)
            if (c := self._constraints.get(rid)) is not None and c.active
        ]
        if not rows:
            return None
        bitmask = torch.full(
            (len(request_ids), (self.vocab_size + 31) // 32), -1, dtype=torch.int32
        )
        future = self._thread.submit(
            llguidance.torch.fill_next_token_bitmask_par, self._executor, rows, bitmask
        )
        return PendingMasks(future, bitmask, [i for _, i in rows])

    def apply(self, logits: torch.Tensor, pending: PendingMasks | None) -> torch.Tensor:
        """``logits`` with every token the grammar forbids at -inf (a new tensor if masked)."""
        if pending is None:
            return logits
        pending.future.result()
        rows = torch.tensor(pending.rows, dtype=torch.long)
        allowed = unpack_bitmask(pending.bitmask[rows], logits.shape[-1])
        logits = logits.clone()
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        return logits

    def advance(self, request_ids: list[str], tokens: list[int]) -> None:
        """Feed each constrained request the token it was just given."""
        if not self._constraints:
            return
        for rid, token in zip(request_ids, tokens, strict=True):
            c = self._constraints.get(rid)
            if c is not None:
                c.advance(token)


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[N, words]`` int32 bitmask (bit ``t % 32`` of word ``t // 32``) -> ``[N, vocab]`` bool."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
