"""KV moved between simulated workers: a prefill worker's prompt pulled by its decode worker,
and a moved turn's conversation pulled from its session's home (peer KV fetch).

Like the real decode worker's, each engine call here (what the worker holds, a reservation,
a registration, a lease's end) waits for that engine's next step boundary. The real worker
runs them under the engine's lock while a model run is in progress (at most one step
sooner); here a decode run in progress has counted on its free blocks, so they wait.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from splitserve.common.kv_hash import BlockHash
from splitserve.engine.sequence import Sequence
from splitserve.router.policies import RoutingPolicy
from splitserve.sim.cost_model import CostModel
from splitserve.sim.deployment import SimConfig
from splitserve.sim.events import EventQueue
from splitserve.sim.state import SimRequest, SimStats, SimWorker

PREFILL_SUFFIX = "/prefill"


class Host(Protocol):
    """What the KV moves need of the simulated deployment (``cluster.Cluster``)."""

    config: SimConfig
    cost: CostModel
    events: EventQueue
    stats: SimStats
    prefill_policy: RoutingPolicy
    requests: dict[str, SimRequest]
    outputs: dict[str, tuple[int, ...]]

    @property
    def now(self) -> float: ...

    def sequence(
        self, rid: str, req: SimRequest, max_tokens: int, keep_blocks: bool = False
    ) -> Sequence: ...

    def admit(self, w: SimWorker, seq: Sequence, req: SimRequest) -> None: ...

    def on_engine(self, w: SimWorker, call: Callable[[], None]) -> None: ...

    def on_engine_now(self, w: SimWorker, call: Callable[[], None], blocks: int) -> None: ...


class KVMoves:
    def __init__(self, host: Host) -> None:
        self.c = host

    # ---- disaggregation: the decode worker pulls the prefilled prompt --------------------

    def prefilled(self, p: SimWorker, seq: Sequence) -> None:
        """``p`` finished a remote prefill; after the router's second leg, D pulls it."""
        c = self.c
        req = c.requests[seq.request_id.removesuffix(PREFILL_SUFFIX)]
        del c.outputs[seq.request_id]
        p.router.in_flight -= 1
        c.prefill_policy.on_request_complete(p.router, req.info)
        d = req.decode
        assert d is not None, "a prefilled request has its decode worker"
        d.router.in_flight += 1
        leg = c.config.hardware.remote_leg_s
        blocks = self.blocks_bound(d, req)
        c.events.at(
            c.now + leg, lambda _: c.on_engine_now(d, lambda: self._hits(req, p, d, seq), blocks)
        )

    def blocks_bound(self, d: SimWorker, req: SimRequest) -> int:
        """The most blocks of ``d``'s pool that taking ``req``'s prompt in can reserve."""
        return len(req.prompt) // d.engine.block_manager.block_size + 1

    def _hits(self, req: SimRequest, p: SimWorker, d: SimWorker, kept: Sequence) -> None:
        """D's engine: which of the prompt's blocks it holds already; then the reserve."""
        hits = self.local_blocks(d, kept, req.prompt)
        self._pull(req, p, d, kept, hits)

    def local_blocks(self, d: SimWorker, seq: Sequence, prompt: list[int]) -> int:
        """The leading reusable blocks of ``prompt`` that ``d`` holds; with lower tiers, those
        below its pool count too, and their loads start now (they are not pulled)."""
        bm, tiering = d.engine.block_manager, d.engine.tiering
        if tiering is not None:
            held, loading = tiering.prefetch(prompt, seq.root_hash)
            return held + loading
        usable = bm.reusable_blocks(len(prompt))
        return len(bm.cached_chain(bm.chain(seq, usable), usable))

    def _pull(self, req: SimRequest, p: SimWorker, d: SimWorker, kept: Sequence, hits: int) -> None:
        """D's engine: reserve blocks, start the transfer."""
        c, bm = self.c, d.engine.block_manager
        usable = bm.reusable_blocks(len(req.prompt))
        hashes = kept.block_hashes[:usable]
        n = usable - hits  # hits evicted since then are recomputed at admission, as for real
        dest = bm.reserve(n) if n > 0 else None
        if dest is None:
            c.stats.transfer_fallbacks += n > 0
            self.release(p, kept.block_table)
            self._decode_leg(req, d)
            return
        self._transfer(p, d, n)
        c.stats.kv_blocks_moved += n
        loaded = hashes[hits:usable]
        c.events.at(
            d.link_free,
            lambda _: c.on_engine_now(
                d, lambda: self._pulled(req, p, d, kept, dest, loaded, hits), 0
            ),
        )

    def _transfer(self, src: SimWorker, d: SimWorker, blocks: int) -> None:
        """``blocks`` blocks cross D's inbound link after what it carries already."""
        c = self.c
        start = max(c.now, d.link_free)
        tokens = blocks * d.engine.block_manager.block_size
        d.link_free = start + c.cost.transfer_time(tokens, src.node == d.node)

    def _pulled(
        self,
        req: SimRequest,
        p: SimWorker,
        d: SimWorker,
        kept: Sequence,
        dest: list[int],
        loaded: list[BlockHash],
        start: int,
    ) -> None:
        d.engine.register(dest, loaded, req.chain, start)
        self.release(p, kept.block_table)
        self._decode_leg(req, d)

    def release(self, w: SimWorker, block_ids: list[int]) -> None:
        """A lease on ``block_ids`` ends at ``w``'s next step boundary."""

        def release() -> None:
            w.engine.block_manager.release(block_ids)
            w.engine.blocks_released()

        self.c.on_engine(w, release)

    def _decode_leg(self, req: SimRequest, d: SimWorker) -> None:
        c = self.c
        c.admit(d, c.sequence(req.rid, req, len(c.outputs[req.rid])), req)

    # ---- peer KV fetch: a moved turn pulls its session's KV from the home ----------------

    def peer_fetch(self, req: SimRequest, home: SimWorker, d: SimWorker, seq: Sequence) -> None:
        """D's engine: what it holds of the prompt. With all it could reuse held here, the
        request runs at once; else D asks the home for a lease on what the home holds."""
        c = self.c
        usable = d.engine.block_manager.reusable_blocks(len(req.prompt))
        local = self.local_blocks(d, seq, req.prompt) if usable else 0
        if local >= usable:
            c.admit(d, seq, req)
            return
        half = c.config.hardware.peer_lease_s / 2  # the lease request, then its answer
        blocks = self.blocks_bound(home, req)
        c.events.at(
            c.now + half,
            lambda _: c.on_engine_now(
                home, lambda: self._peer_lease(req, home, d, seq, local), blocks
            ),
        )

    def _peer_lease(
        self, req: SimRequest, home: SimWorker, d: SimWorker, seq: Sequence, local: int
    ) -> None:
        """The home's engine: one reference on each block of the prompt's leading cached run
        in its pool (the real ``lease_prefix``); the answer travels back to D."""
        c, bm = self.c, home.engine.block_manager
        usable = bm.reusable_blocks(len(req.prompt))
        leased = bm.take_cached(bm.chain(seq, usable).hashes[:usable], req.prompt)
        half = c.config.hardware.peer_lease_s / 2
        c.events.at(
            c.now + half,
            lambda _: c.on_engine_now(
                d, lambda: self._peer_pull(req, home, d, seq, local, leased), len(leased)
            ),
        )

    def _peer_pull(
        self,
        req: SimRequest,
        home: SimWorker,
        d: SimWorker,
        seq: Sequence,
        local: int,
        leased: list[int],
    ) -> None:
        """D's engine: reserve blocks for what the home lent beyond what D holds, and pull
        them; with nothing new, or no free blocks, the request computes its prompt here."""
        c, n = self.c, len(leased) - local
        if n <= 0:
            c.stats.peer_nothing += 1
            self._peer_done(req, home, d, seq, leased)
            return
        bm = d.engine.block_manager
        dest = bm.reserve(n)
        if dest is None:
            c.stats.peer_fallbacks += 1
            self._peer_done(req, home, d, seq, leased)
            return
        self._transfer(home, d, n)
        c.stats.peer_fetches += 1
        c.stats.peer_blocks_moved += n
        chain = bm.chain(seq, len(leased))
        hashes = chain.hashes[local : len(leased)]

        def land() -> None:
            d.engine.register(dest, hashes, chain, local)
            self._peer_done(req, home, d, seq, leased)

        c.events.at(d.link_free, lambda _: c.on_engine_now(d, land, 0))

    def _peer_done(
        self, req: SimRequest, home: SimWorker, d: SimWorker, seq: Sequence, leased: list[int]
    ) -> None:
        """The lease ends (at the home's next step boundary) and the request runs on D."""
        if leased:
            self.release(home, leased)
        self.c.admit(d, seq, req)
