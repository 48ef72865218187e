"""Grammar masks in the model runner: the bitmask layout, triggered constraints, and greedy
determinism with masks (alone == batched)."""

from __future__ import annotations

import json

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.grammar import Constraint, unpack_bitmask
from splitserve.worker.structured import json_grammar, tool_call_body

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["colour", "count"],
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def llm():
    from splitserve import LLM

    return LLM(max_model_len=512)


@pytest.fixture(scope="module")
def masks(llm):
    return llm.engine.runner.grammar_masks()


def test_unpack_bitmask_bit_order():
    mask = torch.tensor([[0b101, -(1 << 31)]], dtype=torch.int32)  # bit 31 alone: int32 min
    allowed = unpack_bitmask(mask, 64)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, 63]
    assert unpack_bitmask(mask, 40).shape == (1, 40)


def _feed(constraint: Constraint, tokenizer, text: str) -> None:
    for t in tokenizer.encode(text, add_special_tokens=False):
        constraint.advance(t)


def test_triggered_constraint_opens_with_the_call_and_closes_after_it(llm, masks):
    g = tool_call_body([TOOL])
    c = Constraint(masks.tokenizer, g.grammar, g.trigger)
    _feed(c, llm.tokenizer, "Let me check. ")
    assert not c.active  # free text
    _feed(c, llm.tokenizer, '<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert c.active and not c.matcher.is_accepting()
    _feed(c, llm.tokenizer, 'ty": "Rome"}}</tool_call>')
    assert not c.active  # the call closed: free again, and the next call opens a new one
    _feed(c, llm.tokenizer, " And <tool_call>")
    assert c.active


def test_a_call_that_breaks_the_schema_before_the_mask_applies_leaves_the_text_free(llm, masks):
    g = tool_call_body([TOOL])
    c = Constraint(masks.tokenizer, g.grammar, g.trigger)
    _feed(c, llm.tokenizer, '<tool_call>{"nome": 1')
    assert not c.active


def test_a_grammar_that_does_not_compile_is_a_value_error(masks):
    with pytest.raises(ValueError, match="does not compile"):
        masks.add("bad", '{"grammars": [{"lark_grammar": "start: nope"}]}')


def _constrained(max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0, grammar=json_grammar(SCHEMA).grammar
    )


def test_greedy_with_a_mask_alone_equals_batched(llm):
    prompt = [{"role": "user", "content": "Pick a colour and a count, as JSON."}]
    alone = llm.chat(prompt, _constrained())[0].outputs[0]
    json.loads(alone.text)
    mates = [
        [{"role": "user", "content": "Write a haiku about rain."}],
        prompt,
        [{"role": "user", "content": "What is 2 + 2? Answer in JSON."}],
        [{"role": "user", "content": "Say hello."}],
    ]
    params = [
        SamplingParams(max_tokens=30, temperature=0),
        _constrained(),
        _constrained(),
        SamplingParams(max_tokens=20, temperature=0.8, seed=3),
    ]
    batched = llm.chat(mates, params)
    assert batched[1].outputs[0].token_ids == alone.token_ids
    json.loads(batched[2].outputs[0].text)


def test_a_finished_request_releases_its_matcher(llm):
    llm.chat([{"role": "user", "content": "JSON please."}], _constrained(8))
    assert not llm.engine.runner._grammar._constraints  # noqa: SLF001
