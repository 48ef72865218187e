"""The asynchronous streaming client: plays sessions against an OpenAI endpoint.

One ``httpx.AsyncClient`` (one connection pool) serves every request. Each turn streams with
``ignore_eos`` (so reply lengths are the workload's), ``return_token_ids`` (so tokens are
counted exactly, even those that decode to no text) and ``include_usage`` (the server's
prompt and cached token counts). A failed request is recorded and ends its session (an agent
cannot go on without the reply); it never stops the run. An ``https://`` server is verified
against the endpoint's ``ca`` file when it names one, else as httpx does (``SSL_CERT_FILE``,
then certifi's roots).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from splitserve.common.tls import client_context
from splitserve.workload.metrics import RequestRecord
from splitserve.workload.sessions import API_CHAT, SessionSpec
from splitserve.workload.vocab import text_of

SESSION_HEADER = "X-Session-Id"


@dataclass(frozen=True, slots=True)
class Endpoint:
    url: str  # the server's base URL, without /v1
    api_key: str | None = None
    model: str | None = None  # None: the server's only model
    # For a server that takes the OpenAI API only as written (llama.cpp's): completions
    # prompts go as text, tool messages carry a tool_call_id, and, as it has no ignore_eos,
    # ``logit_bias`` keeps the end-of-sequence tokens out.
    strict_openai: bool = False
    logit_bias: dict[str, float] | None = None
    ca: str | None = None  # the CA an https:// server is verified against (bench --ca)

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def new_client(
    max_connections: int = 512, timeout_s: float = 600.0, ca: str | None = None
) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=256)
    verify = True if ca is None else client_context(ca)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    return httpx.AsyncClient(timeout=timeout, limits=limits, verify=verify)


@dataclass(slots=True)
class _Reply:
    text: str = ""
    token_ids: list[int] | None = None


class SessionPlayer:
    """Plays sessions turn by turn; ``t0`` is the run's start (``time.perf_counter()``)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        endpoint: Endpoint,
        t0: float,
        on_record: Callable[[RequestRecord], None] = lambda r: None,
    ) -> None:
        self.client, self.endpoint, self.t0 = client, endpoint, t0
        self.on_record = on_record
        self.records: list[RequestRecord] = []

    async def play(self, spec: SessionSpec) -> None:
        """Every turn of ``spec``: wait its pause, re-send the conversation, stream the reply."""
        texts: list[str] = []
        ids: list[list[int]] = []
        for k, turn in enumerate(spec.turns):
            record = RequestRecord(spec.session_id, k, self.now(), error="cancelled")
            try:
                if k:
                    await asyncio.sleep(turn.pause_s)
                record.start_s = self.now()
                reply = await self._request(spec, k, texts, ids, record)
            finally:  # a run cut short still records the turn it interrupted
                self._record(record)
            if not record.ok:
                return
            texts.append(reply.text)
            ids.append(reply.token_ids or list(turn.output_ids))

    def _record(self, record: RequestRecord) -> None:
        self.records.append(record)
        self.on_record(record)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def _request(
        self,
        spec: SessionSpec,
        k: int,
        texts: list[str],
        ids: list[list[int]],
        record: RequestRecord,
    ) -> _Reply:
        path, body = request_body(spec, k, texts, ids, self.endpoint.strict_openai)
        if self.endpoint.model:
            body["model"] = self.endpoint.model
        if self.endpoint.logit_bias:
            body["logit_bias"] = self.endpoint.logit_bias
        headers = dict(self.endpoint.headers)
        if spec.sticky:
            headers[SESSION_HEADER] = spec.session_id
        sent = time.perf_counter()
        reply = _Reply()
        try:
            async with self.client.stream(
                "POST", self.endpoint.url + path, json=body, headers=headers
            ) as r:
                if r.status_code != 200:
                    await r.aread()
                    record.error = f"HTTP {r.status_code}"
                    return reply
                await _read_stream(r, sent, record, reply)
        except httpx.HTTPError as e:
            record.error = type(e).__name__
        finally:
            record.e2e_s = time.perf_counter() - sent
        return reply


def request_body(
    spec: SessionSpec, k: int, texts: list[str], ids: list[list[int]], strict: bool = False
) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of turn k, given the real replies of the turns before it;
    ``strict``: see ``Endpoint.strict_openai``."""
    turn = spec.turns[k]
    body: dict[str, Any] = {
        "max_tokens": turn.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if spec.api == API_CHAT:
        messages = spec.messages(k, texts)
        if strict:
            for i, m in enumerate(messages):
                if m["role"] == "tool":
                    m["tool_call_id"] = f"call_{i}"
        return "/v1/chat/completions", {"messages": messages, **body}
    prompt = spec.prompt_token_ids(k, ids)
    return "/v1/completions", {"prompt": text_of(prompt) if strict else prompt, **body}


async def _read_stream(
    r: httpx.Response, sent: float, record: RequestRecord, reply: _Reply
) -> None:
    last: float | None = None
    counted = 0
    done = False
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            record.error = "error in stream"
            return
        if usage := chunk.get("usage"):
            _take_usage(usage, record)
        n = _take_tokens(chunk, reply)
        if n:
            t = time.perf_counter()
            if last is None:
                record.ttft_s = t - sent
            else:
                record.itl_s.append(t - last)
            last, counted = t, counted + n
    record.output_tokens = record.output_tokens or counted
    record.ok = done and last is not None
    record.error = "" if record.ok else "incomplete stream"


def _take_usage(usage: dict[str, Any], record: RequestRecord) -> None:
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.output_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = int(details.get("cached_tokens") or 0)


def _take_tokens(chunk: dict[str, Any], reply: _Reply) -> int:
    """Tokens in a chunk (0 for role-only, finish and usage chunks); appends them to reply."""
    n = 0
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text = delta.get("content") if "delta" in choice else choice.get("text")
        ids = choice.get("token_ids")
        if ids:
            reply.token_ids = (reply.token_ids or []) + list(ids)
            n += len(ids)
        elif text:
            n += 1
        reply.text += text or ""
    return n
