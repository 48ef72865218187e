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
from collections.abc import Iterator

from splitserve.common.kv_hash import BlockChain, BlockHash, block_hash, root_hash
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.scheduler import SchedulerConfig
from splitserve.engine.sequence import Sequence
from splitserve.router.placement import Decision, PlacementRules, Uncached, place
from splitserve.router.policies import RequestInfo
from splitserve.router.worker import Worker
from splitserve.sim.chat import append_message, append_prompt, append_reply, rendered
from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.engine import SimEngine, StepReport
from splitserve.sim.events import EventQueue
from splitserve.sim.feed import ChainPlan, FedSessions
from splitserve.sim.kv_moves import PREFILL_SUFFIX, KVMoves
from splitserve.sim.shared_cores import SharedCores
from splitserve.sim.state import SimRequest, SimStats, SimWorker
from splitserve.sim.stepping import Stepping
from splitserve.sim.tiers import SimLadder
from splitserve.workload.metrics import RequestRecord
from splitserve.workload.sessions import SessionSpec

# First messages whose block chains a run keeps for the sessions opening with them: a
# workload's shared system prompts number a few; unique openings stop counting here.
MAX_OPENINGS = 64


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """A run keeps millions of objects alive (token chains, cached blocks' tokens, records)
    and makes no reference cycles worth collecting before it ends, so the cyclic collector's
    passes over them would only cost time. Reference counting still frees all else at once.

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


def chain_plan(config: SimConfig) -> ChainPlan:
    """How a cluster of ``config`` hashes a session's blocks."""
    return ChainPlan(root_hash(config.model.name), config.block_size, config.chat_template)


