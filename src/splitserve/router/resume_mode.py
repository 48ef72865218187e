"""How a stream whose decode worker died mid-way is resumed on the next one: decided once per
request, when it arrives (``resume_mode``), from its fields and the workers' engine.

- ``CONTINUE`` (builtin workers, every stream): the request again with the router's
  ``resume`` field; the worker replays the delivered ids through the request's whole state.
- ``EXTEND`` (vLLM workers): a ``/v1/completions`` of the prompt's and the delivered ids. It
  costs one prefill, but carries no state besides a few sampling fields, so only streams whose
  later tokens depend on nothing else take it: greedy or unseeded text, a text completion's
  ``logprobs``.
- ``REPLAY`` (vLLM workers, everything else): the client's request again, unchanged; the
  chunks the client already has are skipped, their ids checked (``router/replay.py``). Greedy
  decoding and vLLM's per-request seeded draws reproduce the same tokens, and with them the
  tool parser's, the grammar's and the penalties' state, log-probabilities and every choice of
  ``n``. It costs decoding the delivered tokens again.
- None: not resumed (the stream ends with an error event if its worker dies). On vLLM,
  ``echo``: with ``return_token_ids`` vLLM leaves the echoed prompt out of the text.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class ResumeMode(StrEnum):
    CONTINUE = "continue"
    EXTEND = "extend"
    REPLAY = "replay"


# Fields an ``EXTEND`` leg carries (``migration._CARRIED``, a text completion's ``logprobs``)
# or that do not change the tokens after the resume point. A vLLM request with any other
# field set to anything but its neutral value is replayed instead.
_EXTENDABLE = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "ignore_eos",
        "user",
        "stream",
        "stream_options",
        "return_token_ids",
        "cache_salt",
        "metadata",
        "store",
        "parallel_tool_calls",  # only with tools, which are replayed
    }
)
# Neutral values: the field set so changes nothing.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "repetition_penalty": (1,),
    "tool_choice": ("none",),
    "response_format": ({"type": "text"},),
}


def resume_mode(body: dict[str, Any], engine: str = "builtin") -> ResumeMode | None:
    """How a stream of ``body`` is resumed on ``engine``'s workers (None: it is not)."""
    if engine != "vllm":
        return ResumeMode.CONTINUE
    if body.get("echo"):
        return None
    extendable = _EXTENDABLE if "messages" in body else _EXTENDABLE | {"logprobs"}
    if body.get("seed") is not None and body.get("temperature") != 0:
        return ResumeMode.REPLAY  # seeded draws: only the whole request replays them
    tools_off = body.get("tool_choice") == "none"
    for name, value in body.items():
        if name in extendable or (name == "tools" and tools_off) or name == "seed":
            continue
        if value in (None, False, 0, "", [], {}) or value in _NEUTRAL.get(name, ()):
            continue
        return ResumeMode.REPLAY
    return ResumeMode.EXTEND
