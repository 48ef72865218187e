"""Turn a validated OpenAI request into what the engine takes: prompt token ids and params.

Defaults follow OpenAI where it has one: ``temperature`` 1.0, ``top_p`` 1.0, and for text
completions ``max_tokens`` 16. For chat, where OpenAI lets the reply run to the end of the
context, an omitted ``max_tokens`` means "the rest of the context window". A prompt plus
``max_tokens`` that does not fit the context is a 400, as with OpenAI and vLLM, rather than a
silently shorter reply.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from splitserve.common.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    _SamplingFields,
)
from splitserve.common.sampling_params import InvalidParameter, SamplingParams
from splitserve.worker.errors import APIError, bad_request, from_validation_error
from splitserve.worker.structured import (
    Grammar,
    GrammarError,
    json_grammar,
    json_or_tool_calls,
    tool_call_body,
    tool_calls_grammar,
)

M = TypeVar("M", bound=BaseModel)

COMPLETION_DEFAULT_MAX_TOKENS = 16
# Below this a temperature only produces overflowing logits; treat it as greedy (as vLLM does).
_GREEDY_BELOW = 1e-5


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What request preparation needs to know about the served model."""

    name: str
    tokenizer: Any  # encode(str) -> ids, apply_chat_template(messages, tools=None) -> ids
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class Resumed:
    """The output a resumed stream's first worker generated (``worker/resume.py``)."""

    output_token_ids: list[int]
    text: str  # their text as the stream settled it, before tool-call hold-back
    finish_reason: str | None = None  # a choice of n > 1 that had ended: not run again


@dataclass(frozen=True, slots=True)
class EngineInput:
    prompt_token_ids: list[int]
    prompt: str | None
    params: SamplingParams
    resumed: Resumed | None = None
    resumed_choices: tuple[Resumed, ...] | None = None  # n > 1: each choice's, by index


def chat_input(req: ChatCompletionRequest, model: ModelInfo) -> EngineInput:
    _check_common(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    grammar = chat_grammar(req)
    messages = [_message_dict(m, i) for i, m in enumerate(req.messages)]
    tools = None
    if offers_tools(req):  # as the client sent them: the router tokenizes the raw body
        tools = [t.model_dump(exclude_unset=True) for t in req.tools or ()]
    try:
        ids = list(model.tokenizer.apply_chat_template(messages, tools=tools))
    except Exception as e:  # a template may reject a conversation (role order, missing field)
        raise bad_request(f"cannot apply the chat template: {e}", param="messages") from e
    _check_prompt(ids, model, "messages")
    max_tokens = req.max_completion_tokens or req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling_params(req, ids, max_tokens, param, model, logprobs, grammar)
    return EngineInput(ids, None, params)


def offers_tools(req: ChatCompletionRequest) -> bool:
    """Whether the model is shown the request's tools (and its calls parsed from the reply)."""
    return bool(req.tools) and req.tool_choice != "none"


def forced_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools one of which the reply must call (``tool_choice`` "required" or a named
    function), as dicts; None when the model may answer in text."""
    choice = req.tool_choice
    if choice in (None, "auto", "none"):
        return None
    tools = [t.model_dump(exclude_unset=True) for t in req.tools or ()]
    if not tools:
        raise bad_request(f"tool_choice {choice!r} needs tools", param="tool_choice")
    if choice == "required":
        return tools
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        named = [t for t in tools if t["function"]["name"] == name]
        if named:
            return named[:1]
        raise bad_request(f"tool_choice names no offered function: {choice!r}", param="tool_choice")
    raise bad_request(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def chat_grammar(req: ChatCompletionRequest) -> Grammar | None:
    """What the reply is constrained to: a JSON format, forced tool calls, or (tools offered
    with ``auto``) the body of any call the model opens; None when it is free."""
    forced = forced_tools(req)
    schema = _response_schema(req)
    try:
        if forced is not None:
            if schema is not None:
                raise bad_request(
                    "response_format cannot be combined with a forced tool_choice",
                    param="response_format",
                )
            # One call unless parallel calls are asked for by name: a small model forced to
            # call tools repeats its call until max_tokens cuts one in half.
            return tool_calls_grammar(forced, parallel=req.parallel_tool_calls is True)
        tools = [t.model_dump(exclude_unset=True) for t in req.tools or ()]
        if offers_tools(req) and schema is not None:
            return json_or_tool_calls(schema.get("schema"), tools)
        if schema is not None:
            return json_grammar(schema.get("schema"))
        if offers_tools(req):
            return _auto_tool_grammar(tools)
    except GrammarError as e:
        param = "tools" if schema is None else "response_format"
        raise bad_request(str(e), param=param) from e
    return None


def _auto_tool_grammar(tools: list[dict[str, Any]]) -> Grammar | None:
    """The body of any call the model opens, constrained; a schema that cannot be enforced
    leaves the calls free (as they were before masks) unless a tool asked to be ``strict``."""
    try:
        return tool_call_body(tools)
    except GrammarError:
        if any(t["function"].get("strict") for t in tools):
            raise
        return None


def _response_schema(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any] | None:
    """``{"schema": ...}`` for a JSON ``response_format`` (schema None: any object)."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"schema": None}
    if fmt.json_schema is None:
        raise bad_request(
            "response_format json_schema needs a json_schema object",
            param="response_format.json_schema",
        )
    return {"schema": fmt.json_schema.schema_ or {}}


def completion_input(req: CompletionRequest, model: ModelInfo) -> EngineInput:
    _check_common(req)
    for name in ("echo", "suffix"):
        if getattr(req, name):
            raise bad_request(f"{name} is not supported", param=name)
    if req.best_of not in (None, 1):
        raise bad_request("best_of must be 1", param="best_of")
    if req.best_of is not None and (req.n or 1) > 1:
        raise bad_request("best_of cannot be combined with n > 1", param="best_of")
    prompt = _single_prompt(req.prompt)
    if isinstance(prompt, str):
        text, ids = prompt, list(model.tokenizer.encode(prompt))
    else:
        text, ids = None, prompt
    _check_prompt(ids, model, "prompt")
    max_tokens = req.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
    schema = _response_schema(req)
    try:
        grammar = json_grammar(schema["schema"]) if schema is not None else None
    except GrammarError as e:
        raise bad_request(str(e), param="response_format") from e
    params = _sampling_params(req, ids, max_tokens, "max_tokens", model, req.logprobs, grammar)
    return EngineInput(ids, text, params)


def _check_common(req: _SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )


def _single_prompt(prompt: str | list) -> str | list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(
                "send one prompt per request (batched prompts are not supported)", param="prompt"
            )
        prompt = prompt[0]
    if not prompt:
        raise bad_request("prompt is empty", param="prompt")
    return prompt


def _message_dict(msg: ChatMessage, index: int) -> dict[str, Any]:
    """The message as a chat template expects it: text content, tool-call arguments as dicts."""
    out: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role}
    out["content"] = _text_content(msg.content, index)
    if msg.name is not None:
        out["name"] = msg.name
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    if msg.tool_calls:
        out["tool_calls"] = [
            _tool_call_dict(tc.model_dump(exclude_none=True)) for tc in msg.tool_calls
        ]
    return out


