"""What the proxy answers, and how an answer is written to the client as plain ASGI.

A streamed answer is written chunk by chunk as the worker's chunks arrive: its first leg
straight from the upstream connection's callbacks through the server's ``BodyWriter``
(``leg``), or through ASGI ``send`` where the server offers no writer; what follows a broken
first leg (a migrated stream, an error event) goes through ``send``. One plain task watches
for the client's disconnect.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from splitserve.router.leg import CLIENT_GONE, Leg
from splitserve.router.server import body_writer
from splitserve.router.timing import Timeline, now


@dataclass(slots=True)
class Buffered:
    """A whole answer (non-streamed, or an error the worker sent)."""

    status: int
    headers: dict[str, str]
    content: bytes
    session: str | None = None  # the session key it was placed by (the access log)


@dataclass(slots=True)
class Streamed:
    """An answer relayed as it arrives: ``leg``, then, if it breaks, what ``after`` yields
    for its failure; ``on_close`` runs once, however the stream ends."""

    status: int
    headers: dict[str, str]
    leg: Leg
    after: Callable[[Exception], AsyncIterator[bytes]]
    on_close: Callable[[], Awaitable[None]]
    session: str | None = None


Reply = Buffered | Streamed


def as_response(reply: Buffered) -> Response:
    """The Starlette response for a buffered reply (``content-length`` added)."""
    return Response(reply.content, reply.status, reply.headers)


async def write(reply: Reply, scope: dict, receive: Any, send: Any, timeline: Timeline) -> None:
    """Write ``reply`` to the client; the timeline gets its first and last write."""
    if isinstance(reply, Buffered):
        await as_response(reply)(scope, receive, send)
        timeline.first_written = now()
        return
    try:
        await _stream(reply, scope, receive, send, timeline)
    finally:
        await reply.on_close()


async def _stream(
    reply: Streamed, scope: dict, receive: Any, send: Any, timeline: Timeline
) -> None:
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    timeline.first_written = now()  # the first piece goes out as the leg starts
    writer = body_writer(scope)
    if writer is not None and writer.usable:  # the usual case: no task but this one
        failure = await reply.leg.push(writer)
        if failure is CLIENT_GONE:
            return
        if failure is None:
            if writer.finished:  # ended with the worker's last chunk, in its callback
                timeline.last_written = now()
            else:
                await _end(send, timeline)
            return
    else:
        failure = None
    await _watched(reply, receive, send, timeline, failure)


async def _watched(
    reply: Streamed, receive: Any, send: Any, timeline: Timeline, failure: Exception | None
) -> None:
    """The rest of the answer through ``send``, a task watching for the client's disconnect:
    the first leg without a ``BodyWriter``, and whatever follows a broken first leg."""
    task = asyncio.current_task()
    assert task is not None
    streaming = True

    def on_gone(g: asyncio.Future) -> None:
        if streaming and not g.cancelled():
            task.cancel()

    gone = asyncio.ensure_future(_disconnect(receive))
    gone.add_done_callback(on_gone)
    after: AsyncIterator[bytes] | None = None
    try:
        if failure is None:
            failure = await reply.leg.pull(send)
        if failure is not None:
            after = reply.after(failure)
            async for chunk in after:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await _end(send, timeline)
    except asyncio.CancelledError:
        if not (gone.done() and not gone.cancelled()):
            raise
        task.uncancel()  # the client left: stop relaying, as Starlette did
    finally:
        streaming = False
        gone.cancel()
        # What followed a broken first leg, left mid-way (the client went), ends now, not
        # when the collector finds it: a resumed leg releases its worker in its ``finally``.
        if after is not None:
            await after.aclose()


async def _end(send: Any, timeline: Timeline) -> None:
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    timeline.last_written = now()


async def _disconnect(receive: Any) -> None:
    """Returns when the client disconnects (the request body was already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
