"""Placement by what the workers report they hold: the longest cached prefix wins.

The workers' KV events (``router/kv_index.py``) say which blocks each one holds; a request
goes to the worker holding the longest prefix of its prompt, among the workers under the
session policy's load bound, so a hot prefix cannot pile every request onto one worker.
Ties (a shared system prompt every worker holds) go to the first of them on the session's
ring, then to the least loaded. With no prompt tokens, or no worker under the bound holding
any of the prompt's blocks, the request is placed as the session policy places it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from splitserve.router.policies.base import RequestInfo
from splitserve.router.policies.session import SessionPolicy
from splitserve.router.ring import (
    DEFAULT_LOAD_FACTOR,
    DEFAULT_LOAD_FLOOR,
    DEFAULT_VNODES,
    load_cap,
)
from splitserve.router.worker import Worker

if TYPE_CHECKING:
    from splitserve.router.kv_index import KVIndex


class KVEventsPolicy(SessionPolicy):
    """``index``: the blocks each worker holds, kept by the router's event subscriber."""

    name = "kv-events"

    def __init__(
        self,
        index: KVIndex | None = None,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        vnodes: int = DEFAULT_VNODES,
        load_floor: int = DEFAULT_LOAD_FLOOR,
    ) -> None:
        super().__init__(load_factor, vnodes, load_floor)
        if index is None:
            from splitserve.router.kv_index import KVIndex

            index = KVIndex()
        self.index = index

    def select_worker(self, workers: Sequence[Worker], info: RequestInfo) -> Worker | None:
        if workers and info.prompt_token_ids:
            best = self._longest_prefix(workers, info)
            if best is not None:
                return best
        return super().select_worker(workers, info)

    def _longest_prefix(self, workers: Sequence[Worker], info: RequestInfo) -> Worker | None:
        ring = self._ring.sync(workers)
        loads = self._ring.loads
        cap = load_cap(sum(loads.values()), len(loads), self.load_factor, self.load_floor)
        room = [url for url, load in loads.items() if load < cap]
        matched = self.index.matches(room, info.prompt_token_ids or (), info.kv_salt, info.model)
        longest = max(matched.values(), default=0)
        if longest == 0:
            return None
        tied = {url for url, n in matched.items() if n == longest}
        url = None
        if info.session_key is not None and len(tied) > 1:
            url = ring.owner(info.session_key, tied.__contains__)
        if url is None:
            url = min(tied, key=lambda u: (loads[u], u))
        return self._ring.worker(url)
