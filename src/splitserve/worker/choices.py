"""``n > 1``: a request's choices as engine sequences of their own, read as one stream.

Choice ``i`` is the engine request ``{request_id}-{i}``. Choice 0 runs first; the others are
added once its first output is out, which is after its whole prompt was computed and its
full blocks published in the prefix cache, so they find those blocks there instead of
computing the prompt again (``cached_tokens`` of choices 1..n-1 is the prompt's cached part).

    choice 0:  [prefill ........][tok][tok][tok]...
    choice 1:                     [hit: prompt blocks][last block][tok][tok]...
    choice 2:                     [hit: prompt blocks][last block][tok][tok]...

Seeds: choice ``i`` samples with ``choice_seed(seed, i)`` (choice 0 with ``seed`` itself, so
its text is what ``n=1`` would give), which makes a seeded request reproducible while its
choices differ. Without a seed every choice draws from the global generator, independently.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from splitserve.common.protocol import INT64_MAX
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.outputs import RequestOutput
from splitserve.worker.metrics import RequestTracker


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed``: ``seed`` for choice 0,
    a stable hash of ``(seed, index)`` (a non-negative int64) for the others."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & INT64_MAX


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """``params`` for choice ``index``: the same but for the seed (see ``choice_seed``)."""
    if params.seed is None or index == 0:
        return params
    return replace(params, seed=choice_seed(params.seed, index))


def choice_id(request_id: str, index: int) -> str:
    return f"{request_id}-{index}"


class ChoiceStreams:
    """The outputs of a request's choice streams, interleaved as they come, each with
    ``outputs[0].index`` set to its choice. Ends once every choice added has finished (all
    ``n`` of them, but for the ended choices of a resumed request); an error from any choice
    ends it with that error. Closing it closes (aborts) every choice."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._streams: list[Any] = []
        self._pumps: list[asyncio.Task] = []
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._first = asyncio.Event()
        self._first_ok = False

    def add(self, stream: Any, index: int) -> None:
        """Choice ``index``'s stream (the first one added computes the prompt)."""
        first = not self._streams
        self._streams.append(stream)
        self._pumps.append(asyncio.ensure_future(self._pump(index, stream, first)))

    @property
    def n_added(self) -> int:
        return len(self._streams)

    async def first_output(self) -> bool:
        """Wait for the first choice's first output (the prompt is then cached); False if it
        failed instead (the error is what iterating raises)."""
        await self._first.wait()
        return self._first_ok

    async def _pump(self, index: int, stream: Any, first: bool) -> None:
        try:
            async for out in stream:
                out.outputs[0].index = index
                self._queue.put_nowait(out)
                if first and not self._first.is_set():
                    self._first_ok = True
                    self._first.set()
        except Exception as e:
            self._queue.put_nowait(e)
        finally:
            self._first.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        finished = 0
        try:
            while finished < len(self._streams):
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished += item.finished
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Abort every choice still running; safe to call more than once."""
        for stream in self._streams:
            stream.close()
        for pump in self._pumps:
            pump.cancel()


class ChoiceTrackers:
    """One ``RequestTracker`` per choice (each choice is an engine request), fed by index."""

    def __init__(self, make: Callable[[], RequestTracker], n: int) -> None:
        self._trackers = [make() for _ in range(n)]

    def on_output(self, out: RequestOutput) -> None:
        self._trackers[out.outputs[0].index].on_output(out)


def shared_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """The prompt blocks every choice takes from the cache: its full blocks but the one
    holding the last token (``BlockManager.reusable_blocks``)."""
    return (num_prompt_tokens - 1) // block_size


def request_blocks(num_prompt_tokens: int, max_tokens: int, n: int, block_size: int) -> int:
    """The KV blocks a request of ``n`` choices may come to hold: the shared prompt blocks
    once, and each choice's own blocks (the prompt's tail and every token it may write)."""
    total = -(-(num_prompt_tokens + max_tokens) // block_size)
    shared = shared_blocks(num_prompt_tokens, block_size) if n > 1 else 0
    return shared + n * (total - shared)
