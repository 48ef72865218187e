"""Workloads: what a client (or the simulator) sends, when, and how long each reply is.

A workload is a stream of sessions in arrival order. A session is a list of turns. Before
turn k the client waits ``pause_s`` after turn k-1 finished (a tool running, a user
thinking), appends the turn's segments to the conversation and re-sends all of it, as an
OpenAI-API agent does::

    turn 0:  [system][task]                                   -> reply r0 (output_len tokens)
    turn 1:  [system][task] r0 [tool result 1]                 -> reply r1
    turn 2:  [system][task] r0 [tool result 1] r1 [result 2]  -> reply r2 (the final answer)

Every segment is a run of token ids. Chat workloads draw them from ``vocab`` (one word per
id, so the text has exactly that many tokens); token-level workloads (trace replay, random)
send the ids as a ``/v1/completions`` prompt. ``output_ids`` stand in for the model's replies
wherever real ones are not known (the simulator); a live client appends the real replies.

Everything is seeded: session i's content depends only on (seed, i), and arrival times only
on (seed, rate), so a rate sweep replays the same sessions, only closer together.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from splitserve.workload.vocab import TEXT_ID_BASE, WORDS, text_of

API_CHAT = "chat"  # /v1/chat/completions with messages
API_COMPLETIONS = "completions"  # /v1/completions with a token-id prompt
# Token-level workloads draw ids here: clear of the default model's special tokens (< 20)
# and inside every vocabulary this project serves (SmolLM2: 49,152).
TOKEN_ID_LO, TOKEN_ID_HI = 1000, 49000

# Independent random streams of one seed (numpy SeedSequence entropy lists).
_ARRIVALS, _SESSION, _SHARED = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of prompt tokens appended to the conversation; ``role`` is its chat role
    (``system``, ``user``, ``tool``) or ``prompt`` for token-level workloads."""

    role: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TurnSpec:
    """One request of a session."""

    pause_s: float  # wait after the previous turn finished; 0 for the first turn
    segments: tuple[Segment, ...]  # appended to the conversation before this turn
    output_len: int  # max_tokens, sent with ignore_eos so the reply is exactly this long
    output_ids: tuple[int, ...]  # synthetic reply (len == output_len) where the real is unknown

    @property
    def new_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)


@dataclass(frozen=True, slots=True)
class SessionSpec:
    """A conversation: its arrival, its agent type and its turns."""

    session_id: str
    arrival_s: float
    agent_type: int
    turns: tuple[TurnSpec, ...]
    api: str = API_CHAT
    sticky: bool = True  # send X-Session-Id (trace replay leaves placement to the prefix)
    # Whose KV it is: a tenant's blocks hash from a root salted with its name
    # (``common.kv_hash.root_hash``), so no other tenant's prompt hits them; "": the default.
    tenant: str = ""

    def prompt_token_ids(self, k: int, outputs: Sequence[Sequence[int]] | None = None) -> list[int]:
        """The token view of turn k's whole prompt: every earlier segment and reply, then
        turn k's segments. ``outputs`` are the real replies of turns < k (default: synthetic)."""
        ids: list[int] = []
        for j in range(k + 1):
            for seg in self.turns[j].segments:
                ids.extend(seg.token_ids)
            if j < k:
                ids.extend(outputs[j] if outputs is not None else self.turns[j].output_ids)
        return ids

    def input_len(self, k: int) -> int:
        """Turn k's prompt length in the token view (synthetic replies)."""
        return len(self.prompt_token_ids(k))

    def messages(self, k: int, outputs: Sequence[str] | None = None) -> list[dict[str, str]]:
        """Turn k's chat messages: ``outputs`` are the real replies of turns < k as text
        (default: the synthetic replies' text)."""
        msgs: list[dict[str, str]] = []
        for j in range(k + 1):
            msgs.extend(
                {"role": s.role, "content": text_of(s.token_ids)} for s in self.turns[j].segments
            )
            if j < k:
                reply = outputs[j] if outputs is not None else text_of(self.turns[j].output_ids)
                msgs.append({"role": "assistant", "content": reply})
        return msgs

    def at(self, arrival_s: float) -> SessionSpec:
        return dataclasses.replace(self, arrival_s=arrival_s)


class Workload(Protocol):
    """A named, seeded source of sessions. ``rate`` is sessions per second (None: all at
    time 0, for closed-loop runs); trace replays compress their own timeline to it."""

    name: str
    seed: int

    def sessions(self, rate: float | None) -> Iterator[SessionSpec]: ...

    def describe(self) -> str: ...


