"""A Responses API request as the chat request the engine runs: input items become chat
messages, the stored chain's conversation goes before them, ``instructions`` first.

Items and what they become:

- a message (``role`` user, system, developer or assistant; text content) -> that message;
- ``function_call`` -> an assistant turn whose text is the call in the model's own tool-call
  format (``worker.tool_calls``), merged into the assistant turn it follows. A stored
  response's own output is replayed exactly as the model wrote it, so a continued chain's
  prompt begins with the previous prompt and output token for token and its KV is reused;
- ``function_call_output`` -> a ``tool`` message with the call's id.

Any other item or content part is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from splitserve.common.protocol import ChatCompletionRequest
from splitserve.common.responses_api import (
    INPUT_ITEMS,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputText,
    MessageItem,
    ResponsesRequest,
)
from splitserve.worker.errors import APIError, bad_request
from splitserve.worker.prepare import EngineInput, ModelInfo, chat_input
from splitserve.worker.tool_calls import CLOSE, OPEN

# Chat parameter names as a Responses client knows them.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens"}
_TEXT_PARTS = ("input_text", "output_text")


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request's ``input``."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, raw in enumerate(value):
        item = _item(raw, i)
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            _append_call(messages, item)
        else:
            assert isinstance(item, FunctionCallOutputItem)
            content = _text(item.output)
            messages.append({"role": "tool", "content": content, "tool_call_id": item.call_id})
    return messages


def _item(raw: Any, index: int) -> MessageItem | FunctionCallItem | FunctionCallOutputItem:
    where = f"input[{index}]"
    if not isinstance(raw, dict):
        raise bad_request(f"{where} must be an object", param=where)
    kind = raw.get("type", "message")
    schema = INPUT_ITEMS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise bad_request(
            f"{where}.type {kind!r} is not supported (supported: {', '.join(INPUT_ITEMS)})",
            param=f"{where}.type",
        )
    for key in ("content", "output"):
        _check_parts(raw.get(key), f"{where}.{key}")
    try:
        return schema.model_validate(raw)  # type: ignore[return-value]
    except ValidationError as e:
        raise validation_error(e, where) from e


def _check_parts(parts: Any, where: str) -> None:
    """Only text parts are served: name the first other one (pydantic would name the union)."""
    if not isinstance(parts, list):
        return
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise bad_request(
                f"{where}[{j}].type {kind!r} is not supported (only text parts)",
                param=f"{where}[{j}].type",
            )


def _text(content: str | list[InputText]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def _append_call(messages: list[dict[str, Any]], call: FunctionCallItem) -> None:
    try:
        arguments: Any = json.loads(call.arguments) if call.arguments else {}
    except ValueError:
        arguments = call.arguments
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    text = f"{OPEN}{body}{CLOSE}"
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last["content"] = f"{last['content']}{text}"
    else:
        messages.append({"role": "assistant", "content": text})


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that runs ``req`` over the whole conversation ``messages``."""
    if not messages:
        raise bad_request("input is empty and there are no instructions", param="input")
    body: dict[str, Any] = {"messages": messages, "stream": bool(req.stream)}
    if req.tools:
        body["tools"] = [_chat_tool(t.model_dump(exclude_none=True)) for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    for name, value in (
        ("max_completion_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("seed", req.seed),
    ):
        if value is not None:
            body[name] = value
    if req.kv_transfer_params is not None:  # a remote prefill's legs, as for chat
        body["kv_transfer_params"] = req.kv_transfer_params
    if req.resume is not None:  # the chat path's resume (``worker/resume.py``)
        tokens = ("prompt_token_ids", "output_token_ids")
        body["resume"] = req.resume.model_dump(include=set(tokens))
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise _renamed(validation_error(e, None)) from e


def engine_input(chat: ChatCompletionRequest, model: ModelInfo) -> EngineInput:
    """``chat_input``, its errors naming the Responses fields."""
    try:
        return chat_input(chat, model)
    except APIError as e:
        raise _renamed(e) from None


def _renamed(e: APIError) -> APIError:
    if e.param is not None:
        head, _, rest = e.param.partition(".")
        e.param = _PARAMS.get(head, head) + (f".{rest}" if rest else "")
        e.message = e.message.replace("max_completion_tokens", "max_output_tokens")
    return e


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    tool.pop("type")
    return {"type": "function", "function": tool}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    """Responses names a forced function flat (``{"type": "function", "name": N}``)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def validation_error(e: ValidationError, where: str | None) -> APIError:
    """The first problem, its path as the client wrote it; an unknown field is unsupported."""
    first = e.errors(include_url=False)[0]
    loc = [str(p) for p in first["loc"] if not _is_tag(str(p))]
    param = ".".join(([where] if where else []) + loc) or where
    if first["type"] == "extra_forbidden":
        return bad_request(f"{param} is not supported by this server", param=param)
    return bad_request(f"{param}: {first['msg']}" if param else first["msg"], param=param)


def _is_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list", "dict", "none"} or "[" in part
