"""Where one request runs: the router's placement decision, with no I/O.

The router (``proxy``) and the simulator (``sim.cluster``) both call ``place``, so the
simulated deployment places every request by the rules the real one uses::

    decode policy picks D ─▶ disaggregating, and the prompt's uncached part on D reaches
        │                    the threshold?
        │ no                       │ yes: the prefill policy picks P among the prefill
        │                          ▼ workers other than D (none left: D prefills)
        ▼                    P prefills, D pulls the KV
    D prefills; a turn placed off its session's healthy home, with peer fetch on, names the
    home (the peer hint) for D to pull the conversation's KV from

The uncached part is an estimate (``Uncached``): the router does not tokenize, and it
assumes, statelessly so that replicas agree, that a session's home holds everything up to
the last assistant message, which is what the previous turn left in its cache.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from splitserve.router.policies.base import RequestInfo, RoutingPolicy
from splitserve.router.worker import Worker


@dataclass(frozen=True, slots=True)
class PlacementRules:
    """The deployment's settings that the decision reads."""

    disaggregate: bool = False  # remote prefills are possible at all
    remote_prefill_threshold: float = 0.0  # uncached prompt tokens at which one pays
    kv_peer_fetch: bool = False  # name the home of a turn placed elsewhere


class Uncached(NamedTuple):
    """Prompt tokens the decode worker probably lacks: on the session's home, elsewhere."""

    on_home: float
    elsewhere: float


class Decision(NamedTuple):
    decode: Worker
    # The uncached part on ``decode`` reached the threshold: a remote prefill is wanted.
    remote_prefill: bool
    prefill: Worker | None  # the prefill leg's worker; None: ``decode`` prefills
    peer: Worker | None  # where a turn prefilled on ``decode`` pulls its session's KV from


def place(
    info: RequestInfo,
    decode_candidates: Sequence[Worker],
    prefill_candidates: Callable[[Worker], Sequence[Worker]],
    decode_policy: RoutingPolicy,
    prefill_policy: RoutingPolicy,
    home: Worker | None,
    uncached: Uncached,
    rules: PlacementRules,
) -> Decision | None:
    """The decision for one request; None when no decode candidate is left.

    ``prefill_candidates(decode)``: the prefill workers that may take the prefill leg of a
    request decoded on ``decode``. ``home``: the session's home worker, if it has one.
    """
    decode = decode_policy.select_worker(decode_candidates, info)
    if decode is None:
        return None
    on_home = home is not None and home.url == decode.url
    remote = rules.disaggregate and (
        (uncached.on_home if on_home else uncached.elsewhere) >= rules.remote_prefill_threshold
    )
    prefill = prefill_policy.select_worker(prefill_candidates(decode), info) if remote else None
    peer = None
    if rules.kv_peer_fetch and home is not None and not on_home and home.healthy:
        peer = home
    return Decision(decode, remote, prefill, peer)


def uncached_from_body(body: dict[str, Any], chars_per_token: float, on_home: bool) -> Uncached:
    """The router's estimate from the request body, at ``chars_per_token``; the part on the
    home is only worked out when ``on_home`` is asked for (else it is the whole prompt)."""
    elsewhere = uncached_chars(body, False) / chars_per_token
    at_home = uncached_chars(body, True) / chars_per_token if on_home else elsewhere
    return Uncached(at_home, elsewhere)


def uncached_chars(body: dict[str, Any], on_home: bool) -> int:
    """Characters of the prompt the decode worker probably has not cached."""
    if "input" in body:  # /v1/responses
        return _responses_chars(body)
    messages = body.get("messages")
    if isinstance(messages, list):
        start = _after_last_assistant(messages) if on_home else 0
        return sum(_chars(m) for m in messages[start:])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return 4 * len(prompt)  # token ids: report them in the same character currency
    return 0


def _responses_chars(body: dict[str, Any]) -> int:
    """A Responses request's own part of its prompt: instructions, tools and input. A turn
    that continues a chain (``previous_response_id``) has the stored conversation ahead of
    it, which only its decode home holds: that turn is served there whole (``proxy``)."""
    instructions, tools, items = body.get("instructions"), body.get("tools"), body.get("input")
    chars = len(instructions) if isinstance(instructions, str) else 0
    if isinstance(tools, list):
        chars += len(json.dumps(tools))
    if isinstance(items, str):
        return chars + len(items)
    for item in items if isinstance(items, list) else ():
        if isinstance(item, dict):
            parts = (item.get("content"), item.get("output"), item.get("arguments"))
            chars += sum(_chars({"content": p}) for p in parts)
    return chars


def _after_last_assistant(messages: list[Any]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if isinstance(messages[i], dict) and messages[i].get("role") == "assistant":
            return i + 1
    return 0


def _chars(message: Any) -> int:
    if not isinstance(message, dict):
        return 0
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return 0
