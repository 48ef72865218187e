"""What the simulated cluster's parts share: a worker, a request in flight, the run's counters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.common.kv_hash import BlockChain
from splitserve.router.policies import RequestInfo
from splitserve.router.worker import Worker
from splitserve.sim.engine import SimEngine
from splitserve.workload.metrics import RequestRecord
from splitserve.workload.sessions import SessionSpec


@dataclass(slots=True, eq=False)
class SimWorker:
    name: str
    engine: SimEngine
    router: Worker
    node: int
    busy: bool = False
    started: float = 0.0
    duration: float = 0.0
    version: int = 0
    busy_s: float = 0.0
    engine_s: float = 0.0  # busy_s less the waits for a shared core (host_cores)
    steps: int = 0
    link_free: float = 0.0  # inbound KV link busy until
    mover_free: float = 0.0  # lower-tier loads busy until (one at a time, as one mover)
    calls: list[Callable[[], None]] = field(default_factory=list)
    in_calls: bool = False
    # Sharing the host's cores (``host_cores``): the step or run in progress is ``work``
    # engine seconds, ``done`` of them by wall time ``mark``, at ``stretch`` wall seconds each.
    work: float = 0.0
    done: float = 0.0
    mark: float = 0.0
    stretch: float = 1.0


@dataclass(slots=True, eq=False)
class SimRequest:
    rid: str
    session: SessionSpec
    turn: int
    # The session's context list itself, not a copy: it grows only after this request ends
    # (``Cluster._finish``), and each of the request's sequences copies it.
    prompt: list[int]
    record: RequestRecord
    info: RequestInfo
    chain: BlockChain  # the session's, shared by all its sequences (one token stream)
    decode: SimWorker | None = None
    prefill: SimWorker | None = None
    first_step: int = 0  # the decode worker's step count when the first token came


@dataclass(slots=True)
class SimStats:
    remote_prefills: int = 0
    local_prefills: int = 0
    transfer_fallbacks: int = 0
    kv_blocks_moved: int = 0
    tier_loads: int = 0
    tier_blocks_host: int = 0  # blocks loaded into device pools from host RAM
    tier_blocks_disk: int = 0  # ... from disk
    peer_fetches: int = 0  # moved turns that pulled KV from their session's home
    peer_blocks_moved: int = 0
    peer_nothing: int = 0  # the home held nothing this worker lacked
    peer_fallbacks: int = 0  # no free blocks for the pull: computed here
