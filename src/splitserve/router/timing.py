"""Where a request's time goes inside the router: a timestamp at each step, and the phases
between them observed in ``splitserve:router_request_phase_seconds{phase}``.

::

    received --queued--> handler --parse--> parsed --route--> routed
    routed --upstream_headers--> headers --upstream_first_chunk--> upstream_first
    upstream_first --first_write--> first_written --stream--> last_written
    received --total--> last_written (a buffered answer: first_written)

``received`` is when uvicorn began parsing the request (``server.RouterProtocol``), so
``queued`` is the time a request waited for the event loop before its handler ran; without
the stamped protocol it is the handler's start and ``queued`` is not observed.
``upstream_headers`` runs from the worker chosen to the decode worker's response headers: it
includes a remote prefill leg and retries. For a buffered (non-streamed) answer
``upstream_first`` is when its whole body was read and ``first_written`` when it was
written, which ends it; ``stream`` is not observed. The clock is ``time.monotonic`` (a vDSO
call, ~50 ns).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

RECEIVED_KEY = "splitserve.received"  # in the ASGI scope's ``extensions``

# (phase, the stamp it starts at, the stamp it ends at)
PHASES = (
    ("queued", "received", "handler"),
    ("parse", "handler", "parsed"),
    ("route", "parsed", "routed"),
    ("upstream_headers", "routed", "headers"),
    ("upstream_first_chunk", "headers", "upstream_first"),
    ("first_write", "upstream_first", "first_written"),
    ("stream", "first_written", "last_written"),
    ("total", "received", "finished"),
)
PHASE_NAMES = tuple(name for name, _, _ in PHASES)
# From 100 us (the router's own steps) to minutes (a long generation's stream).
PHASE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)

now = time.monotonic


@dataclass(slots=True)
class Timeline:
    """One request's timestamps; 0.0 is "not reached"."""

    received: float  # the handler's start when uvicorn did not stamp the request
    handler: float
    parsed: float = 0.0
    routed: float = 0.0
    headers: float = 0.0
    upstream_first: float = 0.0
    first_written: float = 0.0
    last_written: float = 0.0

    @classmethod
    def of(cls, scope: dict) -> Timeline:
        """A timeline starting now, or when uvicorn stamped the scope's arrival."""
        handler = now()
        extensions = scope.get("extensions") or {}
        return cls(extensions.get(RECEIVED_KEY, handler), handler)

    @property
    def finished(self) -> float:
        return self.last_written or self.first_written

    def phases(self) -> list[tuple[str, float]]:
        """The phases whose both ends were reached, with their durations in seconds."""
        out = []
        for name, start, end in PHASES:
            t0, t1 = getattr(self, start), getattr(self, end)
            if t0 and t1 and not (name == "queued" and t0 == t1):  # not stamped by uvicorn
                out.append((name, t1 - t0))
        return out
