"""The first leg of a streamed answer: the worker's body relayed to the client as it arrives.

Every streamed chunk passes here. With the server's ``BodyWriter`` (``push``) a chunk is
relayed inside the upstream connection's ``data_received``: parsed and re-shaped by the
``StreamRelay`` (token bookkeeping for migration) and written to the client's socket, with
no task woken per chunk. Pieces that arrive together are relayed together, as one write.
Without a writer (another ASGI server) ``pull`` reads and sends the same chunks from the
request's task. Either way the leg ends with None (the worker finished the stream), the
failure that broke it, which the proxy answers by migrating the stream, or ``CLIENT_GONE``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from splitserve.router.migration import StreamRelay
from splitserve.router.response import Response, UpstreamError
from splitserve.router.responses_relay import ResponsesRelay
from splitserve.router.server import BodyWriter


class ClientGone(Exception):
    """The client hung up while its stream was relayed."""


CLIENT_GONE = ClientGone()


class Leg:
    """A streamed answer's first leg; ``first``: its first piece, already read."""

    __slots__ = ("first", "response", "relay", "_out", "_done", "_resumer")

    def __init__(
        self, first: bytes, response: Response, relay: StreamRelay | ResponsesRelay | None
    ) -> None:
        self.first = first
        self.response = response
        self.relay = relay  # None: the bytes pass as they are (no migration bookkeeping)
        self._out: BodyWriter | None = None
        self._done: asyncio.Future | None = None
        self._resumer: asyncio.Future | None = None  # waits for the client to drain

    async def push(self, out: BodyWriter) -> Exception | None:
        """Relay the leg to ``out`` from the connection's callbacks; returns when it ends."""
        self._out = out
        self._done = done = asyncio.get_running_loop().create_future()
        if out.gone:
            return CLIENT_GONE
        out.watch(self._client_gone)
        try:
            self.data(self.first)
            if not done.done():
                self.response.pipe(self)
            return await done
        finally:
            out.unwatch(self._client_gone)

    async def pull(self, send: Callable[[dict[str, Any]], Awaitable[None]]) -> Exception | None:
        """Relay the leg through ASGI ``send``, one message per piece read."""
        piece = self.first
        try:
            while piece:
                out = self._feed(piece)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                piece = await self.response.piece()
            self._end()
        except Exception as e:  # the worker's failure or a malformed chunk: see ``push``
            return e
        return None

    # ---- response.Sink -----------------------------------------------------------------

    def data(self, piece: bytes) -> None:
        done, out = self._done, self._out
        assert done is not None and out is not None
        if done.done():
            return
        try:
            relayed = self._feed(piece)
        except Exception as e:  # never into the event loop's callback: the stream migrates
            done.set_result(e)
            return
        if relayed:
            out.write(relayed)
            if out.paused and self._resumer is None:
                self.response.pause()
                self._resumer = asyncio.ensure_future(self._resume_when_drained(out))

    def end(self, last: bytes) -> None:
        done, out = self._done, self._out
        assert done is not None and out is not None
        if done.done():
            return
        try:
            relayed = self._feed(last) if last else b""
        except Exception as e:
            done.set_result(e)
            return
        try:
            self._end()
        except Exception as e:  # no [DONE]: what came still reaches the client, then migrate
            if relayed:
                out.write(relayed)
            done.set_result(e)
            return
        if not out.finish(relayed):
            if relayed:
                out.write(relayed)
        done.set_result(None)

    def failed(self, error: UpstreamError) -> None:
        assert self._done is not None
        if not self._done.done():
            self._done.set_result(error)

    def _client_gone(self) -> None:
        assert self._done is not None
        if not self._done.done():
            self._done.set_result(CLIENT_GONE)

    # ---- both modes ----------------------------------------------------------------------

    def _feed(self, piece: bytes) -> bytes:
        return piece if self.relay is None else self.relay.feed(piece)

    def _end(self) -> None:
        if self.relay is not None:
            self.relay.end()  # raises IncompleteStream unless the stream ended with [DONE]

    async def _resume_when_drained(self, out: BodyWriter) -> None:
        await out.drain()
        self._resumer = None
        self.response.resume()
