"""Chat sessions' simulated prompts carry the chat template's tokens when asked to."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.sim.chat import append_prompt, append_reply
from splitserve.sim.cluster import Cluster
from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.hardware import get_hardware
from splitserve.sim.models import get_model
from splitserve.workload.sessions import (
    API_COMPLETIONS,
    AgenticConfig,
    Segment,
    SessionSpec,
    TurnSpec,
)


def ids(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


SPEC = SessionSpec(
    "s",
    0.0,
    0,
    (
        TurnSpec(
            0.0,
            (Segment("system", ids(1000, 100)), Segment("user", ids(2000, 20))),
            8,
            ids(3000, 8),
        ),
        TurnSpec(1.0, (Segment("tool", ids(4000, 40)),), 4, ids(5000, 4)),
    ),
)


def prompts(spec: SessionSpec, chat_template: bool) -> list[tuple[int, int]]:
    cfg = SimConfig(get_model("llama3-8b"), get_hardware("h100"), chat_template=chat_template)
    records = Cluster(cfg, Deployment(collocated=1)).run(iter([spec]))
    return [(r.prompt_tokens, r.cached_tokens) for r in sorted(records, key=lambda r: r.turn)]


@pytest.mark.parametrize("chat_template", [False, True])
def test_chat_prompts_carry_the_template_tokens_and_reuse_the_cache(chat_template):
    got = prompts(SPEC, chat_template)
    if not chat_template:  # the contents: 120 tokens, then + 8 reply + 40 tool result
        assert got == [(120, 0), (168, 112)]  # 127 computed: 7 full blocks
    else:
        # Turn 0: two messages of 3 + 2 template tokens each, then the reply's opening (4):
        # 134. Turn 1 adds the reply (8), its closing (2), the tool message (5 + 40) and the
        # next opening (4): 193. Turn 0 computed 141 tokens: 8 full blocks are reused.
        assert got == [(134, 0), (193, 128)]


def test_chat_prompts_are_as_long_as_the_bundled_models_rendering():
    """Each turn of an agentic session, rendered by the bundled model's own chat template
    (as a real worker does with the messages bench sends), against the simulated prompt."""
    from splitserve.common.tokenizer import Tokenizer
    from splitserve.models.loader import default_model_path

    tok = Tokenizer.from_gguf(default_model_path())  # the bundled model is one GGUF file
    spec = next(iter(AgenticConfig(min_tool_calls=3, max_tool_calls=3).sessions(1.0)))
    context: list[int] = []
    for k, turn in enumerate(spec.turns):
        append_prompt(context, turn.segments, True)
        assert len(context) == len(tok.apply_chat_template(spec.messages(k))), k
        append_reply(context, turn.output_ids, True)


def test_completions_sessions_have_no_template():
    spec = dataclasses.replace(SPEC, api=API_COMPLETIONS)
    assert prompts(spec, True) == prompts(spec, False) == [(120, 0), (168, 112)]
