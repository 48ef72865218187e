"""The Hermes tool-call parser, whole and streamed."""

from __future__ import annotations

import json

import pytest

from splitserve.worker.tool_calls import (
    ToolCallStream,
    finish_reason_with_calls,
    parse_tool_calls,
)

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def names_and_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_plain_text_has_no_calls():
    reply = parse_tool_calls("Paris is sunny.")
    assert reply.content == "Paris is sunny." and reply.tool_calls == []


def test_one_call_with_text_before_it():
    reply = parse_tool_calls(f"Let me check.\n{CALL}")
    assert reply.content == "Let me check."
    assert names_and_args(reply.tool_calls) == [("get_weather", {"city": "Paris"})]
    call = reply.tool_calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_")


def test_two_calls_and_an_unclosed_last_block():
    second = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}'
    reply = parse_tool_calls(CALL + "\n" + second)
    assert reply.content is None
    assert names_and_args(reply.tool_calls) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "CET"}),
    ]


@pytest.mark.parametrize(
    "body", ['{"name": "f", "arguments": {', '["f"]', '{"arguments": {}}', '{"name": 3}']
)
def test_a_malformed_block_leaves_the_whole_reply_as_content(body):
    text = f"{CALL}<tool_call>{body}</tool_call>"
    reply = parse_tool_calls(text)
    assert reply.content == text and reply.tool_calls == []


def test_finish_reason_is_tool_calls_only_for_a_reply_that_stopped():
    calls = parse_tool_calls(CALL).tool_calls
    assert finish_reason_with_calls("stop", calls) == "tool_calls"
    assert finish_reason_with_calls("length", calls) == "length"
    assert finish_reason_with_calls("stop", []) == "stop"


def stream(text: str, step: int) -> tuple[str, object]:
    s = ToolCallStream()
    sent = "".join(s.feed(text[i : i + step]) for i in range(0, len(text), step))
    return sent, s.finish()


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streaming_matches_the_whole_parse_for_any_chunking(step):
    text = f"Checking <tool the weather.\n{CALL}"
    sent, end = stream(text, step)
    assert "<tool_call>" not in sent
    assert sent + (end.content or "") == "Checking <tool the weather.\n"
    assert names_and_args(end.tool_calls) == names_and_args(parse_tool_calls(text).tool_calls)


@pytest.mark.parametrize("step", [1, 4])
def test_streaming_releases_text_that_turned_out_not_to_be_a_call(step):
    for text in ("a <tool", "x <tool_cal y", f"{CALL[:-3]} oops {{"):
        sent, end = stream(text, step)
        if "<tool_call>" in text:
            assert end.tool_calls == [] and sent + end.content == text
        else:
            assert sent + (end.content or "") == text and end.tool_calls == []


def test_text_is_held_back_only_while_it_may_open_a_call():
    s = ToolCallStream()
    assert s.feed("Hello <to") == "Hello "
    assert s.feed("day") == "<today"
    assert s.feed(" <tool_call>{") == " "
    assert s.feed('"name": "f"}') == ""
