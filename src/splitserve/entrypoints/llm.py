"""The offline API, shaped like vLLM's: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from splitserve.common.sampling_params import InvalidParameter, SamplingParams
from splitserve.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import RequestOutput

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """Generate text offline with continuous batching. ``model=None`` uses the bundled model."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in the prompts' order."""
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        requests = [self._encode(p) for p in prompts]
        return self._run(requests, params, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        params = _per_prompt(sampling_params, len(conversations))
        requests = []
        for conv in conversations:
            if not conv:
                raise InvalidParameter("messages", "messages is empty")
            requests.append((None, self.tokenizer.apply_chat_template(conv, tools=tools)))
        return self._run(requests, params, False)

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameter("prompt", "prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and not prompt:
            raise InvalidParameter("prompt", "prompt is empty")
        if _is_token_ids(prompt):
            return None, list(prompt)
        raise InvalidParameter(
            "prompt",
            f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}",
        )

    def _run(self, requests, params, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        for _, ids in requests:  # validate everything before queueing anything
            engine.validate_prompt(ids)
        order: dict[str, int] = {}
        for i, ((text, ids), p) in enumerate(zip(requests, params, strict=True)):
            rid = f"llm-{next(self._ids)}"
            engine.add_request(rid, ids, p, prompt=text)
            order[rid] = i
        results: list[RequestOutput | None] = [None] * len(requests)
        bar = _progress(len(requests)) if use_tqdm else None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return results  # type: ignore[return-value]


def _is_token_ids(x: object) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) for t in x)


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidParameter(
            "sampling_params", f"got {len(params)} sampling params for {n} prompts"
        )
    return params


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
