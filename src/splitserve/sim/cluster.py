"""A simulated deployment: workers on the real scheduler, placed by the real routing policies.

A request flows as it does through ``splitserve.router``::

    arrival ─▶ decode policy picks D ─▶ uncached prompt >= threshold and P workers exist?
                 │ no                        │ yes: prefill policy picks P
                 ▼                           ▼
         D prefills and decodes      P prefills (max_tokens=1, blocks kept under a lease)
                                             │ the router's second leg (remote_leg_s), then
                                             │ D pulls the blocks it lacks over its link
                                             ▼ (bytes / bandwidth + latency, FIFO per D)
                                     D registers them, admits the request (its prefix cache
                                     hits them), computes the tail and decodes

A worker's engine is touched from outside (KV reserved, registered, a lease released) only
between steps, as the real worker's engine thread does: such calls queue until the step in
progress ends. Sessions release their next turn ``pause_s`` after a turn finishes.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from splitserve.bench.metrics import RequestRecord
from splitserve.bench.workloads import API_CHAT, SessionSpec
from splitserve.common.kv_hash import BlockChain, BlockHash, root_hash
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.scheduler import SchedulerConfig
from splitserve.engine.sequence import Sequence
from splitserve.router.policies import RequestInfo
from splitserve.router.worker import Worker
from splitserve.sim.chat import append_prompt, append_reply
from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.engine import SimEngine, StepReport
from splitserve.sim.events import EventQueue
from splitserve.sim.tiers import SimLadder, TierLoad

PREFILL_SUFFIX = "/prefill"


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """A run keeps millions of objects alive (token chains, cached blocks' tokens, records)
    and makes no reference cycles worth collecting before it ends; the cyclic collector's
    passes over them were a quarter of a large run. Reference counting still frees all
    else at once.

    Every object made while paused is counted in the youngest generation, so the first
    collection after it would scan them all (seconds at a million requests). Freezing and
    unfreezing moves them to the oldest generation first, unscanned, as if they had survived
    earlier collections; they are scanned with it, when it is next due."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if enabled:
            gc.enable()


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
    steps: int = 0
    link_free: float = 0.0  # inbound KV link busy until
    mover_free: float = 0.0  # lower-tier loads busy until (one at a time, as one mover)
    calls: list[Callable[[], None]] = field(default_factory=list)
    in_calls: bool = False


@dataclass(slots=True, eq=False)
class _Request:
    rid: str
    session: SessionSpec
    turn: int
    # The session's context list itself, not a copy: it grows only after this request ends
    # (``_finish``), and each of the request's sequences copies it.
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


class Cluster:
    def __init__(self, config: SimConfig, deployment: Deployment) -> None:
        self.config = config
        self.deployment = deployment
        self.events = EventQueue()
        self.root = root_hash(config.model.name)
        self.stats = SimStats()
        self.cost = config.cost_model(deployment.tp)
        self.num_blocks = config.kv_blocks(self.cost)
        self.max_model_len = self.config.model_len(self.num_blocks)
        self.tier_blocks = config.tier_blocks(self.cost)  # [(tier, capacity in blocks)]
        self._outputs: dict[str, tuple[int, ...]] = {}
        self._requests: dict[str, _Request] = {}
        self._params: dict[int, SamplingParams] = {}
        self.records: list[RequestRecord] = []
        self.prefill_pool = self._pool("prefill", deployment.prefill, 0)
        first = deployment.prefill
        self.decode_pool = self._pool("decode", deployment.decode, first)
        first += deployment.decode
        self.decode_pool += self._pool("both", deployment.collocated, first)
        self.workers = self.prefill_pool + self.decode_pool
        # Tuples: a policy's ring syncs on ``tuple(candidates)``, which copies a list at
        # every placement and gives a tuple back as it is.
        self._decode_candidates = tuple(w.router for w in self.decode_pool)
        self._prefill_candidates = tuple(w.router for w in self.prefill_pool)
        self._by_router = {id(w.router): w for w in self.workers}
        self.decode_policy = config.routing_policy(config.policy)
        self.prefill_policy = config.routing_policy(config.prefill_policy)
        self._sessions: Iterator[SessionSpec] = iter(())
        self._contexts: dict[str, list[int]] = {}
        self._chains: dict[str, BlockChain] = {}

    def _pool(self, role: str, count: int, first: int) -> list[SimWorker]:
        per_node = max(1, self.config.hardware.gpus_per_node // self.deployment.tp)
        sched = SchedulerConfig(
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            self.max_model_len,
            policy=self.config.scheduling_policy,
        )
        out = []
        for i in range(count):
            engine = SimEngine(
                self.cost,
                sched,
                self.num_blocks,
                self.config.block_size,
                self._outputs.__getitem__,
                exact=self.config.exact,
                log_steps=self.config.record_itl,
                tiers=SimLadder(self.tier_blocks) if self.tier_blocks else None,
            )
            name = f"{role}{i}"
            out.append(
                SimWorker(name, engine, Worker(f"sim://{name}", role), (first + i) // per_node)
            )
        return out

    # ---- the run -------------------------------------------------------------------------

    def run(self, sessions: Iterator[SessionSpec], limit: int | None = None) -> list[RequestRecord]:
        """Play ``sessions`` (at most ``limit`` of them) to the end; one record per request
        sent, in completion order."""
        self._sessions = iter(sessions)
        self._remaining = limit
        self._next_session()
        with _collector_paused():
            self.events.run()
        return self.records

    @property
    def now(self) -> float:
        return self.events.now

    def _next_session(self) -> None:
        if self._remaining is not None:
            if self._remaining <= 0:
                return
            self._remaining -= 1
        spec = next(self._sessions, None)
        if spec is not None:
            self.events.at(spec.arrival_s, self._session_arrives, spec)

    def _session_arrives(self, spec: SessionSpec) -> None:
        self._next_session()
        self._contexts[spec.session_id] = []
        self._chains[spec.session_id] = BlockChain(self.root, self.config.block_size)
        self._send(spec, 0)

    def _send(self, spec: SessionSpec, k: int) -> None:
        turn = spec.turns[k]
        context = self._contexts[spec.session_id]
        cached_before = len(context)
        append_prompt(context, turn.segments, self._chat(spec))
        rid = f"{spec.session_id}#{k}"
        self._outputs[rid] = turn.output_ids
        key = spec.session_id if spec.sticky else f"prefix:{hash(tuple(context[:128]))}"
        shared = spec.turns[0].segments[0].token_ids[:128]
        info = RequestInfo(key, f"shared:{hash(shared)}", len(context))
        record = RequestRecord(spec.session_id, k, self.now, prompt_tokens=len(context))
        chain = self._chains[spec.session_id]
        req = _Request(rid, spec, k, context, record, info, chain)
        self._requests[rid] = req
        self._place(req, len(context) - cached_before)

    def _place(self, req: _Request, new_tokens: int) -> None:
        d = self._by_router[id(self.decode_policy.select_worker(self._decode_candidates, req.info))]
        req.decode = d
        if self.prefill_pool and self._uncached(req, d, new_tokens) >= (
            self.config.remote_prefill_threshold
        ):
            p_router = self.prefill_policy.select_worker(self._prefill_candidates, req.info)
            req.prefill = p = self._by_router[id(p_router)]
            p.router.in_flight += 1
            seq = self._sequence(req.rid + PREFILL_SUFFIX, req, 1, keep_blocks=True)
            self._outputs[seq.request_id] = self._outputs[req.rid]
            self._admit(p, seq, req)
            self.stats.remote_prefills += 1
        else:
            d.router.in_flight += 1
            self._admit(d, self._sequence(req.rid, req, len(self._outputs[req.rid])), req)
            self.stats.local_prefills += 1

    def _uncached(self, req: _Request, d: SimWorker, new_tokens: int) -> int:
        """The router's estimate: on its home worker a session has everything up to its
        last reply cached (what the previous turn left); elsewhere nothing."""
        if req.turn == 0:
            return len(req.prompt)
        home = self.decode_policy.home_worker(self._decode_candidates, req.info)
        return new_tokens if home is d.router else len(req.prompt)

    def _sequence(
        self, rid: str, req: _Request, max_tokens: int, keep_blocks: bool = False
    ) -> Sequence:
        params = self._params.get(max_tokens)
        if params is None:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            self._params[max_tokens] = params
        return Sequence(
            rid,
            list(req.prompt),
            params,
            self.root,
            arrival_time=self.now,
            keep_blocks=keep_blocks,
            chain=req.chain,
        )

    def _admit(self, w: SimWorker, seq: Sequence, req: _Request) -> None:
        try:
            w.engine.add(seq)
        except ValueError as e:  # prompt over the context limit: the worker answers 400
            w.router.in_flight -= 1
            self._outputs.pop(seq.request_id, None)
            self._fail(req, str(e))
            return
        self._kick(w)

    # ---- workers -------------------------------------------------------------------------

    def _kick(self, w: SimWorker) -> None:
        """Something changed for ``w``: start a step if idle, or end a decode run early."""
        if w.in_calls:
            return  # between steps already: _begin picks it up
        if not w.busy:
            self._begin(w)
        elif w.engine.in_run and (w.calls or w.engine.admission_possible()):
            total = w.engine.interrupt(self.now - w.started)
            if total is not None and total < w.duration:
                self._schedule_end(w, total)

    def _begin(self, w: SimWorker) -> None:
        """Between steps: run the queued engine calls, then start the next step. A call
        queued by a call waits for the next step boundary, unless the engine is idle."""
        while True:
            calls, w.calls = w.calls, []
            w.in_calls = True
            for call in calls:
                call()
            w.in_calls = False
            duration = w.engine.begin()
            if w.engine.tiering is not None:
                self._start_loads(w)
            if duration is not None and w.calls and w.engine.in_run:
                duration = w.engine.interrupt(0.0)  # the queued calls wait one step only
            if duration is not None:
                w.busy = True
                w.started = self.now
                self._schedule_end(w, duration)
                return
            if not w.calls:
                w.busy = False
                return

    def _schedule_end(self, w: SimWorker, duration: float) -> None:
        w.duration = duration
        w.version += 1
        self.events.at(w.started + duration, self._step_ends, (w, w.version))

    def _step_ends(self, arg: tuple[SimWorker, int]) -> None:
        w, version = arg
        if version != w.version:
            return  # superseded: the run was cut short
        w.busy_s += w.duration
        w.steps += 1
        report = w.engine.end()
        self._handle(w, report)
        self._begin(w)

    def _start_loads(self, w: SimWorker) -> None:
        """Queue the tier loads ``w``'s engine just decided on its mover, one after another;
        each lands at the step boundary after it ends."""
        bs = self.config.block_size
        for load in w.engine.take_loads():
            start = max(self.now, w.mover_free)
            w.mover_free = start + self.cost.tier_load_time(
                load.host_blocks * bs, load.disk_blocks * bs
            )
            s = self.stats
            s.tier_loads += 1
            s.tier_blocks_host += load.host_blocks
            s.tier_blocks_disk += load.disk_blocks
            self.events.at(w.mover_free, self._loaded, (w, load))

    def _loaded(self, arg: tuple[SimWorker, TierLoad]) -> None:
        w, load = arg
        self._on_engine(w, lambda: w.engine.land(load))

    def _on_engine(self, w: SimWorker, call: Callable[[], None]) -> None:
        """Run ``call`` on ``w``'s engine between steps."""
        w.calls.append(call)
        self._kick(w)

    def _handle(self, w: SimWorker, report: StepReport) -> None:
        for seq in report.first_tokens:
            req = self._requests.get(seq.request_id)
            if req is not None:
                req.record.ttft_s = self.now - req.record.start_s
                req.first_step = w.engine.steps
        for seq in report.finished:
            if seq.keep_blocks:
                self._prefilled(w, seq)
            else:
                self._complete(w, seq)

    # ---- disaggregation: the KV pull -----------------------------------------------------

    def _prefilled(self, p: SimWorker, seq: Sequence) -> None:
        req = self._requests[seq.request_id.removesuffix(PREFILL_SUFFIX)]
        del self._outputs[seq.request_id]
        p.router.in_flight -= 1
        self.prefill_policy.on_request_complete(p.router, req.info)
        d = req.decode
        assert d is not None, "a prefilled request has its decode worker"
        d.router.in_flight += 1
        leg = self.config.hardware.remote_leg_s
        self.events.at(
            self.now + leg, lambda _: self._on_engine(d, lambda: self._hits(req, p, d, seq))
        )

    def _hits(self, req: _Request, p: SimWorker, d: SimWorker, kept: Sequence) -> None:
        """D's engine, between steps: which of the prompt's blocks it holds already. Like the
        real decode worker's, each of its engine calls waits for its own step boundary."""
        bm, tiering = d.engine.block_manager, d.engine.tiering
        if tiering is not None:  # what lower tiers hold starts up now and is not pulled
            held, loading = tiering.prefetch(req.prompt, self.root)
            hits = held + loading
        else:
            usable = bm.reusable_blocks(len(req.prompt))
            hits = len(bm.cached_chain(bm.chain(kept, usable), usable))
        self._on_engine(d, lambda: self._pull(req, p, d, kept, hits))

    def _pull(self, req: _Request, p: SimWorker, d: SimWorker, kept: Sequence, hits: int) -> None:
        """D's engine, the next boundary: reserve blocks, start the transfer."""
        bm = d.engine.block_manager
        usable = bm.reusable_blocks(len(req.prompt))
        hashes = kept.block_hashes[:usable]
        n = usable - hits  # hits evicted since then are recomputed at admission, as for real
        dest = bm.reserve(n) if n > 0 else None
        if dest is None:
            self.stats.transfer_fallbacks += n > 0
            self._release_lease(p, kept)
            self._decode_leg(req, d)
            return
        start = max(self.now, d.link_free)
        same_node = p.node == d.node
        d.link_free = start + self.cost.transfer_time(n * bm.block_size, same_node)
        self.stats.kv_blocks_moved += n
        loaded = hashes[hits:usable]
        self.events.at(
            d.link_free,
            lambda _: self._on_engine(d, lambda: self._pulled(req, p, d, kept, dest, loaded, hits)),
        )

    def _pulled(
        self,
        req: _Request,
        p: SimWorker,
        d: SimWorker,
        kept: Sequence,
        dest: list[int],
        loaded: list[BlockHash],
        start: int,
    ) -> None:
        d.engine.register(dest, loaded, req.prompt, start)
        self._release_lease(p, kept)
        self._decode_leg(req, d)

    def _release_lease(self, p: SimWorker, kept: Sequence) -> None:
        def release() -> None:
            p.engine.block_manager.release(kept.block_table)
            p.engine.blocks_released()

        self._on_engine(p, release)

    def _decode_leg(self, req: _Request, d: SimWorker) -> None:
        seq = self._sequence(req.rid, req, len(self._outputs[req.rid]))
        try:
            d.engine.add(seq)
        except ValueError as e:
            d.router.in_flight -= 1
            self._fail(req, str(e))

    # ---- endings -------------------------------------------------------------------------

    def _complete(self, d: SimWorker, seq: Sequence) -> None:
        req = self._requests.pop(seq.request_id)
        del self._outputs[seq.request_id]
        d.router.in_flight -= 1
        self.decode_policy.on_request_complete(d.router, req.info)
        r = req.record
        r.ok = True
        r.output_tokens = seq.num_output_tokens
        r.cached_tokens = seq.num_cached_tokens
        r.e2e_s = self.now - r.start_s
        log = d.engine.step_log
        if log is not None and seq.num_preemptions == 0:
            r.itl_s = log.durations(req.first_step, d.engine.steps)
        self._finish(req, seq.output_token_ids)

    def _fail(self, req: _Request, error: str) -> None:
        self._requests.pop(req.rid, None)
        self._outputs.pop(req.rid, None)
        req.record.error = error
        req.record.e2e_s = self.now - req.record.start_s
        self._finish(req, None)

    def _finish(self, req: _Request, output: list[int] | None) -> None:
        """Record the request; release the session's next turn after its pause."""
        self.records.append(req.record)
        spec, k = req.session, req.turn
        if output is None or k + 1 >= len(spec.turns):
            del self._contexts[spec.session_id]
            del self._chains[spec.session_id]
            return
        append_reply(self._contexts[spec.session_id], output, self._chat(spec))
        self.events.at(self.now + spec.turns[k + 1].pause_s, self._next_turn, (spec, k + 1))

    def _chat(self, spec: SessionSpec) -> bool:
        """Whether ``spec``'s prompts carry the chat template's tokens."""
        return self.config.chat_template and spec.api == API_CHAT

    def _next_turn(self, arg: tuple[SessionSpec, int]) -> None:
        self._send(*arg)
