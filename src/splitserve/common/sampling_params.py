"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` means greedy. ``top_k <= 0`` disables top-k. A ``seed`` makes a
    sampled request reproducible regardless of what else shares its batch.

    Penalties follow OpenAI and vLLM: ``presence_penalty`` is subtracted from the logit of
    every token already generated, ``frequency_penalty`` times the number of times it was
    generated; ``repetition_penalty`` (> 1 discourages) divides positive and multiplies
    negative logits of every token in the prompt or the output. They apply before greedy
    picks too. ``logprobs``: return the log-probability of each generated token and of its
    ``logprobs`` most likely alternatives (None: nothing). ``grammar``: an llguidance grammar
    the output must follow (``engine/grammar.py``), from ``grammar_trigger`` on if set.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    grammar: str | None = None
    grammar_trigger: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            f"must be >= 0, got {self.temperature!r}",
        )
        _check(
            _is_number(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            f"must be in (0, 1], got {self.top_p!r}",
        )
        _check(isinstance(self.top_k, int), "top_k", f"must be an integer, got {self.top_k!r}")
        _check(
            self.seed is None or isinstance(self.seed, int),
            "seed",
            f"must be an integer, got {self.seed!r}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _is_number(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}"
            )
        _check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty!r}",
        )
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs",
            f"must be an integer in [0, 20], got {self.logprobs!r}",
        )

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(param, f"{param} {message}")


class InvalidParameter(ValueError):
    """A bad request parameter; ``param`` names it (the HTTP layer maps it to a 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
