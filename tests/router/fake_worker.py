"""A test double for a worker's HTTP contract: canned SSE chunks, /health, /load, faults.

Run as its own process (``python fake_worker.py --port P --name w1``) so tests can kill it.
With ``return_token_ids`` it streams token ids like a real worker: the prompt's ids are the
code points of its text (or the given ids), and the token generated at position p is p (a
request that ``resume``s a stream goes on after its output ids, counted in ``max_tokens``). In
``greedy`` mode its text is ``"t{p} "``, the same on every worker, as a greedy model's would
be; otherwise it names the worker (``"w1-0 "``) so tests can tell who wrote what. From
position ``diverge_at`` on, its greedy tokens are p + 1000 (a near tie gone the other way).
Tests steer it at run time through ``POST /_mode`` and read what it received from
``GET /_requests``. It speaks just enough of the OpenAI API and of the disaggregated
two-leg protocol (``kv_transfer_params``) to exercise the router.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from splitserve.common.gc_pauses import quiet_gc
from splitserve.common.tls import add_server_tls_args, server_files, uvicorn_tls

CHUNKS = 4


def create_app(name: str, role: str) -> FastAPI:
    app = FastAPI()
    # mode: ok | error500 | unhealthy | die_midstream | slow_first_byte
    # die_midstream drops the connection after ``die_after`` chunks.
    state: dict[str, Any] = {
        "mode": "ok",
        "running": 0,
        "waiting": 0,
        "delay_s": 0.0,
        "greedy": False,
        "die_after": 2,
        "set_cookie": False,
        "diverge_at": None,
    }
    seen: list[dict[str, Any]] = []

    @app.get("/health")
    async def health():
        if state["mode"] == "unhealthy":
            return JSONResponse({"status": "sick"}, status_code=503)
        return {"status": "ok"}

    @app.get("/load")
    async def load():
        return {
            "running": state["running"],
            "waiting": state["waiting"],
            "kv_blocks_used": 0,
            "kv_blocks_total": 100,
            "kv_usage": 0.0,
        }

    @app.post("/_mode")
    async def set_mode(request: Request):
        state.update(await request.json())
        return state

    @app.get("/_requests")
    async def requests():
        return seen

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    async def complete(request: Request, chat: bool):
        body = await request.json()
        seen.append({"path": request.url.path, "body": body, "headers": dict(request.headers)})
        if state["mode"] == "error500":
            return JSONResponse(
                {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}},
                status_code=500,
            )
        if body.get("max_tokens") == 400:  # a client error passes through untouched
            return JSONResponse(
                {
                    "error": {
                        "message": "bad",
                        "type": "invalid_request_error",
                        "param": "max_tokens",
                        "code": None,
                    }
                },
                status_code=400,
            )
        if body.get("stream"):
            return StreamingResponse(_sse(name, state, chat, body), media_type="text/event-stream")
        out: dict[str, Any] = {
            "id": "x",
            "model": "fake",
            "worker": name,
            "choices": [_choice(name, chat)],
        }
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode") and role in ("prefill", "both"):
            out["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": name,
                "remote_block_ids": [1, 2],
            }
        cookie = {"set-cookie": f"{name}-session=secret; Path=/"} if state["set_cookie"] else None
        return JSONResponse(out, headers=cookie)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, False)

    @app.post("/v1/kv/prefetch")
    async def prefetch(request: Request):
        seen.append({"path": request.url.path, "body": await request.json(), "headers": {}})
        return {"object": "kv.prefetch", "blocks": 0}

    return app


def _choice(name: str, chat: bool, i: int | None = None) -> dict[str, Any]:
    text = name if i is None else f"{name}-{i} "
    if chat:
        key = "message" if i is None else "delta"
        return {"index": 0, key: {"content": text}, "finish_reason": None}
    return {"index": 0, "text": text, "finish_reason": None}


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    if body.get("resume"):
        return body["resume"]["prompt_token_ids"]
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return prompt
    if prompt is None:
        prompt = body["messages"][-1]["content"]
    return [ord(c) for c in prompt]


async def _sse(name: str, state: dict[str, Any], chat: bool, body: dict[str, Any]):
    if state["mode"] == "slow_first_byte":
        await asyncio.sleep(state["delay_s"])
    with_ids = body.get("return_token_ids") is True
    prompt = _prompt_ids(body)
    done = len(body["resume"]["output_token_ids"]) if body.get("resume") else 0
    count = (body.get("max_tokens") or CHUNKS) - done if state["greedy"] else CHUNKS
    for i in range(count):
        if state["mode"] == "die_midstream" and i == state["die_after"]:
            raise RuntimeError("the worker died mid-stream")  # uvicorn drops the connection
        position = len(prompt) + done + i
        if state["diverge_at"] is not None and position >= state["diverge_at"]:
            position += 1000
        chunk: dict[str, Any] = {"id": f"{name}-stream", "model": "fake"}
        choice = _choice(name, chat, i)
        if state["greedy"]:
            choice["delta" if chat else "text"] = (
                {"content": f"t{position} "} if chat else f"t{position} "
            )
        if with_ids:
            choice["token_ids"] = [position]
            if i == 0:
                chunk["prompt_token_ids"] = prompt
        chunk["choices"] = [choice]
        yield f"data: {json.dumps(chunk)}\n\n".encode()
        await asyncio.sleep(state["delay_s"])
    if state["greedy"]:  # a real worker's ending: a finish chunk, then [DONE]
        finish = {
            "index": 0,
            "finish_reason": "length",
            **({"delta": {}} if chat else {"text": ""}),
        }
        chunk = {"id": f"{name}-stream", "model": "fake", "choices": [finish]}
        yield f"data: {json.dumps(chunk)}\n\n".encode()
        if (body.get("stream_options") or {}).get("include_usage"):
            n, out = len(prompt), done + count
            usage = {"prompt_tokens": n, "completion_tokens": out, "total_tokens": n + out}
            chunk = {"id": f"{name}-stream", "model": "fake", "choices": [], "usage": usage}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--role", default="both")
    add_server_tls_args(parser)  # HTTPS, as ``splitserve worker --ssl-certfile`` serves it
    args = parser.parse_args()
    tls = server_files(args.ssl_certfile, args.ssl_keyfile)
    quiet_gc()  # as a real worker does: no collector pauses in the benchmark's tails
    uvicorn.run(
        create_app(args.name, args.role),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        **uvicorn_tls(tls),
    )
