"""A worker's answer as the router's client (``upstream``) delivers it: status, headers and a
body pulled piece by piece or pushed to a ``Sink``, and the errors of an exchange."""

from __future__ import annotations

import asyncio
from typing import Protocol


class Wire(Protocol):
    """The connection an answer arrives on (``upstream``'s)."""

    loop: asyncio.AbstractEventLoop

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def finish(self, response: Response) -> None: ...


class UpstreamError(Exception):
    """A failed exchange with a worker. ``dropped``: an open connection the worker closed or
    reset before any answer ("Server disconnected", "Connection reset by peer"), as opposed
    to one that could not be opened, a timeout or a malformed answer: the same request may go
    out once more over another connection."""

    def __init__(self, message: str, dropped: bool = False) -> None:
        super().__init__(message)
        self.dropped = dropped


class Sink(Protocol):
    """Where a piped body goes; called from the event loop's I/O callbacks, never awaited."""

    def data(self, piece: bytes) -> None: ...

    def end(self, last: bytes) -> None: ...

    def failed(self, error: UpstreamError) -> None: ...


def dropped(error: BaseException) -> bool:
    """Whether ``error`` is a connection the worker closed or reset before answering."""
    return isinstance(error, UpstreamError) and error.dropped


class Response:
    """One answer's status, headers (by lower-case name) and body, pulled or piped."""

    __slots__ = (
        *("status", "headers", "_conn", "_pieces", "_waiter"),
        *("_complete", "_error", "_sink", "_ended"),
    )

    def __init__(self, conn: Wire, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers
        self._conn = conn
        self._pieces: list[bytes] = []
        self._waiter: asyncio.Future | None = None
        self._complete = False
        self._error: UpstreamError | None = None
        self._sink: Sink | None = None
        self._ended = False  # the sink was told how the body ended

    async def piece(self) -> bytes:
        """The body's next bytes as they arrived; b"" at its end."""
        while not self._pieces:
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pieces, self._pieces = self._pieces, []
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while piece := await self.piece():
            parts.append(piece)
        return b"".join(parts)

    def pipe(self, sink: Sink) -> None:
        """From now on, every piece of the body goes to ``sink`` as it arrives."""
        self._sink = sink
        self._flush()

    def pause(self) -> None:
        """Stop reading from the worker (the client is not keeping up)."""
        self._conn.pause()

    def resume(self) -> None:
        self._conn.resume()

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if the body was read to
        its end and the worker keeps it alive, else it is closed. Idempotent."""
        self._conn.finish(self)

    # ---- called by the connection ------------------------------------------------------

    def _flush(self) -> None:
        """After each read from the socket: hand what arrived to the sink or the reader."""
        sink = self._sink
        if sink is None:
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)
            return
        pieces, self._pieces = self._pieces, []
        piece = b"" if not pieces else pieces[0] if len(pieces) == 1 else b"".join(pieces)
        if self._complete and self._error is None and not self._ended:
            self._ended = True
            sink.end(piece)  # with the last pieces: the client's end can go in one write
            return
        if piece:
            sink.data(piece)
        if self._error is not None and not self._ended and self._sink is not None:
            self._ended = True  # (the sink may have released the answer in ``data``)
            sink.failed(self._error)