class Cluster(Stepping):
    def __init__(self, config: SimConfig, deployment: Deployment) -> None:
        self.config = config
        self.deployment = deployment
        self.events = EventQueue()
        self.root = root_hash(config.model.name)  # the default tenant's
        self._roots: dict[str, BlockHash] = {"": self.root}
        self.stats = SimStats()
        self.cost = config.cost_model(deployment.tp)
        self.num_blocks = config.kv_blocks(self.cost)
        self.max_model_len = self.config.model_len(self.num_blocks)
        self.tier_blocks = config.tier_blocks(self.cost)  # [(tier, capacity in blocks)]
        self.outputs: dict[str, tuple[int, ...]] = {}
        self.requests: dict[str, SimRequest] = {}
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
        self.decode_candidates = tuple(w.router for w in self.decode_pool)
        self._prefill_candidates = tuple(w.router for w in self.prefill_pool)
        self.by_router = {id(w.router): w for w in self.workers}
        self.decode_policy = config.routing_policy(config.policy)
        self.prefill_policy = config.routing_policy(config.prefill_policy)
        self.rules = PlacementRules(
            bool(self.prefill_pool), config.remote_prefill_threshold, config.kv_peer_fetch
        )
        self._sessions: Iterator[SessionSpec] = iter(())
        self._fed: FedSessions | None = None
        self._contexts: dict[str, list[int]] = {}
        self._chains: dict[str, BlockChain] = {}
        self._prefix_keys: dict[str, str] = {}  # a session's prefill placement key
        self._openings: dict[tuple[str, str, bool, tuple[int, ...]], BlockChain] = {}
        self.moves = KVMoves(self)
        self.cores: SharedCores | None = None
        if config.host_cores:
            slowdown = config.hardware.co_run_slowdown
            copies = config.hardware.kv_copy_cpu_per_block_s
            self.cores = SharedCores(
                config.host_cores, slowdown, copies, self.workers, self._schedule_end, self.events
            )

    def _pool(self, role: str, count: int, first: int) -> list[SimWorker]:
        per_node = max(1, self.config.hardware.gpus_per_node // self.deployment.tp)
        sched = SchedulerConfig(
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            self.max_model_len,
            policy=self.config.scheduling_policy,
        )
        urls = [url for url, r in self.config.worker_urls if r == role]
        if self.config.worker_urls and len(urls) != count:
            raise ValueError(
                f"worker_urls name {len(urls)} {role} workers; the deployment has {count}"
            )
        out = []
        for i in range(count):
            engine = SimEngine(
                self.cost,
                sched,
                self.num_blocks,
                self.config.block_size,
                self.outputs.__getitem__,
                exact=self.config.exact,
                log_steps=self.config.record_itl,
                tiers=SimLadder(self.tier_blocks) if self.tier_blocks else None,
            )
            name = f"{role}{i}"
            out.append(
                SimWorker(
                    name,
                    engine,
                    Worker(urls[i] if urls else f"sim://{name}", role),
                    (first + i) // per_node,
                )
            )
        return out

    # ---- the run -------------------------------------------------------------------------

    @property
    def chain_plan(self) -> ChainPlan:
        """How this cluster hashes a session's blocks (for ``fed_sessions``)."""
        return chain_plan(self.config)

    def run(
        self,
        sessions: Iterator[SessionSpec],
        limit: int | None = None,
        fed: FedSessions | None = None,
    ) -> list[RequestRecord]:
        """Play ``sessions`` (at most ``limit`` of them) to the end; one record per request
        sent, in completion order. ``fed``: where ``sessions`` come from (or draw on), if
        ``fed_sessions``; its block hashes are used when its plan is this cluster's."""
        self._sessions = iter(sessions)
        self._fed = fed if fed is not None and fed.plan == self.chain_plan else None
        self._remaining = limit
        self._next_session()
        with _collector_paused():
            self.events.run()
        return self.records

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
        chain = BlockChain(self._root(spec.tenant), self.config.block_size)
        opening = self._opening(spec)
        if opening is not None:
            chain.hashes.extend(opening.hashes)
            chain.tokens.extend(opening.tokens)
        if self._fed is not None:
            ahead = self._fed.take(spec.session_id)
            if not spec.tenant:  # hashed ahead from the default tenant's root
                chain.ahead = ahead
        self._chains[spec.session_id] = chain
        # The first message's first 128 tokens, hashed once per session (not per turn). The
        # router digests the text (``router.session``); the simulator has only token ids.
        shared = spec.turns[0].segments[0].token_ids[:128]
        self._prefix_keys[spec.session_id] = f"shared:{block_hash(b'', shared).hex()}"
        self._send(spec, 0)

    def _opening(self, spec: SessionSpec) -> BlockChain | None:
        """The chain of the full blocks of ``spec``'s first message, shared by the sessions
        that open with the same message (an agent type's system prompt). A session's chain
        starts as a copy of it: the same hashes, and the same token tuples, so that a block
        cached from another session is recognised by identity rather than compared item by
        item, and is hashed once per run rather than once per session. The first
        ``MAX_OPENINGS`` distinct first messages are kept; a session opening with another
        one hashes its own."""
        if not spec.turns or not spec.turns[0].segments:
            return None
        seg, chat = spec.turns[0].segments[0], self._chat(spec)
        key = (spec.tenant, seg.role, chat, seg.token_ids)
        chain = self._openings.get(key)
        if chain is None and len(self._openings) < MAX_OPENINGS:
            tokens: list[int] = []
            append_message(tokens, seg, chat)
            chain = BlockChain(self._root(spec.tenant), self.config.block_size)
            chain.extend(tokens, len(tokens) // self.config.block_size)
            self._openings[key] = chain
        return chain

    def _root(self, tenant: str) -> BlockHash:
        """The root of ``tenant``'s block chains."""
        root = self._roots.get(tenant)
        if root is None:
            root = self._roots[tenant] = root_hash(self.config.model.name, tenant)
        return root

    def _send(self, spec: SessionSpec, k: int) -> None:
        turn = spec.turns[k]
        context = self._contexts[spec.session_id]
        cached_before = len(context)
        append_prompt(context, turn.segments, self._chat(spec))
        rid = f"{spec.session_id}#{k}"
        self.outputs[rid] = turn.output_ids
        key = spec.session_id if spec.sticky else f"prefix:{block_hash(b'', context[:128]).hex()}"
        info = RequestInfo(key, self._prefix_keys[spec.session_id], len(context))
        record = RequestRecord(spec.session_id, k, self.now, prompt_tokens=len(context))
        chain = self._chains[spec.session_id]
        req = SimRequest(rid, spec, k, context, record, info, chain)
        self.requests[rid] = req
        new_tokens = len(context) - cached_before
        if self.cores is not None:
            self.cores.serve(self.config.hardware.serving_cpu_per_request_s, self.now)
        delay = self.config.hardware.request_overhead_s
        if delay > 0:  # the request's way in: HTTP, tokenizing, the engine loop's hand-off
            self.events.at(self.now + delay, lambda _: self._place(req, new_tokens))
        else:
            self._place(req, new_tokens)

    def _place(self, req: SimRequest, new_tokens: int) -> None:
        decision = self.decide(req, new_tokens)
        req.decode = d = self.by_router[id(decision.decode)]
        if decision.prefill is not None:
            req.prefill = p = self.by_router[id(decision.prefill)]
            p.router.in_flight += 1
            seq = self.sequence(req.rid + PREFILL_SUFFIX, req, 1, keep_blocks=True)
            self.outputs[seq.request_id] = self.outputs[req.rid]
            self.admit(p, seq, req)
            self.stats.remote_prefills += 1
        else:
            d.router.in_flight += 1
            seq = self.sequence(req.rid, req, len(self.outputs[req.rid]))
            home = None if decision.peer is None else self.by_router[id(decision.peer)]
            if home is None or len(req.prompt) >= self.max_model_len:
                self.admit(d, seq, req)
            else:
                blocks = self.moves.blocks_bound(d, req)
                self.on_engine_now(d, lambda: self.moves.peer_fetch(req, home, d, seq), blocks)
            self.stats.local_prefills += 1

    def decide(self, req: SimRequest, new_tokens: int) -> Decision:
        """The router's placement of ``req`` (``router.placement``). The uncached estimate
        is the router's: on its home a session has everything up to its last reply cached
        (what the previous turn left), elsewhere nothing; ``new_tokens`` is what followed."""
        prompt = len(req.prompt)
        home = self.decode_policy.home_worker(self.decode_candidates, req.info)
        uncached = Uncached(prompt if req.turn == 0 else new_tokens, prompt)
        decision = place(
            req.info,
            self.decode_candidates,
            self._prefill_for,
            self.decode_policy,
            self.prefill_policy,
            home,
            uncached,
            self.rules,
        )
        assert decision is not None, "a simulated deployment has decode workers"
        return decision

    def _prefill_for(self, decode: Worker) -> tuple[Worker, ...]:
        return self._prefill_candidates  # the prefill pool never decodes

    def sequence(
        self, rid: str, req: SimRequest, max_tokens: int, keep_blocks: bool = False
    ) -> Sequence:
        params = self._params.get(max_tokens)
        if params is None:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            self._params[max_tokens] = params
        return Sequence(
            rid,
            list(req.prompt),
            params,
            req.chain.root,
            arrival_time=self.now,
            keep_blocks=keep_blocks,
            chain=req.chain,
        )

    def admit(self, w: SimWorker, seq: Sequence, req: SimRequest) -> None:
        try:
            w.engine.add(seq)
        except ValueError as e:  # prompt over the context limit: the worker answers 400
            w.router.in_flight -= 1
            self.outputs.pop(seq.request_id, None)
            self.fail(req, str(e))
            return
        self._kick(w)

    def _handle(self, w: SimWorker, report: StepReport) -> None:
        for seq in report.first_tokens:
            req = self.requests.get(seq.request_id)
            if req is not None:
                req.record.ttft_s = self.now - req.record.start_s
                req.first_step = w.engine.steps
        for seq in report.finished:
            if seq.keep_blocks:
                self.moves.prefilled(w, seq)
            else:
                self._complete(w, seq)

    # ---- endings -------------------------------------------------------------------------

    def _complete(self, d: SimWorker, seq: Sequence) -> None:
        req = self.requests.pop(seq.request_id)
        del self.outputs[seq.request_id]
        d.router.in_flight -= 1
        self.decode_policy.on_request_complete(d.router, req.info)
        r = req.record
        r.ok = True
        r.output_tokens = seq.num_output_tokens
        r.cached_tokens = seq.num_cached_tokens
        r.e2e_s = self.now - r.start_s
        if self.cores is not None:
            tokens = r.output_tokens * self.config.hardware.serving_cpu_per_token_s
            self.cores.serve(tokens, self.now)
        log = d.engine.step_log
        if log is not None and seq.num_preemptions == 0:
            r.itl_s = log.durations(req.first_step, d.engine.steps)
        self._finish(req, seq.output_token_ids)

    def fail(self, req: SimRequest, error: str) -> None:
        self.requests.pop(req.rid, None)
        self.outputs.pop(req.rid, None)
        req.record.error = error
        req.record.e2e_s = self.now - req.record.start_s
        self._finish(req, None)

    def _finish(self, req: SimRequest, output: list[int] | None) -> None:
        """Record the request; release the session's next turn after its pause."""
        self.records.append(req.record)
        spec, k = req.session, req.turn
        if output is None or k + 1 >= len(spec.turns):
            del self._contexts[spec.session_id]
            del self._chains[spec.session_id]
            del self._prefix_keys[spec.session_id]
            return
        if len(output) != len(spec.turns[k].output_ids):  # cut short: the stream leaves the
            self._chains[spec.session_id].ahead = []  # synthetic one hashed ahead
        append_reply(self._contexts[spec.session_id], output, self._chat(spec))
        self.events.at(self.now + spec.turns[k + 1].pause_s, self._next_turn, (spec, k + 1))

    def _chat(self, spec: SessionSpec) -> bool:
        """Whether ``spec``'s prompts carry the chat template's tokens."""
        return rendered(self.config.chat_template, spec.api)

    def _next_turn(self, arg: tuple[SessionSpec, int]) -> None:
        self._send(*arg)
