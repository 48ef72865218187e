"""The two-leg flow of disaggregated serving, with vLLM's ``kv_transfer_params`` names.

::

    client ──req──▶ router ──req, max_tokens=1, stream=false,
                       │      kv_transfer_params={do_remote_decode: true}──▶ prefill worker
                       │  ◀── {..., kv_transfer_params: {do_remote_prefill: true, remote_*}} ─┘
                       └──req + those kv_transfer_params, streaming as asked──▶ decode worker

Conditional: a remote prefill pays a KV transfer, so it is only worth it when the part of
the prompt the decode worker does not already hold is long (``placement`` decides).
"""

from __future__ import annotations

from typing import Any

_ONE_TOKEN = {"max_tokens": 1, "stream": False, "n": 1}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: compute the prompt's KV and one token, keep the blocks for D."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    out.update(_ONE_TOKEN)
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def responses_prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/responses`` first turn's prefill leg: the same prompt (instructions, input,
    tools), one token, not stored; the response's KV kept for D as for chat."""
    out = {**body, "max_output_tokens": 1, "stream": False, "store": False}
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
