"""The routing-policy interface: pick one worker for one request.

A policy sees only the candidates (healthy workers serving the leg's role, filtered by
``router.worker.healthy_workers``) and what the router extracted from the request. Policies
are pure Python and deterministic given the same candidates, loads and request, which is
what lets router replicas agree and the simulator reuse them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from splitserve.router.worker import LoadReport, Worker


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a policy may know about a request.

    ``session_key`` names the conversation (decode placement), ``prefix_key`` the part of the
    prompt shared across conversations (prefill placement); either may be None.
    ``prompt_token_ids``: the prompt as the workers tokenize it, when the router tokenizes
    (``router.prompt_tokens``, for the kv-events policy); else None. ``kv_salt``: the salt
    the workers hash its blocks with (its tenant's, ``common.tenants.kv_salt``); ``model``:
    the model the request names (a LoRA adapter's name selects its blocks in the index).
    """

    session_key: str | None = None
    prefix_key: str | None = None
    prompt_tokens: int = 0  # an estimate from the prompt's characters
    prompt_token_ids: Sequence[int] | None = None
    kv_salt: str = ""
    model: str | None = None


class RoutingPolicy(ABC):
    """Chooses a worker; told when requests finish and when loads are refreshed.

    The two hooks are optional (most policies read loads straight off the workers).
    """

    name: ClassVar[str] = ""  # the registry key; a class attribute, also when compiled

    @abstractmethod
    def select_worker(self, workers: Sequence[Worker], info: RequestInfo) -> Worker | None:
        """One of ``workers`` for this request, or None when ``workers`` is empty."""

    def home_worker(self, workers: Sequence[Worker], info: RequestInfo) -> Worker | None:
        """Where the request would go if every worker had room (None: no notion of home)."""
        return None

    def on_request_complete(self, worker: Worker, info: RequestInfo) -> None:  # noqa: B027
        """A request placed on ``worker`` finished (successfully or not)."""

    def update_loads(self, loads: Mapping[str, LoadReport]) -> None:  # noqa: B027
        """Fresh ``/load`` reports arrived, keyed by worker URL."""


def least_loaded(workers: Sequence[Worker]) -> Worker | None:
    """The worker with the fewest requests; ties go to the smallest URL (deterministic)."""
    return min(workers, key=lambda w: (w.load, w.url), default=None)