def within(sessions: Iterator[SessionSpec], duration_s: float) -> Iterator[SessionSpec]:
    """The sessions arriving before ``duration_s``."""
    for s in sessions:
        if s.arrival_s >= duration_s:
            return
        yield s


def poisson_arrivals(rate: float | None, seed: int) -> Iterator[float]:
    """0, then exponential gaps of mean 1/rate. The unit draws depend only on the seed, so
    two rates give the same sequence scaled in time. ``rate`` None: all at 0."""
    rng = np.random.default_rng([seed, _ARRIVALS])
    t = 0.0
    while True:
        yield t
        gap = rng.standard_exponential()
        t += 0.0 if rate is None else gap / rate


def session_rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, _SESSION, index])


class Draws(Protocol):
    """What a session draws from its random stream: its numpy ``Generator``, or the same
    draws made ahead in another process and replayed in order (``sim/feed.py``)."""

    def integers(self, low: int, high: int | None = None, size: int | None = None): ...

    def standard_normal(self) -> float: ...


def session_rngs(seed: int) -> Iterator[np.random.Generator]:
    """Session i's own stream, for i = 0, 1, ...: its draws depend only on (seed, i)."""
    for i in itertools.count():
        yield session_rng(seed, i)


# Every id as one shared int object. A simulated cluster keeps the tokens of every cached
# block (millions of blocks at scale): ids drawn as fresh ints cost an object per token.
# (An object array indexed by the drawn ids gives those objects as fast as ``tolist`` makes
# new ones.)
_IDS = np.array(list(range(max(TOKEN_ID_HI, TEXT_ID_BASE + len(WORDS)))), dtype=object)


def text_ids(rng: Draws, n: int) -> tuple[int, ...]:
    return tuple(_IDS[rng.integers(TEXT_ID_BASE, TEXT_ID_BASE + len(WORDS), n)].tolist())


def token_ids(rng: Draws, n: int) -> tuple[int, ...]:
    return tuple(_IDS[rng.integers(TOKEN_ID_LO, TOKEN_ID_HI, n)].tolist())


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A log-normal distribution by its median and the sigma of its log (0: constant)."""

    median: float
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if self.median < 0 or self.sigma < 0:
            raise ValueError(f"log-normal median and sigma must be >= 0, got {self}")

    def sample(self, rng: Draws) -> float:
        return self.median * math.exp(self.sigma * rng.standard_normal())

    @classmethod
    def parse(cls, text: str) -> LogNormal:
        """``MEDIAN`` or ``MEDIAN,SIGMA``."""
        try:
            parts = [float(p) for p in text.split(",")]
        except ValueError:
            raise ValueError(f"expected MEDIAN[,SIGMA], got {text!r}") from None
        if len(parts) not in (1, 2):
            raise ValueError(f"expected MEDIAN[,SIGMA], got {text!r}")
        return cls(*parts)


def _turn(pause_s: float, segments: Sequence[Segment], output_len: int, rng: Draws) -> TurnSpec:
    return TurnSpec(pause_s, tuple(segments), output_len, text_ids(rng, output_len))


@dataclass(frozen=True, slots=True)
class AgenticConfig:
    """Agent sessions: a task, tool calls with short structured replies, a final answer.

    Sessions arrive as a Poisson process and belong to one of ``agent_types`` agents; agents
    of one type share a system prompt (the tool definitions), so it is cached across
    sessions. Each tool call costs a pause (the tool running) and returns a result that the
    next turn appends as a ``tool`` message.
    """

    agent_types: int = 4
    system_tokens: int = 384
    task_tokens: int = 48
    min_tool_calls: int = 2
    max_tool_calls: int = 6
    tool_call_tokens: int = 24
    answer_tokens: int = 96
    tool_result_tokens: LogNormal = LogNormal(96, 0.5)
    tool_pause_s: LogNormal = LogNormal(1.0, 0.6)
    seed: int = 0
    name: str = field(default="agentic", init=False)

    def __post_init__(self) -> None:
        _positive(self, "agent_types", "tool_call_tokens", "answer_tokens")
        if not 0 <= self.min_tool_calls <= self.max_tool_calls:
            raise ValueError("need 0 <= min_tool_calls <= max_tool_calls")

    def sessions(
        self, rate: float | None, rngs: Iterator[Draws] | None = None
    ) -> Iterator[SessionSpec]:
        """``rngs``: each session's draws (default: ``session_rngs(seed)``)."""
        shared = np.random.default_rng([self.seed, _SHARED])
        systems = [text_ids(shared, self.system_tokens) for _ in range(self.agent_types)]
        streams = session_rngs(self.seed) if rngs is None else rngs
        for i, (t, rng) in enumerate(zip(poisson_arrivals(rate, self.seed), streams, strict=False)):
            yield self._session(i, t, systems, rng)

    def _session(
        self, i: int, arrival_s: float, systems: list[tuple[int, ...]], rng: Draws
    ) -> SessionSpec:
        kind = int(rng.integers(self.agent_types))
        opening = [
            Segment("system", systems[kind]),
            Segment("user", text_ids(rng, self.task_tokens)),
        ]
        calls = int(rng.integers(self.min_tool_calls, self.max_tool_calls + 1))
        turns = [_turn(0.0, opening, self.tool_call_tokens if calls else self.answer_tokens, rng)]
        for c in range(calls):
            result = Segment(
                "tool", text_ids(rng, max(1, round(self.tool_result_tokens.sample(rng))))
            )
            out = self.tool_call_tokens if c < calls - 1 else self.answer_tokens
            turns.append(_turn(self.tool_pause_s.sample(rng), [result], out, rng))
        return SessionSpec(f"agent{kind}-s{i}", arrival_s, kind, tuple(turns))

    def describe(self) -> str:
        return (
            f"agentic: {self.agent_types} agent types, system {self.system_tokens} tok, "
            f"task {self.task_tokens} tok, {self.min_tool_calls}-{self.max_tool_calls} tool calls "
            f"of {self.tool_call_tokens} tok, answer {self.answer_tokens} tok, tool result "
            f"~{self.tool_result_tokens.median:g} tok, tool pause ~{self.tool_pause_s.median:g} s"
        )


