"""Request and response schemas of the OpenAI HTTP API, as splitserve serves it.

Torch-free and engine-free: the worker validates requests with these models and the router
reuses them. Requests are validated strictly (``"5"`` is not an integer, ``true`` is not a
number) because a lax coercion would turn a client bug into a silently different request.
Unknown fields are kept (``extra="allow"``) so that a proxy can forward them unchanged; the
worker ignores them, as vLLM does.

splitserve's extensions to the OpenAI schema, with vLLM's names: ``top_k``,
``repetition_penalty``, ``ignore_eos``,
``kv_transfer_params`` (the disaggregated-serving handshake, echoed back in responses) and
``kv_retention`` (``{"ttl_s": N}``: keep the conversation's KV pinned for N seconds) and
``return_token_ids``: responses then carry ``prompt_token_ids`` (top level; in a stream, on
the first chunk) and each choice its generated ``token_ids`` (in a stream, that chunk's). The
router uses them to resume a stream on another worker when its worker dies. ``kv_peer`` (the
router's, not a client's: the base URL of the session's home worker) asks the worker to pull
the conversation's KV from there before computing it. ``resume`` (the router's, on builtin
workers only: ``Resume``) continues a stream that another worker began.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# A worker is collocated ("both"), or one half of a disaggregated deployment.
WORKER_ROLES = ("both", "prefill", "decode")
# How long a worker pulling a moved turn's KV (``kv_peer``) waits for the home's lease.
DEFAULT_KV_PEER_TIMEOUT_S = 1.0

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- requests ------------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    """One message of a conversation. ``content`` may be a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object
    strict: bool | None = None


class ToolDefinition(_Request):
    """One tool a chat request offers the model (OpenAI's ``tools[i]``)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class JSONSchemaFormat(_Request):
    model_config = ConfigDict(
        strict=True, allow_inf_nan=False, extra="allow", populate_by_name=True
    )

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: ``text`` (the default), ``json_object`` (any JSON
    object) or ``json_schema`` (a JSON value valid under ``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class KVRetention(_Request):
    """Extension: keep this conversation's KV cache pinned on the worker for ``ttl_s``
    seconds after the reply (the client is about to run a tool and come back)."""

    ttl_s: float | None = Field(default=None, ge=0.0)  # None: the worker's default


class ResumedChoice(_Request):
    """One choice of a resumed ``n > 1`` request: its output so far, and how it ended if the
    client has its finish chunk already (it is not run again)."""

    output_token_ids: list[int]
    finish_reason: str | None = None


class Resume(_Request):
    """Extension (the router's): this request continues the reply another worker began and
    lost mid-stream. ``prompt_token_ids`` is what that worker reported for the prompt (this
    worker's own must match), ``output_token_ids`` the tokens it had generated whose text the
    client has (``choices``: each choice's, for ``n > 1``). They count as this request's
    output: its sampler (a seed's draws, penalties), grammar, tool-call parsing and stop
    strings go on from there, and its stream sends only what follows them
    (``worker/resume.py``)."""

    prompt_token_ids: list[int] = Field(min_length=1)
    output_token_ids: list[int] = Field(default_factory=list)
    choices: list[ResumedChoice] | None = Field(default=None, min_length=2)


class _SamplingFields(_Request):
    """Fields shared by chat and text completions."""

    model: str | None = None  # None: the worker's only model
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None
    # Extensions.
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    return_token_ids: bool = False
    kv_retention: KVRetention | None = None
    kv_peer: str | None = None  # set by the router: the session's home worker (worker.peer)
    resume: Resume | None = None  # set by the router: a migrated stream (worker/resume.py)
    # vLLM's field: requests with different salts never share cached KV (common/tenants.py).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # OpenAI's range


class CompletionRequest(_SamplingFields):
    # One prompt per request: a string or token ids (a one-element batch is accepted too).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    echo: bool | None = False
    best_of: int | None = Field(default=None, ge=1, le=128)
    logprobs: int | None = Field(default=None, ge=0, le=5)  # OpenAI's range
    suffix: str | None = None


class KVPrefetchRequest(_Request):
    """``POST /v1/kv/prefetch``: a prompt is coming, promote its cached KV now. Name it by
    token ids, or send the chat or completion request body itself (what the router does).
    ``POST /v1/kv/lease`` (a peer asking for a prompt's cached KV) takes the same body."""

    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)


# ---- responses -----------------------------------------------------------------------------


def make_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> Usage:
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


class ResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(_Response):
    index: int = 0
    message: ResponseMessage
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None  # {"content": [{token, logprob, bytes, top_logprobs}]}


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(_Response):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None  # {tokens, token_logprobs, top_logprobs, text_offset}


class CompletionResponse(_Response):
    """A text completion, and also one chunk of a streamed one (OpenAI uses one shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "splitserve"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo
