"""uvicorn's httptools protocol with the router's two ASGI extensions: when each request
began to arrive, and a writer that puts a streamed answer's body straight on the client's
socket.

ASGI sends every body chunk as a message to an awaited ``send``, so a relayed chunk would
need a task of its own to wake up and await it. The router relays a worker's chunks from the
upstream connection's ``data_received`` instead (``leg.Leg``), and writes each one here, in
the same callback: the chunk's framing and one ``transport.write``, as uvicorn's own ``send``
does. The answer still starts and ends through ASGI ``send`` (status line, headers, the last
chunk, keep-alive), so uvicorn's request cycle stays in charge of the connection; the writer
is offered only while that answer is chunked, started and not complete. It also tells the
relay when the client hangs up (``watch``), which ASGI says only to a task awaiting
``receive``: one more task per request.

The scope's ``extensions`` get:

- ``RECEIVED_KEY``: ``time.monotonic()`` when the request's first bytes were parsed (the
  handler runs later, when the event loop reaches its task: ``timing``'s ``queued`` phase);
- ``WRITER_KEY``: a ``BodyWriter`` for this request's answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from splitserve.router.timing import RECEIVED_KEY, now

WRITER_KEY = "splitserve.body_writer"


class BodyWriter:
    """Writes body chunks of one chunked answer in progress, without awaiting."""

    __slots__ = ("_protocol", "_cycle")

    def __init__(self, protocol: RouterProtocol, cycle: RequestResponseCycle) -> None:
        self._protocol = protocol
        self._cycle = cycle

    @property
    def usable(self) -> bool:
        """Whether the answer was started with chunked framing and is not complete."""
        c = self._cycle
        return bool(c.response_started and c.chunked_encoding and not c.response_complete)

    @property
    def gone(self) -> bool:
        """The client disconnected."""
        return self._cycle.disconnected or self._cycle.transport.is_closing()

    def watch(self, on_gone: Callable[[], None]) -> None:
        """Call ``on_gone`` if the client's connection is lost (until ``unwatch``)."""
        self._protocol.on_lost.add(on_gone)

    def unwatch(self, on_gone: Callable[[], None]) -> None:
        self._protocol.on_lost.discard(on_gone)

    @property
    def paused(self) -> bool:
        """The client's socket buffer is full: stop producing until ``drain()``."""
        return self._cycle.flow.write_paused

    async def drain(self) -> None:
        await self._cycle.flow.drain()

    @property
    def finished(self) -> bool:
        """The answer is complete (``finish``)."""
        return self._cycle.response_complete

    def finish(self, data: bytes) -> bool:
        """The last body chunk (may be empty) and the answer's end, written together, and the
        request cycle completed (keep-alive, the next pipelined request) now, in this
        callback; False, having written nothing, when the client's buffer is full or gone:
        then ``data`` goes through ``write`` and the end through ASGI ``send``.

        uvicorn's own ``send`` does the completing: it awaits only to wait for a paused
        write to drain, so when writing is not paused one step of it runs to its end."""
        cycle = self._cycle
        if cycle.flow.write_paused or cycle.disconnected:
            return False
        step = cycle.send({"type": "http.response.body", "body": data, "more_body": False})
        try:
            step.send(None)
        except StopIteration:
            return True
        step.close()  # unreachable while writing is not paused (see above)
        raise RuntimeError("uvicorn's send awaited although writing was not paused")

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

    on_lost: set[Callable[[], None]]

    def connection_made(self, transport: Any) -> None:
        self.on_lost = set()
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        for on_gone in list(self.on_lost):
            on_gone()
        self.on_lost.clear()

    def shutdown(self) -> None:
        """At the server's shutdown an idle TLS connection is aborted, not closed: ``close()``
        sends close_notify and waits for the client's (up to 30 s), which a client holding
        the connection idle in its pool never reads to send, and the server waits for every
        connection to end. Between two requests nothing is lost by not waiting."""
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self.transport.get_extra_info("sslcontext") is not None:
            self.transport.abort()
            return
        super().shutdown()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {RECEIVED_KEY: now()}

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade
            self.scope["extensions"][WRITER_KEY] = BodyWriter(self, cycle)
