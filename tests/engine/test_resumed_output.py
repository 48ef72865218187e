"""A request added with output another engine generated (``output_token_ids``: a stream that
migrated) goes on exactly as the undisturbed request would have: greedy and seeded draws,
a grammar (whole, and triggered by a tool call), penalties, and a stop string that straddles
the resume point."""

from __future__ import annotations

import json

import pytest
from tool_chat import FORECAST_PARAMETERS, WEATHER_TOOL, few_shot_tool_calls

from splitserve.common.sampling_params import InvalidParameter, SamplingParams
from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.worker.structured import json_grammar, tool_call_body

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "colours", "count"],
}
STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
JSON_ASK = [{"role": "user", "content": "Describe a flag as JSON: name, colours, count."}]


@pytest.fixture(scope="module")
def llm():
    from splitserve import LLM

    return LLM(max_model_len=512)


def run(engine, rid: str, prompt: list[int], params: SamplingParams, output=None):
    """The request's final output and the text its outputs streamed."""
    engine.add_request(rid, prompt, params, output_token_ids=output)
    final, streamed = None, ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.delta_text
            if out.finished:
                final = out
    return final, streamed


CASES = {
    "greedy": (STORY, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)),
    "seeded": (
        STORY,
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),
    ),
    "json_schema_seeded": (
        JSON_ASK,
        SamplingParams(
            max_tokens=60, temperature=0.8, seed=5, grammar=json_grammar(SCHEMA).grammar
        ),
    ),
    "penalties": (
        STORY,
        SamplingParams(
            max_tokens=24,
            temperature=0,
            presence_penalty=0.5,
            frequency_penalty=0.7,
            repetition_penalty=1.3,
            ignore_eos=True,
        ),
    ),
}


# get_weather with arguments the model would not write unconstrained: the mask decides them.
FORECAST_TOOL = {
    "type": "function",
    "function": {**WEATHER_TOOL["function"], "parameters": FORECAST_PARAMETERS},
}


def _tool_case() -> tuple[list[dict], SamplingParams]:
    g = tool_call_body([FORECAST_TOOL])
    params = SamplingParams(
        max_tokens=40, temperature=0, grammar=g.grammar, grammar_trigger=g.trigger
    )
    return few_shot_tool_calls("Lisbon"), params


@pytest.mark.parametrize("case", [*CASES, "tool_call_body"])
def test_a_resumed_request_goes_on_as_the_undisturbed_one(llm, case):
    messages, params = _tool_case() if case == "tool_call_body" else CASES[case]
    prompt = llm.tokenizer.apply_chat_template(messages)
    ref, _ = run(llm.engine, f"{case}-ref", prompt, params)
    ids = ref.outputs[0].token_ids
    if case == "json_schema_seeded":
        json.loads(ref.outputs[0].text)
    if case == "tool_call_body":  # the call opened early: the grammar is live when resumed
        assert ref.outputs[0].text.startswith('<tool_call>{"name": "get_weather"')
        assert "Portugal" in ref.outputs[0].text
    for k in (1, len(ids) // 2, len(ids) - 2):
        out, streamed = run(llm.engine, f"{case}-{k}", prompt, params, ids[:k])
        assert out.outputs[0].token_ids == ids, k
        assert out.outputs[0].text == ref.outputs[0].text
        assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason
        sent = IncrementalDetokenizer(llm.tokenizer.decode, list(params.stop)).update(ids[:k])
        assert sent + streamed == ref.outputs[0].text  # the stream goes on after what was sent


def test_a_stop_string_that_straddles_the_resume_point_still_stops(llm):
    prompt = llm.tokenizer.apply_chat_template(STORY)
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ids = run(llm.engine, "stop-free", prompt, free)[0].outputs[0].token_ids
    k, stop = next(
        (k, stop)
        for k in range(6, 20)
        if (stop := _straddling(llm.tokenizer.decode(ids[:k]), llm.tokenizer.decode(ids[: k + 1])))
    )
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    ref = run(llm.engine, "stop-ref", prompt, params)[0].outputs[0]
    assert ref.finish_reason == "stop" and len(ref.token_ids) == k + 1
    out = run(llm.engine, "stop-resumed", prompt, params, ids[:k])[0].outputs[0]
    assert (out.text, out.finish_reason, out.token_ids) == (ref.text, "stop", ref.token_ids)


def _straddling(before: str, after: str) -> str | None:
    """Four characters across the end of ``before`` (the text of tokens ..k-1) into
    ``after`` (..k), found nowhere earlier; None if there are no such."""
    stop = before[-2:] + after[len(before) : len(before) + 2]
    ok = len(stop) == 4 and after.startswith(before) and after.find(stop) == len(before) - 2
    return stop if ok else None


def test_output_that_leaves_nothing_to_generate_is_refused(llm):
    params = SamplingParams(max_tokens=3, temperature=0)
    with pytest.raises(InvalidParameter, match="max_tokens"):
        llm.engine.add_request("full", [1, 2, 3], params, output_token_ids=[4, 5, 6])
    with pytest.raises(InvalidParameter, match="output token ids"):
        llm.engine.add_request("bad", [1, 2, 3], params, output_token_ids=[-1])
    assert not llm.engine.has_unfinished_requests()