def _text_content(content: str | list[dict[str, Any]] | None, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(
                "only text content parts are supported", param=f"messages.{index}.content"
            )
        parts.append(part["text"])
    return "\n".join(parts)


def _tool_call_dict(call: dict[str, Any]) -> dict[str, Any]:
    # OpenAI sends arguments as a JSON string; HF chat templates iterate them as a mapping.
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            call["function"]["arguments"] = parsed
    return call


def _check_prompt(ids: list[int], model: ModelInfo, param: str) -> None:
    if not ids:
        raise bad_request("prompt is empty", param=param)
    if any(t < 0 or t >= model.vocab_size for t in ids):
        raise bad_request(f"prompt token ids must be in [0, {model.vocab_size})", param=param)
    if len(ids) >= model.max_model_len:
        raise bad_request(
            f"this model's maximum context length is {model.max_model_len} tokens, "
            f"but the prompt has {len(ids)} tokens (at least one output token must fit); "
            "shorten the prompt",
            param=param,
            code="context_length_exceeded",
        )


def _sampling_params(
    req: _SamplingFields,
    ids: list[int],
    max_tokens: int | None,
    param: str,
    model: ModelInfo,
    logprobs: int | None = None,
    grammar: Grammar | None = None,
) -> SamplingParams:
    room = model.max_model_len - len(ids)
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise bad_request(
            f"this model's maximum context length is {model.max_model_len} tokens; the prompt "
            f"has {len(ids)} and {param} asks for {max_tokens} more; lower {param} to at most "
            f"{room} or shorten the prompt",
            param=param,
            code="context_length_exceeded",
        )
    temperature = 1.0 if req.temperature is None else req.temperature
    top_k = -1 if req.top_k is None else min(req.top_k, model.vocab_size)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if temperature < _GREEDY_BELOW else temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=top_k,
            seed=req.seed,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0,
            logprobs=logprobs,
            grammar=grammar.grammar if grammar else None,
            grammar_trigger=grammar.trigger if grammar else None,
        )
    except InvalidParameter as e:
        raise bad_request(str(e), param=e.param) from e


def model_not_found(name: str) -> APIError:
    return APIError(
        404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
    )


async def parse_body(request: Request, schema: type[M]) -> M:
    """The request's JSON body validated as ``schema``; a clear 400 for anything else."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        # Lone surrogates (legal in JSON escapes) would crash the tokenizer's UTF-8 encoder.
        json.dumps(body, ensure_ascii=False).encode()
    except (UnicodeEncodeError, RecursionError, ValueError) as e:
        raise bad_request(f"the request body is not valid UTF-8 text: {e}") from e
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from e