@dataclass(frozen=True, slots=True)
class MultiRoundQAConfig:
    """Users chatting with a shared system prompt and a growing history (the shape of
    LMCache's and vLLM production-stack's multi-round QA benchmark)."""

    system_tokens: int = 256
    question_tokens: int = 32
    answer_tokens: int = 64
    rounds: int = 4
    think_s: LogNormal = LogNormal(2.0, 0.0)
    seed: int = 0
    name: str = field(default="multi-round-qa", init=False)

    def __post_init__(self) -> None:
        _positive(self, "question_tokens", "answer_tokens", "rounds")

    def sessions(
        self, rate: float | None, rngs: Iterator[Draws] | None = None
    ) -> Iterator[SessionSpec]:
        system = text_ids(np.random.default_rng([self.seed, _SHARED]), self.system_tokens)
        streams = session_rngs(self.seed) if rngs is None else rngs
        for i, (t, rng) in enumerate(zip(poisson_arrivals(rate, self.seed), streams, strict=False)):
            turns = []
            for r in range(self.rounds):
                question = Segment("user", text_ids(rng, self.question_tokens))
                opening = [Segment("system", system)] if r == 0 and self.system_tokens else []
                pause = 0.0 if r == 0 else self.think_s.sample(rng)
                turns.append(_turn(pause, [*opening, question], self.answer_tokens, rng))
            yield SessionSpec(f"user{i}", t, 0, tuple(turns))

    def describe(self) -> str:
        return (
            f"multi-round-qa: system {self.system_tokens} tok, {self.rounds} rounds of "
            f"{self.question_tokens} tok questions / {self.answer_tokens} tok answers, "
            f"think ~{self.think_s.median:g} s"
        )


@dataclass(frozen=True, slots=True)
class RandomConfig:
    """Single-turn requests of fixed lengths with random token ids: micro-benchmarks."""

    input_len: int = 256
    output_len: int = 32
    seed: int = 0
    name: str = field(default="random", init=False)

    def __post_init__(self) -> None:
        _positive(self, "input_len", "output_len")

    def sessions(
        self, rate: float | None, rngs: Iterator[Draws] | None = None
    ) -> Iterator[SessionSpec]:
        streams = session_rngs(self.seed) if rngs is None else rngs
        for i, (t, rng) in enumerate(zip(poisson_arrivals(rate, self.seed), streams, strict=False)):
            prompt = Segment("prompt", token_ids(rng, self.input_len))
            turn = TurnSpec(0.0, (prompt,), self.output_len, token_ids(rng, self.output_len))
            yield SessionSpec(f"r{i}", t, 0, (turn,), API_COMPLETIONS, sticky=False)

    def describe(self) -> str:
        return f"random: input {self.input_len} tok, output {self.output_len} tok"


def _positive(config: object, *names: str) -> None:
    for name in names:
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
