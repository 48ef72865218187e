"""Keeping the garbage collector's pauses out of a server's latency tail.

A full collection walks every object in the process. After importing FastAPI, pydantic,
aiohttp, httpx (and torch, in a worker) that took 15-50 ms here, and every stream the
process serves stalls meanwhile: it was the router's p99 added latency in
``benchmarks/router_overhead.py``. Objects that exist once a server has started live as long
as the process, so ``quiet_gc`` freezes them out of the collector's sight and makes
collections rarer; a server's per-request garbage is almost all freed by reference counting.
"""

from __future__ import annotations

import gc

# Young-generation size before the collector runs (CPython's default is 700 objects).
GC_GEN0_THRESHOLD = 50_000


def quiet_gc() -> None:
    """Collect once, freeze what survives, and raise the young-generation threshold. Call it
    in a server process right before it starts serving."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)
