"""The OpenAI Responses API (``/v1/responses``) as splitserve serves it: request schemas,
response ids, and the shapes of the objects it returns.

Torch-free: the worker validates requests and builds responses with this module, the
router reads response ids with it.

Unlike the chat schemas (``common.protocol``), unknown fields are refused: a field this
server would not honour is a 400 that names it, never silently ignored.

A response id carries its chain: ``resp_<chain: 32 hex><turn: 16 hex>``. The chain is the
first response's, inherited by every response that continues it (``previous_response_id``),
so any router replica, restarted or not, derives the same session from any id of the chain.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

RESPONSES_PATH = "/v1/responses"
# The router names a new chain in this header; a worker mints one when it is absent.
CHAIN_HEADER = "x-splitserve-response-chain"
# With the router's ``return_token_ids``, a stream names every token's ids in events of this
# type (no ``sequence_number``: the router strips them before the client sees the stream).
TOKEN_IDS_EVENT = "splitserve.token_ids"
_CHAIN_HEX, _TURN_HEX = 32, 16
_ID = re.compile(rf"resp_([0-9a-f]{{{_CHAIN_HEX}}})[0-9a-f]{{{_TURN_HEX}}}")
_CHAIN = re.compile(rf"[0-9a-f]{{{_CHAIN_HEX}}}")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def new_chain() -> str:
    return os.urandom(_CHAIN_HEX // 2).hex()


def is_chain(value: str) -> bool:
    return _CHAIN.fullmatch(value) is not None


def response_id(chain: str) -> str:
    """A new response id in ``chain``."""
    return f"resp_{chain}{os.urandom(_TURN_HEX // 2).hex()}"


def chain_of(response_id: str) -> str | None:
    """The chain a response id belongs to; None for an id this server did not make."""
    match = _ID.fullmatch(response_id)
    return None if match is None else match.group(1)


def chain_session(chain: str) -> str:
    """The session id of a chain: its KV's owner on the worker, its key at the router."""
    return f"response-chain-{chain}"


def item_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(16).hex()}"


# ---- requests ------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class FunctionTool(_Strict):
    """A function the model may call (``tools[i]``; the only tool type served)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesResume(_Strict):
    """The router's: this streamed response continues one that another worker began and
    lost mid-stream (``router/responses_relay.py``). ``prompt_token_ids`` and
    ``output_token_ids`` as for chat (``common.protocol.Resume``); the rest is what the
    client holds of the response, which the stream goes on from: its id (stored under it),
    ``created_at``, the message item it has open (None: none yet) and the next event's
    ``sequence_number``."""

    prompt_token_ids: list[int] = Field(min_length=1)
    output_token_ids: list[int] = Field(default_factory=list)
    response_id: str
    created_at: int = Field(ge=0, le=INT64_MAX)
    message_id: str | None = Field(default=None, min_length=1, max_length=128)
    sequence_number: int = Field(ge=0, le=INT64_MAX)


class ResponsesRequest(_Strict):
    """``POST /v1/responses``. ``input`` items are checked one by one (``worker``), since a
    message item may omit its ``type``. Extensions: ``seed`` (as for chat), and the router's
    ``return_token_ids``, ``resume`` (a migrated stream) and ``kv_transfer_params`` (a first
    turn's remote prefill, as for chat)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Literal[True] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = Field(default=None, min_length=1)
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    text: TextConfig | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    return_token_ids: bool = False
    resume: ResponsesResume | None = None
    kv_transfer_params: dict[str, Any] | None = None


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    """A message: the easy form (``role`` and ``content``, ``type`` optional) or an output
    message sent back as input."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


INPUT_ITEMS: dict[str, type[_Strict]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


# ---- responses -----------------------------------------------------------------------------


def usage(input_tokens: int, cached: int, output_tokens: int) -> dict[str, Any]:
    """``usage``: ``cached_tokens`` of the input were served from KV already held; the rest
    were computed and written to the cache."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": input_tokens - cached,
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant output message; ``text`` None: its content has not begun."""
    content = [] if text is None else [output_text(text)]
    return {
        "id": item,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def function_call_item(item: str, call: dict[str, Any], arguments: str, status: str) -> dict:
    """A ``function_call`` output item for a parsed call (``worker.tool_calls``' shape)."""
    return {
        "id": item,
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": arguments,
        "status": status,
    }


def response_object(
    id: str,
    model: str,
    req: ResponsesRequest,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    created_at: int | None = None,
) -> dict[str, Any]:
    """A response object; ``status`` ``incomplete`` means it stopped at ``max_output_tokens``."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    return {
        "id": id,
        "object": "response",
        "created_at": int(time.time()) if created_at is None else created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": req.previous_response_id,
        "reasoning": None,
        "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
        "tools": tools,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }
