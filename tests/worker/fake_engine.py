"""A model-free engine with ``LLMEngine``'s interface, for fast tests of the HTTP layer.

Every request generates ``"a", "b", "c", ...`` one token per step, until ``max_tokens``.
``hold`` keeps new requests waiting; ``fail_next_step`` makes the next ``step()`` raise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.outputs import CompletionOutput, RequestOutput


class FakeTokenizer:
    eos_token_ids = [0]

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 250 + 1 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + (i - 1) % 26) for i in ids)

    def apply_chat_template(self, messages, tools=None) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + "<assistant>")


@dataclass
class _Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)


class FakeEngine:
    model_id = "fake-model"
    max_model_len = 256
    model_config = SimpleNamespace(vocab_size=256)

    def __init__(self, step_s: float = 0.002) -> None:
        self.tokenizer = FakeTokenizer()
        self.block_manager = SimpleNamespace(num_used_blocks=0, num_blocks=100)
        self.step_s = step_s
        self.hold = False
        self.fail_next_step = False
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.salts: list[str] = []  # the KV salt of every request added

    def add_request(
        self, request_id, prompt_token_ids, params, prompt=None, salt="", keep_blocks=False
    ) -> None:
        self.salts.append(salt)
        self.waiting.append(_Req(request_id, list(prompt_token_ids), params))

    def abort_request(self, request_id: str) -> None:
        self.waiting = [r for r in self.waiting if r.request_id != request_id]
        self.running = [r for r in self.running if r.request_id != request_id]
        self._account()

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or (self.waiting and not self.hold))

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected failure")
        if not self.hold:
            self.running += self.waiting
            self.waiting = []
        outputs = [self._advance(r) for r in self.running]
        self.running = [r for r in self.running if len(r.output) < r.params.max_tokens]
        self._account()
        return outputs

    def _advance(self, r: _Req) -> RequestOutput:
        r.output.append(len(r.output) % 26 + 1)
        done = len(r.output) >= r.params.max_tokens
        text = self.tokenizer.decode(r.output)
        return RequestOutput(
            request_id=r.request_id,
            prompt=None,
            prompt_token_ids=r.prompt_ids,
            outputs=[CompletionOutput(0, text, list(r.output), "length" if done else None)],
            finished=done,
            delta_text=text[-1],
            delta_token_ids=[r.output[-1]],
        )

    def _account(self) -> None:
        self.block_manager.num_used_blocks = len(self.running)
