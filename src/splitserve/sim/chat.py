"""The chat template's own tokens, for sessions sent through the chat API.

A real server renders chat messages through the model's template before it tokenizes them.
With ChatML (SmolLM2, Qwen) each message is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``
and the prompt ends with ``<|im_start|>assistant\\n``, which the reply follows and the next
turn closes. bench's sessions hold only the messages' contents; with
``SimConfig(chat_template=True)`` the simulated prompts carry these tokens too (3 before and
2 after each message; 4 for the assistant's opening, whose role is two tokens in SmolLM2's
vocabulary), so they are as long as the bundled model's real ones and their blocks fall where
the real ones do (``tests/sim/test_chat.py`` renders both). The ids stand in for the
template's tokens; only their number and their being the same in every session matter.
"""

from __future__ import annotations

from collections.abc import Iterable

from splitserve.workload.sessions import API_CHAT, Segment, SessionSpec

IM_START, IM_END, NEWLINE = 1, 2, 198
ROLES = {"system": (9690,), "user": (4093,), "assistant": (520, 9531), "tool": (11696,)}
MESSAGE_CLOSE = (IM_END, NEWLINE)


def message_open(role: str) -> tuple[int, ...]:
    return (IM_START, *ROLES.get(role, ROLES["user"]), NEWLINE)


def append_prompt(context: list[int], segments: Iterable[Segment], chat: bool) -> None:
    """A turn's new messages onto ``context``; rendered, then opening the reply, if ``chat``."""
    for seg in segments:
        append_message(context, seg, chat)
    if chat:
        context.extend(message_open("assistant"))


def append_message(context: list[int], seg: Segment, chat: bool) -> None:
    """One message onto ``context``, rendered if ``chat``."""
    if not chat:
        context.extend(seg.token_ids)
        return
    context.extend(message_open(seg.role))
    context.extend(seg.token_ids)
    context.extend(MESSAGE_CLOSE)


def append_reply(context: list[int], output: Iterable[int], chat: bool) -> None:
    """The reply onto ``context``, closed as the next turn's prompt renders it if ``chat``."""
    context.extend(output)
    if chat:
        context.extend(MESSAGE_CLOSE)


def rendered(chat_template: bool, api: str) -> bool:
    """Whether a session's prompts carry the template's tokens: chat sessions, if on."""
    return chat_template and api == API_CHAT


def synthetic_stream(spec: SessionSpec, chat: bool) -> list[int]:
    """The session's whole token stream when every reply is its synthetic one: each turn's
    prompt is a prefix of it, and so is each of its sequences' tokens."""
    stream: list[int] = []
    for turn in spec.turns:
        append_prompt(stream, turn.segments, chat)
        append_reply(stream, turn.output_ids, chat)
    return stream
