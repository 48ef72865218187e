"""Finding a response chain's conversation when it is not where the chain's key places it.

Every turn of a chain is keyed by the chain (``session.chain_key``), so it lands on the
worker the policy picks for that key. A response that moved is stored elsewhere: a stream
resumed on another worker (``responses_relay``) is stored by the worker that finished it,
and so is every later turn that continues it there. Once the chain's first worker is back,
or whenever the policy's choice differs, a turn lands on a worker that answers 400
``previous_response_not_found``. Two things keep such a chain going:

- ``search``: on that 400 the router asks the other live decode workers, each at most once,
  and passes the 400 on only when none holds the response. Stateless: any router replica,
  restarted or not, finds the conversation this way.
- ``ChainHomes``: the router remembers, for a bounded number of chains (least recently used
  forgotten first), the worker it found a chain's response on or resumed its stream on, and
  sends the chain's next turns there first. A hint only: a replica without it searches once,
  then remembers too; a remembered worker that is down or has lost the response is
  searched past like any other.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

from splitserve.router.headers import DECODE_HEADER
from splitserve.router.placement import Decision
from splitserve.router.replies import Buffered, Reply
from splitserve.router.worker import Worker

NOT_FOUND_CODE = "previous_response_not_found"
DEFAULT_CAPACITY = 65536


class ChainHomes:
    """Chain -> the URL of the worker that holds its latest response, where that is known
    to differ from the chain's placement; at most ``capacity`` chains."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._homes: OrderedDict[str, str] = OrderedDict()

    def get(self, chain: str | None) -> str | None:
        if chain is None or chain not in self._homes:
            return None
        self._homes.move_to_end(chain)
        return self._homes[chain]

    def moved(self, chain: str | None, url: str) -> None:
        """The chain's latest response is stored on ``url``."""
        if chain is None:
            return
        self._homes[chain] = url
        self._homes.move_to_end(chain)
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)

    def __len__(self) -> int:
        return len(self._homes)

    def placed(self, chain: str | None, candidates: Sequence[Worker]) -> Decision | None:
        """The turn's placement on the candidate its chain's latest response is known to be
        on, if any: served whole there (no remote prefill), where its KV is."""
        url = self.get(chain)
        worker = next((w for w in candidates if w.url == url), None) if url else None
        return None if worker is None else Decision(worker, False, None, None)

    async def find(
        self,
        reply: Reply,
        chain: str | None,
        next_worker: Callable[[], Worker | None],
        attempt: Callable[[Worker], Awaitable[Reply]],
    ) -> Reply:
        """``search``; the chain's next turns go first to the worker found holding it."""
        reply = await search(reply, next_worker, attempt)
        if reply.status < 400:
            self.moved(chain, reply.headers[DECODE_HEADER])
        return reply


def previous_not_found(reply: Reply) -> bool:
    """Whether ``reply`` is a worker's 400 ``previous_response_not_found``."""
    if not isinstance(reply, Buffered) or reply.status != 400:
        return False
    try:
        error = json.loads(reply.content).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == NOT_FOUND_CODE


async def search(
    reply: Reply,
    next_worker: Callable[[], Worker | None],
    attempt: Callable[[Worker], Awaitable[Reply]],
) -> Reply:
    """While ``reply`` is ``previous_response_not_found``, the next worker's answer:
    ``next_worker`` picks one not asked yet (None: none is left, and the last 400 stands),
    ``attempt`` asks it, with its own retries should it fail."""
    while previous_not_found(reply) and (worker := next_worker()) is not None:
        reply = await attempt(worker)
    return reply
