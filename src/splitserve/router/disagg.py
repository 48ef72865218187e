"""The two-leg flow of disaggregated serving, with vLLM's ``kv_transfer_params`` names.

::

    client ──req──▶ router ──req, max_tokens=1, stream=false,
                       │      kv_transfer_params={do_remote_decode: true}──▶ prefill worker
                       │  ◀── {..., kv_transfer_params: {do_remote_prefill: true, remote_*}} ─┘
                       └──req + those kv_transfer_params, streaming as asked──▶ decode worker

Conditional: a remote prefill pays a KV transfer, so it is only worth it when the part of
the prompt the decode worker does not already hold is long. The router does not tokenize;
it estimates tokens from characters, and it assumes (statelessly, so that replicas agree) a
session's home worker holds everything up to the last assistant message, which is exactly
what the previous turn left in its cache.
"""

from __future__ import annotations

from typing import Any

_ONE_TOKEN = {"max_tokens": 1, "stream": False, "n": 1}


def uncached_chars(body: dict[str, Any], on_home: bool) -> int:
    """Characters of the prompt the decode worker probably has not cached."""
    messages = body.get("messages")
    if isinstance(messages, list):
        start = _after_last_assistant(messages) if on_home else 0
        return sum(_chars(m) for m in messages[start:])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return 4 * len(prompt)  # token ids: report them in the same character currency
    return 0


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: compute the prompt's KV and one token, keep the blocks for D."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    out.update(_ONE_TOKEN)
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def decode_fields(params: dict[str, Any]) -> dict[str, Any]:
    """The decode leg is the client's request as sent, plus these: where to pull the KV."""
    return {"kv_transfer_params": params}


def accepted_params(response: Any) -> dict[str, Any] | None:
    """The prefill worker's ``kv_transfer_params`` if it really kept the KV for a remote
    decode; None otherwise (a worker without disaggregation echoes the request's params)."""
    if not isinstance(response, dict):
        return None
    params = response.get("kv_transfer_params")
    if isinstance(params, dict) and params.get("do_remote_prefill") is True:
        return params
    return None


def _after_last_assistant(messages: list[Any]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if isinstance(messages[i], dict) and messages[i].get("role") == "assistant":
            return i + 1
    return 0


def _chars(message: Any) -> int:
    if not isinstance(message, dict):
        return 0
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return 0
