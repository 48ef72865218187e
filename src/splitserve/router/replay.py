"""Replaying a stream on a vLLM worker: which of the replayed leg's chunks the client already has.

The replayed leg is the client's request again (``ResumeMode.REPLAY``), so it streams the whole
output from its first token. Each choice's chunks are skipped until they have covered as many
ids as the client was sent of that choice (every id of every chunk relayed, including chunks
whose text was held back or dropped), each id checked against the one delivered; the chunks
after that are the stream's continuation::

    delivered to the client:   a b c d e | (lost with the worker)
    replayed leg's chunks:     [a] [b c] [d] [e f] [g] ...
                               skipped, ids checked  relayed (the first leg's id and created)
                                             [e f]: f relayed, e and its text cut off

vLLM puts several tokens in one chunk when its reader lags, so a chunk may cover the last
delivered ids and new ones. Its head is cut off: the delivered ids, their log-probabilities
(one entry each) and as many characters of its text as the client has beyond the chunks
skipped. Text is a function of the ids up to a chunk's end whatever the chunking (the
detokenizer, stop strings and vLLM's named-tool deltas all work on the text so far), so the
cut falls where the client's text ends. A chunk whose text is not one piece (content and a
call, several calls) or starts a call is not cut.

vLLM is not batch-invariant: in another batch a near tie may go the other way. A replayed id
that differs from the delivered one raises ``ReplayDiverged``, as does a chunk that cannot be
cut: the client cannot be given a consistent continuation, and its stream ends with an error
event.
"""

from __future__ import annotations

from typing import Any

from splitserve.router.stream_log import ChoiceLog


class ReplayDiverged(Exception):
    """The replayed stream is not the one the client has been reading."""


def ids_sent(c: ChoiceLog, choice: dict[str, Any]) -> int | None:
    """How many of a replayed chunk's ids the client has: None if it has the whole chunk
    (skip it), else the count to cut from its head (0: relay it whole). Counts the chunk in
    ``c.replayed`` (and a skipped chunk's text in ``c.replayed_chars``). Raises
    ``ReplayDiverged`` where the replay differs from what was sent."""
    ids = choice.get("token_ids") or []
    start, delivered = c.replayed, c.length
    if c.ended:
        return None  # a choice that ended is not sent again
    if not ids:  # the role chunk, or an ending the client has not had
        if choice.get("finish_reason") is not None and start < delivered:
            raise ReplayDiverged(f"the replay ended after {start} of {delivered} tokens")
        opened = "role" in (choice.get("delta") or {}) and c.opened
        return None if start < delivered or opened else 0
    c.replayed += len(ids)
    if start >= delivered:  # past what the client has
        return 0
    have = min(len(ids), delivered - start)
    if ids[:have] != delivered_ids(c, start, start + have):
        raise ReplayDiverged(f"the replay chose other tokens than were sent at {start}")
    if have < len(ids):
        return have
    c.replayed_chars += text_chars(choice)
    return None


def cut_head(choice: dict[str, Any], have: int, chars: int) -> None:
    """Cut from a replayed chunk's ``choice`` what the client has: its first ``have`` ids,
    their log-probabilities and the first ``chars`` characters of its text."""
    choice["token_ids"] = choice["token_ids"][have:]
    lp = choice.get("logprobs")
    if lp is not None and "content" in lp:  # chat: one entry per token
        lp["content"] = (lp["content"] or [])[have:]
    elif lp is not None:  # a text completion's parallel lists
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            if lp.get(key) is not None:
                lp[key] = lp[key][have:]
    pieces, starts_call = _text_pieces(choice)
    if starts_call or len(pieces) > 1 or (not pieces and chars):
        raise ReplayDiverged("a replayed chunk across the resume point cannot be cut")
    if pieces:
        holder, key = pieces[0]
        if not 0 <= chars <= len(holder[key]):
            raise ReplayDiverged("a replayed chunk's text does not reach the client's")
        holder[key] = holder[key][chars:]


def text_chars(choice: dict[str, Any]) -> int:
    """The characters of text (content, a completion's text, calls' arguments) in ``choice``."""
    return sum(len(holder[key]) for holder, key in _text_pieces(choice)[0])


def _text_pieces(choice: dict[str, Any]) -> tuple[list[tuple[dict[str, Any], str]], bool]:
    """Where ``choice`` holds text, as (dict, key) pairs; and whether it starts a call."""
    delta = choice.get("delta")
    if delta is None:
        return ([(choice, "text")] if choice.get("text") else []), False
    pieces = [(delta, "content")] if delta.get("content") else []
    starts_call = False
    for call in delta.get("tool_calls") or []:
        function = call.get("function") or {}
        starts_call = starts_call or call.get("id") is not None or bool(function.get("name"))
        if function.get("arguments"):
            pieces.append((function, "arguments"))
    return pieces, starts_call


def delivered_ids(c: ChoiceLog, start: int, end: int) -> list[int]:
    """The ids ``start:end`` of those sent of choice ``c`` (its settled ids, then pending)."""
    settled = len(c.settled)
    head = c.settled[start : min(end, settled)]
    return head + c.pending[max(start - settled, 0) : max(end - settled, 0)]
