"""A finished reply as Responses output items, and a streamed one as the Responses
server-sent events.

A stream reads: ``response.created``, ``response.in_progress``; for the text,
``response.output_item.added`` (a message), ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; for each tool call,
``response.output_item.added`` (a ``function_call``), ``response.function_call_arguments.delta``,
``response.function_call_arguments.done``, ``response.output_item.done``; last
``response.completed`` (``response.incomplete`` when it stopped at ``max_output_tokens``)
with the whole response. Every event carries its ``sequence_number``. Text that may be a
tool call is held back until the reply ends (``worker.tool_calls``): a call's arguments are
known whole only then, so each comes in one delta.

The events of one engine output go out as one write, so a stream broken by a dead worker
holds whole steps: the router resumes it from there (``router/responses_relay.py``). For it
(the router's ``return_token_ids``) each step begins with a ``splitserve.token_ids`` event
naming its tokens (the first also the prompt's), whether their text was released or held
back; these carry no ``sequence_number``. A resumed stream (``ResumedStream``) sends no
``response.created``: it goes on from the dead worker's last event, numbering after it,
in the message item the client has open, with the tool-call filter primed with the output
so far, so it holds back and releases what the first worker's did.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from splitserve.common.responses_api import (
    TOKEN_IDS_EVENT,
    function_call_item,
    item_id,
    message_item,
    output_text,
)
from splitserve.engine.outputs import RequestOutput
from splitserve.worker.async_engine import EngineError, RequestStream
from splitserve.worker.metrics import RequestTracker
from splitserve.worker.tool_calls import ParsedReply, ToolCallStream, parse_tool_calls

# Builds the final response object from the finished output and its output items (storing
# and pinning it on the way); ``head`` the response object before any output.
Finish = Callable[[RequestOutput, list[dict[str, Any]]], Awaitable[dict[str, Any]]]


def status_of(out: RequestOutput) -> str:
    return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"


def output_items(out: RequestOutput, tools: bool) -> list[dict[str, Any]]:
    """A whole reply's output: its text as a message (always one when no tool was called),
    then each tool call as a ``function_call``."""
    text = out.outputs[0].text
    reply = parse_tool_calls(text) if tools else ParsedReply(text)
    status = status_of(out)
    items = []
    if reply.content or not reply.tool_calls:
        items.append(message_item(item_id("msg"), reply.content or "", status))
    for call in reply.tool_calls:
        arguments = call["function"]["arguments"]
        items.append(function_call_item(item_id("fc"), call, arguments, "completed"))
    return items


@dataclass(frozen=True, slots=True)
class ResumedStream:
    """Where a resumed stream goes on from (``ResponsesResume``): the next sequence number,
    the message item the client has open (None: none) and the output's text so far."""

    sequence_number: int
    message_id: str | None
    text: str


def released(text: str, tools: bool) -> str:
    """What a stream released of an output's ``text``: all of it, but with tools offered
    what may be a tool call."""
    return ToolCallStream().feed(text) if tools else text


