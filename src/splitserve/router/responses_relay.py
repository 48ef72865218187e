"""Relaying a streamed ``/v1/responses`` answer, and resuming it on another builtin worker.

The Responses counterpart of ``migration.StreamRelay``, on the same mechanism: the router
asks the worker for token ids (``return_token_ids``: they come in ``splitserve.token_ids``
events, unnumbered, which the router strips) and logs the tokens whose text the client has.
Ids settle when a text delta arrives; ids whose text is held back (a tool call being written)
stay pending and are regenerated. When the worker dies, the next worker gets the client's
request again with the router's ``resume`` field: the prompt's and the settled ids, as for
chat, and what the client holds of the response: its id and ``created_at``, the message item
it has open and the next ``sequence_number``. That worker replays the output through the
request's state (``worker/resume.py``), stores the response under the same id and streams
the events the first would have sent next, so they pass unchanged::

    first worker:  created in_progress item.added part.added delta delta delta ✗
    next worker:                                                    delta delta text.done ...
                                                                    ... item.done completed
                   one sequence of numbers, one response id, one message item

A worker writes each engine step's events at once (``worker/response_events.py``), so the
client holds whole steps. Not resumed, the stream ending with an ``error`` event that says
why: a turn that continues a chain (``previous_response_id``: its conversation was stored on
the dead worker only), streams on vLLM workers, and a stream cut inside a step (the ending
events are one step: the response was complete, and stored, on the dead worker).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from splitserve.common.responses_api import TOKEN_IDS_EVENT
from splitserve.router.migration import EventRelay, IncompleteStream

DEFAULT_FAILURE = "the decode worker failed mid-stream and no worker could resume it"
# The events that end a response's output (all in its last step), and those that end it.
_ENDING = frozenset(
    {
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    }
)
_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})


def unresumable_reason(body: dict[str, Any], engine: str = "builtin") -> str | None:
    """Why a streamed Responses request cannot move to another worker; None if it can."""
    if engine == "vllm":
        return "the decode worker failed mid-stream (streams on vLLM workers are not resumed)"
    if body.get("previous_response_id") is not None:
        return (
            "the decode worker failed mid-stream; this turn continues a response chain whose "
            "conversation was stored on that worker, so no other worker can resume it"
        )
    return None


@dataclass(slots=True)
class ResponsesLog:
    """What one streamed response has delivered to its client."""

    max_tokens: int | None  # ``max_output_tokens``; None: the rest of the context window
    refusal: str | None = None  # why it cannot be resumed (``unresumable_reason``)
    prompt_ids: list[int] | None = None
    settled: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    response: dict[str, Any] = field(default_factory=dict)  # id, created_at
    item_added: str | None = None  # the message item the client was told of
    message_id: str | None = None  # ... and whose content part it has (the message is open)
    next_sequence: int = 0
    ending: bool = False  # the client has some of the ending events (not all)
    done: bool = False  # ... all of them, or an error event

    @classmethod
    def of(cls, body: dict[str, Any], refusal: str | None) -> ResponsesLog:
        limit = body.get("max_output_tokens")
        return cls(limit if isinstance(limit, int) else None, refusal)

    @property
    def resumable(self) -> bool:
        """Whether the client holds whole steps that another worker can go on from."""
        return (
            self.refusal is None
            and self.prompt_ids is not None
            and "id" in self.response
            and self.item_added == self.message_id
            and not self.ending
            and not self.done
        )

    @property
    def ended(self) -> bool:
        return self.done


class ResponsesRelay(EventRelay):
    """Relays one streamed response leg by leg (the interface ``resume.Resumer`` drives, as
    ``migration.StreamRelay``'s); every leg's events pass unchanged but for the stripped
    token-id events."""

    resume_path = "/v1/responses"

    def __init__(
        self,
        log: ResponsesLog,
        body: dict[str, Any],
        moved: Callable[[str], None] | None = None,
    ) -> None:
        self.log = log
        self.body = body
        self.moved = moved  # told the URL of the worker that finished a resumed response
        self._partial = b""

    def resumed_on(self, url: str) -> None:
        """The response was finished, and stored, by the worker at ``url``."""
        if self.moved is not None:
            self.moved(url)

    def feed(self, piece: bytes) -> bytes:
        *events, self._partial = (self._partial + piece).split(b"\n\n")
        return b"".join([self._event(e) for e in events if e.strip()])

    def end(self) -> None:
        """The leg ended; raises ``IncompleteStream`` unless the response had ended (a stream
        that could not be resumed anyway passes as it came, as before it was relayed here)."""
        if not self.log.done and self.log.refusal is None:
            raise IncompleteStream("the response stream ended before its last event")

    def resume_body(self, remaining: int) -> dict[str, Any]:
        """The next leg's body; ids still pending are regenerated (``remaining`` unused: the
        worker counts the output so far against ``max_output_tokens`` itself)."""
        log = self.log
        assert log.prompt_ids is not None
        log.pending = []
        resume = {
            "prompt_token_ids": log.prompt_ids,
            "output_token_ids": log.settled,
            "response_id": log.response["id"],
            "created_at": log.response["created_at"],
            "message_id": log.message_id,
            "sequence_number": log.next_sequence,
        }
        return {**self.body, "stream": True, "return_token_ids": True, "resume": resume}

    def remaining(self, max_model_len: int | None = None) -> int:
        """Tokens the next leg may still generate (``max_model_len`` when the client set no
        ``max_output_tokens``); 0 if none."""
        log = self.log
        assert log.prompt_ids is not None
        limit = log.max_tokens
        if limit is None:
            limit = (max_model_len or 0) - len(log.prompt_ids)
        return max(0, limit - len(log.settled))

    def end_spent(self, max_model_len: int | None = None) -> Iterator[bytes]:
        return iter(())  # one output: nothing ends apart from the whole response

    def finish_locally(self, reason: str = "length") -> Iterator[bytes]:
        """The response's end without a worker: nothing if the client has it. A stream whose
        tokens are all out but its ending events are not (cut inside its last step) cannot
        be ended here, where its response object is unknown: an error event."""
        if not self.log.done:
            yield self.error_event(
                "the decode worker failed as it sent the response's last events; "
                "the response was complete there but is lost"
            )

    def failure(self) -> str:
        """What the error event says when the stream could not be resumed."""
        if self.log.refusal is not None:
            return self.log.refusal
        if self.log.ending:
            return "the decode worker failed as it sent the response's last events"
        return DEFAULT_FAILURE

    def error_event(self, message: str) -> bytes:
        """A Responses ``error`` event, numbered after the client's last event; it ends the
        stream."""
        log = self.log
        data = {
            "type": "error",
            "sequence_number": log.next_sequence,
            "code": "worker_failed",
            "message": message,
            "param": None,
        }
        log.next_sequence += 1
        log.done = True
        return b"event: error\ndata: " + orjson.dumps(data) + b"\n\n"

    # ---- one event ---------------------------------------------------------------------

    def _event(self, event: bytes) -> bytes:
        data = _data(event)
        if data is None:
            return event + b"\n\n"  # a comment, or not ours to interpret
        if data.get("type") == TOKEN_IDS_EVENT:
            self._ids(data)
            return b""
        self._track(data)
        return event + b"\n\n"

    def _ids(self, data: dict[str, Any]) -> None:
        log = self.log
        prompt = data.get("prompt_token_ids")
        if log.prompt_ids is None and isinstance(prompt, list):
            log.prompt_ids = prompt
        log.pending += data.get("token_ids") or []

    def _track(self, data: dict[str, Any]) -> None:
        log, kind = self.log, data.get("type")
        sequence = data.get("sequence_number")
        if isinstance(sequence, int):
            log.next_sequence = sequence + 1
        if kind == "response.output_text.delta":
            log.settled += log.pending  # their text arrived
            log.pending = []
        elif kind == "response.created" and isinstance(data.get("response"), dict):
            response = data["response"]
            log.response = {k: response[k] for k in ("id", "created_at") if k in response}
        elif kind == "response.output_item.added":
            item = data.get("item") or {}
            if item.get("type") == "message":
                log.item_added = item.get("id")
            else:
                log.ending = True  # a function call: only the last step has them
        elif kind == "response.content_part.added":
            log.message_id = data.get("item_id")
        elif kind in _ENDING:
            log.ending = True
        elif kind in _TERMINAL:
            log.done = True


def _data(event: bytes) -> dict[str, Any] | None:
    """The JSON object of an SSE event's data, None if it has none (never raises: the bytes
    are a worker's, possibly not ours to read)."""
    lines = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    try:
        data = orjson.loads(b"\n".join(lines))
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None
