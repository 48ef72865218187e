"""A stream resumed here after the worker that began it died (the router's ``resume`` field).

The router sends the client's request again, with the prompt ids the first worker reported
and the output tokens whose text the client already has::

    first worker:  [prompt][out 0 .. k-1: sent to the client][out k ..  ✗ lost]
    this worker:   [prompt][out 0 .. k-1: replayed, not sent][out k ..: streamed]

They become the engine request's first output (``LLMEngine.add_request(output_token_ids=)``),
so everything that depends on the output so far goes on from the same state: a seed's draws
(indexed by the output's length), penalties (counted over it), the grammar's matcher (which
consumes it), stop strings (the detokenizer starts with its text), ``max_tokens`` (it counts).
The stream starts where the first left off: no role chunk, the tool-call filter primed with
the output's text, so it holds back and releases what the first worker's did, and the text
offsets of completion log-probabilities counted from the output's tokens. Greedy and seeded
streams therefore go on with the tokens the first worker would have produced, and usage
counts the whole request. A request of ``n > 1`` resumes each choice from its own output
(``resume.choices``); a choice that had ended is not run again, only counted in the usage.
"""

from __future__ import annotations

from dataclasses import replace

from splitserve.common.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.worker.errors import bad_request
from splitserve.worker.prepare import EngineInput, ModelInfo, Resumed


def resumed_input(
    req: ChatCompletionRequest | CompletionRequest, inp: EngineInput, model: ModelInfo
) -> EngineInput:
    """``inp`` carrying the output of ``req.resume`` (unchanged without one); a 400 when the
    resumed request cannot continue here."""
    resume = req.resume
    if resume is None:
        return inp
    if req.kv_transfer_params:
        raise bad_request(
            "a resumed request computes its prompt here (no kv_transfer_params)",
            param="kv_transfer_params",
        )
    if resume.prompt_token_ids != inp.prompt_token_ids:
        raise bad_request(
            "resume.prompt_token_ids differ from this worker's prompt (another model or "
            "chat template?)",
            param="resume.prompt_token_ids",
        )
    n = req.n or 1
    if n == 1:
        if resume.choices is not None:
            raise bad_request("resume.choices is for n > 1", param="resume.choices")
        return replace(inp, resumed=_resumed(resume.output_token_ids, None, inp, model))
    # n > 1: each choice goes on from its own output; those that had ended are not run.
    if resume.choices is None or len(resume.choices) != n or resume.output_token_ids:
        raise bad_request(
            f"a resumed request of n={n} names each choice's output in resume.choices",
            param="resume.choices",
        )
    if not req.stream:
        raise bad_request("a resumed request of n > 1 streams", param="stream")
    choices = tuple(
        _resumed(c.output_token_ids, c.finish_reason, inp, model) for c in resume.choices
    )
    if all(c.finish_reason is not None for c in choices):
        raise bad_request("every choice of the resumed request has ended", param="resume")
    return replace(inp, resumed_choices=choices)


def _resumed(
    ids: list[int], finish_reason: str | None, inp: EngineInput, model: ModelInfo
) -> Resumed:
    if any(t < 0 or t >= model.vocab_size for t in ids):
        raise bad_request(
            f"resume.output_token_ids must be in [0, {model.vocab_size})",
            param="resume.output_token_ids",
        )
    # The engine's detokenizer settles the same text from the same tokens (llm_engine.py).
    text = IncrementalDetokenizer(model.tokenizer.decode, stop=list(inp.params.stop)).update(ids)
    return Resumed(list(ids), text, finish_reason)
