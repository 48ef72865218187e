"""uvicorn's httptools protocol with the router's two ASGI extensions: when each request
began to arrive, and a writer that puts a streamed answer's body straight on the client's
socket.

ASGI sends every body chunk as a message to an awaited ``send``, so a relayed chunk would
need a task of its own to wake up and await it. The router relays a worker's chunks from the
upstream connection's ``data_received`` instead (``leg.Leg``), and writes each one here, in
the same callback: the chunk's framing and one ``transport.write``, as uvicorn's own ``send``
does. The answer still starts and ends through ASGI ``send`` (status line, headers, the last
chunk, keep-alive), so uvicorn's request cycle stays in charge of the connection; the writer
is offered only while that answer is chunked, started and not complete.

The scope's ``extensions`` get:

- ``RECEIVED_KEY``: ``time.monotonic()`` when the request's first bytes were parsed (the
  handler runs later, when the event loop reaches its task: ``timing``'s ``queued`` phase);
- ``WRITER_KEY``: a ``BodyWriter`` for this request's answer.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from splitserve.router.timing import RECEIVED_KEY, now

WRITER_KEY = "splitserve.body_writer"


class BodyWriter:
    """Writes body chunks of one chunked answer in progress, without awaiting."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle

    @property
    def usable(self) -> bool:
        """Whether the answer was started with chunked framing and is not complete."""
        c = self._cycle
        return bool(c.response_started and c.chunked_encoding and not c.response_complete)

    @property
    def gone(self) -> bool:
        """The client disconnected."""
        return self._cycle.disconnected

    @property
    def paused(self) -> bool:
        """The client's socket buffer is full: stop producing until ``drain()``."""
        return self._cycle.flow.write_paused

    async def drain(self) -> None:
        await self._cycle.flow.drain()

    def write(self, data: bytes) -> None:
        """One body chunk (not empty: an empty chunk would end the answer)."""
        cycle = self._cycle
        if not cycle.disconnected:
            cycle.transport.write(b"%x\r\n%s\r\n" % (len(data), data))


def body_writer(scope: dict[str, Any]) -> BodyWriter | None:
    """The request's writer, when the server offers one (uvicorn with ``RouterProtocol``)."""
    extensions = scope.get("extensions")
    return None if extensions is None else extensions.get(WRITER_KEY)


class RouterProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, stamping arrivals and offering a ``BodyWriter``.

    ``on_message_begin`` runs inside ``data_received``, as soon as the event loop reads the
    request's first bytes; ``on_headers_complete`` creates the request's cycle (also for a
    pipelined request, which waits for the one before it).
    """

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {RECEIVED_KEY: now()}

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade
            self.scope["extensions"][WRITER_KEY] = BodyWriter(cycle)
