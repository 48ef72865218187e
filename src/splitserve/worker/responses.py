"""Engine outputs → OpenAI responses: whole ones, and server-sent-event streams.

Stream chunks are built as plain dicts and ``json.dumps``-ed: they are the hot path (one per
token per client) and their exact shape (``"finish_reason": null``, ``"usage": null`` only
when usage was asked for) matters to strict clients.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from splitserve.common.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    ResponseMessage,
    Usage,
    now,
)
from splitserve.engine.outputs import RequestOutput
from splitserve.worker.async_engine import EngineError, RequestStream
from splitserve.worker.logprobs import LogprobFormatter
from splitserve.worker.metrics import RequestTracker
from splitserve.worker.prepare import Resumed
from splitserve.worker.tool_calls import (
    ParsedReply,
    ToolCallStream,
    finish_reason_with_calls,
    parse_tool_calls,
)

DONE = "data: [DONE]\n\n"


def usage_of(outs: list[RequestOutput], ended: int = 0) -> Usage:
    """A request's usage over its choices, as OpenAI counts it: the prompt once (with what
    was cached of it when choice 0 started), the completion tokens of every choice (and
    ``ended`` more: those of a resumed request's choices that had ended). A resumed stream's
    cache may have held some of its output too: only the prompt's count."""
    first = outs[0]
    completion = ended + sum(len(out.outputs[0].token_ids) for out in outs)
    prompt = len(first.prompt_token_ids)
    return Usage.of(prompt, completion, min(first.num_cached_tokens, prompt))


def token_id_fields(out: RequestOutput, on: bool) -> tuple[dict, dict]:
    """The ``return_token_ids`` extension's (response, choice) fields; empty when off."""
    if not on:
        return {}, {}
    return {"prompt_token_ids": out.prompt_token_ids}, {"token_ids": out.outputs[0].token_ids}


def chat_response(
    request_id: str,
    model: str,
    outs: list[RequestOutput],
    kv_transfer_params: dict | None,
    token_ids: bool = False,
    tools: bool = False,
    logprobs: LogprobFormatter | None = None,
    parallel_tool_calls: bool = True,
) -> ChatCompletionResponse:
    """The final outputs of the request's choices (in index order) as one response.
    ``tools``: the request offered tools, so calls in each reply become ``tool_calls`` (only
    the first without ``parallel_tool_calls``). ``logprobs``: the request asked for them."""
    choices = []
    for index, out in enumerate(outs):
        completion = out.outputs[0]
        reply = parse_tool_calls(completion.text) if tools else ParsedReply(completion.text)
        calls = reply.tool_calls if parallel_tool_calls else reply.tool_calls[:1]
        choice = ChatChoice(
            index=index,
            message=ResponseMessage(content=reply.content, tool_calls=calls),
            finish_reason=finish_reason_with_calls(completion.finish_reason, calls),
            logprobs=_logprobs_of(out, logprobs, chat=True),
            **token_id_fields(out, token_ids)[1],
        )
        choices.append(choice)
    return ChatCompletionResponse(
        id=request_id,
        model=model,
        choices=choices,
        usage=usage_of(outs),
        kv_transfer_params=kv_transfer_params,
        **token_id_fields(outs[0], token_ids)[0],
    )


def completion_response(
    request_id: str,
    model: str,
    outs: list[RequestOutput],
    kv_transfer_params: dict | None,
    token_ids: bool = False,
    logprobs: LogprobFormatter | None = None,
) -> CompletionResponse:
    choices = [
        CompletionChoice(
            index=index,
            text=out.outputs[0].text,
            finish_reason=out.outputs[0].finish_reason,
            logprobs=_logprobs_of(out, logprobs, chat=False),
            **token_id_fields(out, token_ids)[1],
        )
        for index, out in enumerate(outs)
    ]
    return CompletionResponse(
        id=request_id,
        model=model,
        choices=choices,
        usage=usage_of(outs),
        kv_transfer_params=kv_transfer_params,
        **token_id_fields(outs[0], token_ids)[0],
    )


def _logprobs_of(out: RequestOutput, fmt: LogprobFormatter | None, chat: bool) -> dict | None:
    entries = out.outputs[0].logprobs
    if fmt is None or entries is None:
        return None
    return fmt.chat(entries) if chat else fmt.completion(entries)


async def collect(stream: RequestStream, tracker: RequestTracker) -> RequestOutput:
    """Run a request to the end and return its final output; cancelling it aborts the request."""
    return (await collect_choices(stream, tracker, 1))[0]


async def collect_choices(stream: Any, tracker: Any, n: int) -> list[RequestOutput]:
    """Run a request of ``n`` choices to the end and return their final outputs in index
    order; cancelling it aborts the request."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for out in stream:
            tracker.on_output(out)
            if out.finished:
                finals[out.outputs[0].index] = out
                if len(finals) == n:
                    return [finals[i] for i in range(n)]
    finally:
        stream.close()
    raise EngineError("the request ended without a final output")


class _Chunks:
    """Serialises the chunks of one stream; ``chat`` picks the chat or completions shape.

    The per-token chunk differs only in its text, so it is rendered once with a placeholder
    and then filled by string concatenation: one ``json.dumps`` of the text per token.
    """

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        include_usage: bool,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self.chat = chat
        self.include_usage = include_usage
        # ``return_token_ids``: the first chunk names the prompt's ids (then this is cleared).
        self.prompt_token_ids = prompt_token_ids
        self.with_ids = prompt_token_ids is not None  # and every token chunk its token ids
        self.head: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": now(),
            "model": model,
        }
        self._templates: dict[int, tuple[str, str]] = {}  # choice index -> text chunk halves

    def text(self, text: str, index: int = 0) -> str:
        halves = self._templates.get(index)
        if halves is None:
            before, after = self.choice(_SLOT, None, index=index).split(_dumps(_SLOT))
            halves = self._templates[index] = (before, after)
        return f"{halves[0]}{_dumps(text)}{halves[1]}"

    def tokens(self, text: str, token_ids: list[int], index: int = 0) -> str:
        """A chunk with ``text`` and the ``token_ids`` it came from (``return_token_ids``)."""
        return self.choice(text, None, token_ids=token_ids, index=index)

    def choice(
        self,
        text: str | None,
        finish_reason: str | None,
        role: bool = False,
        token_ids: list[int] | None = None,
        logprobs: dict[str, Any] | None = None,
        index: int = 0,
    ) -> str:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        if token_ids is not None:
            choice["token_ids"] = token_ids
        chunk = {**self.head, "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        if self.prompt_token_ids is not None and (role or token_ids is not None):
            chunk["prompt_token_ids"], self.prompt_token_ids = self.prompt_token_ids, None
        return _sse(chunk)

    def tool_calls(self, calls: list[dict[str, Any]], index: int = 0) -> str:
        """One chunk with every call whole: names and arguments are known only at the end."""
        delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return _sse({**self.head, "choices": [choice]})

    def usage(self, outs: list[RequestOutput], ended: int = 0) -> str:
        usage = usage_of(outs, ended).model_dump()
        return _sse({**self.head, "choices": [], "usage": usage})


# Stands in for the text while rendering the template; it must not occur anywhere else in a
# chunk, and ids and model names hold no control characters.
_SLOT = "\x00"


class _ChoiceState:
    """What one choice's stream carries between its outputs."""

    __slots__ = ("calls", "offset")

    def __init__(self, tools: bool) -> None:
        self.calls = ToolCallStream() if tools else None
        self.offset = 0  # text completions: where the next token's text starts

    def resume(self, resumed: Resumed, logprobs: LogprobFormatter | None) -> None:
        """Go on after ``resumed``, the output that another worker's stream already sent."""
        if self.calls is not None:
            self.calls.feed(resumed.text)  # what it releases, the first worker released
        if logprobs is not None:  # as the first worker counted them: token by token
            self.offset = sum(len(logprobs.text(t)) for t in resumed.output_token_ids)


async def sse_events(
    stream: RequestStream,
    tracker: RequestTracker,
    request_id: str,
    model: str,
    chat: bool,
    include_usage: bool,
    prompt_token_ids: list[int] | None = None,
    tools: bool = False,
    on_tool_calls: Callable[[RequestOutput], Awaitable[None]] | None = None,
    logprobs: LogprobFormatter | None = None,
    parallel_tool_calls: bool = True,
    n: int = 1,
    resumed: Sequence[Resumed] | None = None,
) -> AsyncIterator[str]:
    """The server-sent events of one streamed completion of ``n`` choices, ending with
    ``data: [DONE]``. Every chunk names its choice's ``index``; each choice ends with its
    own ``finish_reason`` chunk, and the usage chunk (``include_usage``) follows the last.

    With ``prompt_token_ids`` (the ``return_token_ids`` extension) the first chunk carries
    them and every token gets a chunk with its ids, even one whose text is held back (empty):
    a reader must see every generated id to resume the stream elsewhere. With ``tools``,
    text that may be a tool call is held back and sent at the end as ``tool_calls``, and
    ``on_tool_calls`` runs once, after the first choice's calls are sent (only the first
    call without ``parallel_tool_calls``). With ``logprobs`` every token's chunk carries its
    log-probabilities, even when its text is held back. ``resumed``: the stream goes on from
    a dead worker's (``worker/resume.py``), whose role chunks and this output of each choice
    the client has (and the ends of the choices that had ended).
    """
    chunks = _Chunks(request_id, model, chat, include_usage, prompt_token_ids)
    states = [_ChoiceState(tools) for _ in range(n)]
    finals: dict[int, RequestOutput] = {}
    ended = 0  # the choices that had ended before a resume, and their tokens
    if resumed is not None:
        for state, choice in zip(states, resumed, strict=True):
            state.resume(choice, logprobs)
        ended = sum(len(c.output_token_ids) for c in resumed if c.finish_reason is not None)
        n -= sum(c.finish_reason is not None for c in resumed)
    elif chat:
        for index in range(n):
            yield chunks.choice("", None, role=True, index=index)
    try:
        async for out in stream:
            tracker.on_output(out)
            index = out.outputs[0].index
            for event in _token_chunks(chunks, states[index], out, index, logprobs):
                yield event
            if not out.finished:
                continue
            state, finish_reason = states[index], out.outputs[0].finish_reason
            if state.calls:
                reply = state.calls.finish()
                if reply.content:
                    yield chunks.text(reply.content, index)
                found = reply.tool_calls if parallel_tool_calls else reply.tool_calls[:1]
                if found:
                    yield chunks.tool_calls(found, index)
                    if on_tool_calls is not None:
                        await on_tool_calls(out)
                        on_tool_calls = None
                finish_reason = finish_reason_with_calls(finish_reason, found)
            yield chunks.choice(None if chat else "", finish_reason, index=index)
            finals[index] = out
            if include_usage and len(finals) == n:
                yield chunks.usage([finals[i] for i in sorted(finals)], ended)
    except EngineError as e:
        # Headers are gone already: report in-band, the way OpenAI streams report errors.
        yield _sse(
            {"error": {"message": str(e), "type": "server_error", "param": None, "code": None}}
        )
    finally:
        # An ``async for`` does not close its iterator when the consumer stops early, so abort
        # here: this runs when the response closes this generator after a disconnect.
        stream.close()
    yield DONE


def _token_chunks(
    chunks: _Chunks,
    state: _ChoiceState,
    out: RequestOutput,
    index: int,
    logprobs: LogprobFormatter | None,
) -> list[str]:
    """The chunks for the tokens one output of a choice added."""
    text = state.calls.feed(out.delta_text) if state.calls else out.delta_text
    lp = None
    if logprobs is not None and out.delta_logprobs:
        if chunks.chat:
            lp = logprobs.chat(out.delta_logprobs)
        else:
            lp = logprobs.completion(out.delta_logprobs, state.offset)
            state.offset += sum(len(t) for t in lp["tokens"])
    with_ids = chunks.with_ids
    if lp is not None:
        ids = out.delta_token_ids if with_ids else None
        return [chunks.choice(text, None, token_ids=ids, logprobs=lp, index=index)]
    if with_ids and out.delta_token_ids:
        return [chunks.tokens(text, out.delta_token_ids, index)]
    if text:
        return [chunks.text(text, index)]
    return []


def _dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _sse(data: dict[str, Any]) -> str:
    return f"data: {_dumps(data)}\n\n"


class SSEResponse(StreamingResponse):
    """A streaming response that notices a client leaving even while no token is being sent.

    Starlette only watches for ``http.disconnect`` on ASGI servers older than spec 2.4; with
    uvicorn it relies on a failed write instead, which never comes while a long prefill runs.
    Closing the body iterator on disconnect is what aborts the request and frees its blocks.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def run_then_cancel(func) -> None:
                try:
                    await func()
                except OSError:
                    pass  # the client went away mid-write
                tg.cancel_scope.cancel()

            tg.start_soon(run_then_cancel, lambda: self.stream_response(send))
            await run_then_cancel(lambda: self.listen_for_disconnect(receive))
        await self.body_iterator.aclose()  # type: ignore[attr-defined]
