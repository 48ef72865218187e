"""Token log-probabilities in OpenAI's two shapes: chat (``choices[i].logprobs.content``) and
text completions (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``).

A token's text is what the tokenizer decodes for it alone (special tokens included); a token
that ends inside a multi-byte character decodes to U+FFFD, as in vLLM.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from splitserve.engine.plan import TokenLogprobs


class LogprobFormatter:
    def __init__(self, tokenizer: Any) -> None:
        decode = tokenizer.decode

        @lru_cache(maxsize=65536)
        def text(token_id: int) -> str:
            return decode([token_id], skip_special_tokens=False)

        self.text = text

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.text(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}

    def chat(self, entries: list[TokenLogprobs]) -> dict[str, Any]:
        content = []
        for e in entries:
            item = self._entry(e.token_id, e.logprob)
            item["top_logprobs"] = [self._entry(t, lp) for t, lp in e.top]
            content.append(item)
        return {"content": content, "refusal": None}

    def completion(self, entries: list[TokenLogprobs], offset: int = 0) -> dict[str, Any]:
        """``offset``: where the first token's text starts in the whole completion."""
        tokens, offsets = [], []
        for e in entries:
            tokens.append(self.text(e.token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": [
                {self.text(t): _finite(lp) for t, lp in e.top} if e.top else None for e in entries
            ],
            "text_offset": offsets,
        }


def _finite(logprob: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number. A token the model gives no chance.
    return logprob if logprob > -9999.0 else -9999.0