class _Events:
    """Numbers and serialises the events of one stream."""

    def __init__(self, sequence: int = 0) -> None:
        self.sequence = sequence

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class _TokenIds:
    """``splitserve.token_ids`` events (the router's ``return_token_ids``): unnumbered."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt: list[int] | None = prompt_token_ids  # sent with the first, then None

    def __call__(self, token_ids: list[int]) -> str:
        data: dict[str, Any] = {"type": TOKEN_IDS_EVENT, "token_ids": token_ids}
        if self.prompt is not None:
            data["prompt_token_ids"], self.prompt = self.prompt, None
        return f"event: {TOKEN_IDS_EVENT}\ndata: {json.dumps(data)}\n\n"


class _Message:
    """The streamed text's message item: opened by its first text, closed at the end."""

    def __init__(self, emit: _Events) -> None:
        self.emit = emit
        self.id = item_id("msg")
        self.text: str | None = None  # None: not opened yet

    def delta(self, text: str) -> list[str]:
        out = [] if self.text is not None else self.open()
        self.text = (self.text or "") + text
        fields = {"item_id": self.id, "output_index": 0, "content_index": 0}
        return [*out, self.emit("response.output_text.delta", **fields, delta=text, logprobs=[])]

    def open(self) -> list[str]:
        self.text = ""
        item = message_item(self.id, None, "in_progress")
        part = output_text("")
        return [
            self.emit("response.output_item.added", output_index=0, item=item),
            self.emit(
                "response.content_part.added",
                item_id=self.id,
                output_index=0,
                content_index=0,
                part=part,
            ),
        ]

    def close(self, status: str) -> tuple[list[str], dict[str, Any]]:
        text = self.text or ""
        fields = {"item_id": self.id, "output_index": 0, "content_index": 0}
        item = message_item(self.id, text, status)
        events = [
            self.emit("response.output_text.done", **fields, text=text, logprobs=[]),
            self.emit("response.content_part.done", **fields, part=output_text(text)),
            self.emit("response.output_item.done", output_index=0, item=item),
        ]
        return events, item


def _call_events(emit: _Events, call: dict[str, Any], index: int) -> tuple[list[str], dict]:
    item = item_id("fc")
    arguments = call["function"]["arguments"]
    fields = {"item_id": item, "output_index": index}
    done = function_call_item(item, call, arguments, "completed")
    events = [
        emit(
            "response.output_item.added",
            output_index=index,
            item=function_call_item(item, call, "", "in_progress"),
        ),
        emit("response.function_call_arguments.delta", **fields, delta=arguments),
        emit("response.function_call_arguments.done", **fields, arguments=arguments),
        emit("response.output_item.done", output_index=index, item=done),
    ]
    return events, done


async def response_events(
    stream: RequestStream,
    tracker: RequestTracker,
    head: dict[str, Any],
    tools: bool,
    finish: Finish,
    prompt_token_ids: list[int] | None = None,
    resumed: ResumedStream | None = None,
) -> AsyncIterator[str]:
    """The server-sent events of one streamed response (see the module docstring), one
    string per step; ``prompt_token_ids``: with token-id events."""
    emit = _Events(0 if resumed is None else resumed.sequence_number)
    ids = None if prompt_token_ids is None else _TokenIds(prompt_token_ids)
    message = _Message(emit)
    calls = ToolCallStream() if tools else None
    if resumed is None:
        start = [
            emit("response.created", response=head),
            emit("response.in_progress", response=head),
        ]
        yield "".join([*start, ids([]) if ids else ""])
    else:
        text = calls.feed(resumed.text) if calls else resumed.text
        if resumed.message_id is not None:
            message.id, message.text = resumed.message_id, text
    try:
        async for out in stream:
            tracker.on_output(out)
            events = [ids(out.delta_token_ids)] if ids and out.delta_token_ids else []
            text = calls.feed(out.delta_text) if calls else out.delta_text
            if text:
                events += message.delta(text)
            if out.finished:
                events += await _finished(emit, message, calls, out, finish)
            if events:
                yield "".join(events)
            if out.finished:
                return
    except EngineError as e:
        # Headers are gone already: report in-band, the way OpenAI streams report errors.
        yield emit("error", code="server_error", message=str(e), param=None)
    finally:
        stream.close()  # also when the client left: aborts the request


async def _finished(
    emit: _Events,
    message: _Message,
    calls: ToolCallStream | None,
    out: RequestOutput,
    finish: Finish,
) -> list[str]:
    reply = calls.finish() if calls else ParsedReply(None)
    events: list[str] = []
    if reply.content:
        events += message.delta(reply.content)
    items: list[dict[str, Any]] = []
    if message.text is not None or not reply.tool_calls:
        if message.text is None:
            events += message.open()
        closing, item = message.close(status_of(out))
        events += closing
        items.append(item)
    for call in reply.tool_calls:
        more, item = _call_events(emit, call, len(items))
        events += more
        items.append(item)
    response = await finish(out, items)
    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    events.append(emit(kind, response=response))
    return events
