"""What every generating endpoint (chat, completions, responses) does around the engine:
add a request with its errors as HTTP answers, count the KV blocks it may claim, and note
its token counts for the access log."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from splitserve.common.sampling_params import InvalidParameter
from splitserve.engine.outputs import RequestOutput
from splitserve.worker.async_engine import AsyncEngine, EngineError, QueueFull
from splitserve.worker.choices import request_blocks
from splitserve.worker.errors import APIError, bad_request
from splitserve.worker.prepare import EngineInput


async def add_request(
    async_engine: AsyncEngine,
    request_id: str,
    inp: EngineInput,
    keep: bool,
    salt: str,
    options: dict[str, Any],
) -> Any:
    """Queue ``inp`` on the engine; a full queue is a 429, a bad parameter a 400 naming it,
    a stopped engine a 503. A resumed input's output so far goes with it."""
    if inp.resumed is not None:
        options = {**options, "output_token_ids": inp.resumed.output_token_ids}
    try:
        return await async_engine.add(
            request_id,
            inp.prompt_token_ids,
            inp.params,
            inp.prompt,
            keep_blocks=keep,
            salt=salt,
            **options,
        )
    except QueueFull as e:
        raise APIError(429, f"the server is busy ({e}); retry later", code="queue_full") from e
    except InvalidParameter as e:
        raise bad_request(str(e), param=e.param) from e
    except EngineError as e:
        raise APIError(503, str(e), code="engine_unavailable") from e


def kv_blocks(inp: EngineInput, engine: Any, n: int = 1) -> int:
    """The KV blocks a request may come to hold: its prompt and every token it may write,
    for each of its ``n`` choices (the prompt blocks they share counted once)."""
    block_size = getattr(getattr(engine, "config", None), "block_size", 16)
    return request_blocks(len(inp.prompt_token_ids), inp.params.max_tokens, n, block_size)


def note_usage(request: Request, out: RequestOutput) -> None:
    """The token counts of a finished request (or choice), for the access log: the prompt
    once, the completion tokens of every choice."""
    state = request.state
    if out.outputs[0].index == 0:
        state.prompt_tokens = len(out.prompt_token_ids)
        state.cached_tokens = out.num_cached_tokens
    done = getattr(state, "completion_tokens", None) or 0
    state.completion_tokens = done + len(out.outputs[0].token_ids)
