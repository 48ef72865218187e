"""One engine: model runner + scheduler + block manager, driven one step at a time."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.common.kv_hash import hash_blocks, root_hash
from splitserve.common.sampling_params import InvalidParameter, SamplingParams
from splitserve.config import EngineConfig
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.erasure import ErasedBlocks, erase_blocks
from splitserve.engine.outputs import CompletionOutput, KeptBlocks, RequestOutput
from splitserve.engine.plan import StepResult, TokenLogprobs
from splitserve.engine.scheduler import Scheduler, SchedulerConfig, SequenceUpdate
from splitserve.engine.sequence import Sequence
from splitserve.engine.tiering import RetentionConfig, Tiering
from splitserve.kvstore.ladder import Ladder, build_ladder

if TYPE_CHECKING:
    from collections.abc import Callable, Collection

    from splitserve.engine.kv_mover import KVMover
    from splitserve.engine.plan import StepPlan

# With nothing to run but a load in flight, the engine sleeps at most this long before
# checking for new requests again (a finished load wakes it at once).
LOAD_POLL_S = 0.01


@dataclass(slots=True)
class _Request:
    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None = None  # so far, when the params ask for them


class LLMEngine:
    """``step() = scheduler.schedule() -> model_runner.execute(plan) -> scheduler.update(...)``."""

    def __init__(self, config: EngineConfig) -> None:
        # torch is imported here, not at module level, so that torch-free code can import
        # this package's pure-Python parts.
        from splitserve.engine.model_runner import ModelRunner
        from splitserve.models.loader import load_model

        self.config = config
        loaded = load_model(config.model, dtype=config.dtype, device=config.device)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_id = loaded.config.model_id
        self.runner = ModelRunner(
            loaded,
            block_size=config.block_size,
            kv_cache_bytes=int(config.kv_cache_gb * 2**30),
            max_num_seqs=config.max_num_seqs,
            device=config.device,
            threads=config.threads,
            shared_kv=config.kv_cache_shm,
            split_gemv=config.split_gemv,
            fused_decode=config.fused_decode,
        )
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size)
        self.max_model_len = self._max_model_len()
        self.kv_tiers = _build_tiers(config, self.runner, self.model_id)
        self.tiering = Tiering(
            self.block_manager,
            self.kv_tiers.ladder.store if self.kv_tiers else None,
            _retention(config, self.runner.num_blocks),
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                policy=config.scheduling_policy,
            ),
            self.block_manager,
            self.tiering,
        )
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        self._requests: dict[str, _Request] = {}
        # Called after every model run with (plan, wall s, thread CPU s): engine/step_log.py.
        self.step_log: Callable[[StepPlan, float, float], None] | None = None
        # Guards every piece of engine state but the model runner's own. ``step`` holds it
        # except while the model runs, so another thread that takes it (a peer's KV lease,
        # a KV import) waits for bookkeeping between two model runs, never for a model run.
        # Whoever drives the engine takes it for anything else it calls (AsyncEngine does).
        self.lock = threading.RLock()

    def _max_model_len(self) -> int:
        pool_tokens = self.runner.num_blocks * self.config.block_size
        limit = min(self.model_config.max_position_embeddings, pool_tokens)
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.config.max_model_len} exceeds what this model and KV "
                f"pool allow ({limit} tokens); raise kv_cache_gb or lower max_model_len"
            )
        return self.config.max_model_len

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        salt: str = "",
        keep_blocks: bool = False,
        retention_s: float | None = None,
        session_id: str | None = None,
        output_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request. Raises ``ValueError`` (``InvalidParameter``) on bad input.

        ``keep_blocks``: the request is a prefill for a remote decode; when it finishes its
        KV blocks stay referenced (``RequestOutput.kept_blocks``) until ``release_blocks``.
        ``retention_s``: keep the prompt's KV pinned in the pool this long after finishing,
        within ``session_id``'s quota. ``output_token_ids``: tokens it generated already (on
        a worker that died): they are its first output, as if it had been preempted after
        them, so its seeded draws, penalties, grammar and stop strings go on from there.
        """
        if request_id in self._requests:
            raise InvalidParameter("request_id", f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids)
        output = list(output_token_ids or ())
        self._validate_output(prompt_token_ids, output, params)
        seq = Sequence(
            request_id=request_id,
            token_ids=list(prompt_token_ids) + output,
            params=params,
            root_hash=self._root(salt),
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.monotonic(),
            num_prompt_tokens=len(prompt_token_ids),
            keep_blocks=keep_blocks,
            retention_s=retention_s,
            session_id=session_id,
        )
        try:
            self.runner.add_request(request_id, params, seq.prompt_token_ids, output)
        except ValueError as e:
            raise InvalidParameter("grammar", str(e)) from e
        self.scheduler.add(seq)
        detok = IncrementalDetokenizer(self.tokenizer.decode, stop=list(params.stop))
        detok.update(output)  # the text the output so far had: its stream already sent it
        logprobs = [] if params.logprobs is not None else None
        self._requests[request_id] = _Request(seq, prompt, detok, logprobs)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise InvalidParameter("prompt", "prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise InvalidParameter("prompt", f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidParameter(
                "prompt",
                f"prompt has {len(prompt_token_ids)} tokens; this model's maximum context "
                f"length is {self.max_model_len} tokens, including at least one output token",
            )

    def _validate_output(
        self, prompt_token_ids: list[int], output: list[int], params: SamplingParams
    ) -> None:
        if not output:
            return
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in output):
            raise InvalidParameter(
                "output_token_ids", f"output token ids must be integers in [0, {vocab})"
            )
        if len(output) >= params.max_tokens:
            raise InvalidParameter(
                "output_token_ids",
                f"{len(output)} output tokens leave none of max_tokens={params.max_tokens}",
            )
        if len(prompt_token_ids) + len(output) >= self.max_model_len:
            raise InvalidParameter(
                "output_token_ids",
                f"the prompt and output fill this model's context of {self.max_model_len}",
            )

    # ---- KV blocks in and out (disaggregation, tiers) ------------------------------------

    def _root(self, salt: str) -> bytes:
        """The root hash of ``salt``'s chains, named to the block manager (KV events)."""
        root = root_hash(self.model_id, salt)
        self.block_manager.note_salt(root, salt)
        return root

    def block_hashes(self, token_ids: list[int], salt: str = "") -> list[bytes]:
        return hash_blocks(token_ids, root_hash(self.model_id, salt), self.config.block_size)

    def reserve_blocks(self, num_blocks: int) -> list[int] | None:
        return self.block_manager.reserve(num_blocks)

    def register_blocks(
        self,
        block_ids: list[int],
        hashes: list[bytes],
        token_ids: list[int],
        start_block: int = 0,
        parent: bytes | None = None,
        salt: str = "",
    ) -> None:
        """Publish reserved blocks that were filled from outside (a KV transfer) into the
        prefix cache; like blocks computed here, they are saved down the tier ladder.
        ``parent``: the hash of block ``start_block - 1`` (None for block 0), and ``salt``
        the chain's, for KV events."""
        root = self._root(salt)
        self.block_manager.register(
            block_ids, hashes, token_ids, start_block, parent=parent, root=root
        )
        self.tiering.on_cached(list(zip(block_ids, hashes, strict=True)))

    def release_blocks(self, block_ids: list[int]) -> None:
        self.block_manager.release(block_ids)

    def lease_prefix(self, token_ids: list[int], salt: str = "") -> KeptBlocks | None:
        """Take one reference on each block of the leading run of this prompt's reusable
        blocks that the device pool holds (tokens checked), so that a peer can read them:
        they are neither evicted nor reused until ``release_blocks``. None if none is held."""
        usable = self.block_manager.reusable_blocks(len(token_ids))
        hashes = self.block_hashes(token_ids[: usable * self.config.block_size], salt)
        block_ids = self.block_manager.take_cached(hashes, token_ids)
        if not block_ids:
            return None
        return KeptBlocks(block_ids, hashes[: len(block_ids)])

    def prefetch(self, token_ids: list[int], salt: str = "") -> int:
        """Start promoting this prompt's prefix from lower tiers (a hint that it is coming);
        returns how many blocks are on their way up."""
        return self.local_prefix(token_ids, salt)[1]

    def local_prefix(self, token_ids: list[int], salt: str = "") -> tuple[int, int]:
        """The leading reusable blocks of this prompt held here: ``(held, loading)``, in the
        device pool and now on their way up from lower tiers (this starts those loads)."""
        held, loading = self.tiering.prefetch(token_ids, self._root(salt))
        self._start_copies()
        return held, loading

    def retain_prefix(
        self, token_ids: list[int], session_id: str, ttl_s: float | None = None, salt: str = ""
    ) -> int:
        """Pin what the device pool still holds of ``token_ids``' KV (a finished reply's prompt
        and output) as ``session_id``'s pin, for ``ttl_s`` (default: the configured TTL);
        returns how many blocks it pinned. The serving layer calls this after a reply that
        called tools: the session is coming back once the tool has run."""
        hashes = self.block_hashes(token_ids, salt)
        block_ids = self.block_manager.cached_blocks(hashes, token_ids)
        ttl = self.tiering.retention.default_ttl_s if ttl_s is None else ttl_s
        return self.tiering.pin(session_id, block_ids, ttl)

    def erase_blocks(self, hashes: Collection[bytes]) -> ErasedBlocks:
        """Erase these blocks' KV from the device pool, its pins and every lower tier (disk
        files unlinked); blocks in use stay and are counted. See ``engine.erasure``."""
        return erase_blocks(self, hashes)

    def housekeeping(self) -> None:
        """Between steps, also when idle: apply finished tier copies and expire pins."""
        if self.kv_tiers is not None:
            for done in self.kv_tiers.mover.completed():
                for seq in reversed(self.tiering.complete(done)):
                    self.scheduler.resume(seq)  # to the queue's front, in their order
        self.tiering.expire_pins()
        self._start_copies()

    def _start_copies(self) -> None:
        if self.kv_tiers is not None:
            self.kv_tiers.mover.submit(self.tiering.take_copies())

    def close(self, timeout_s: float = 5.0) -> bool:
        """Finish pending tier copies and disk writes (SIGTERM); True if all landed in time."""
        self.runner.close()
        if self.kv_tiers is None:
            return True
        self._start_copies()
        moved = self.kv_tiers.mover.close(timeout_s)
        return self.kv_tiers.ladder.store.close(timeout_s) and moved

    def abort_request(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)
            self.runner.remove_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that produced a token."""
        with self.lock:
            self.housekeeping()
            plan = self.scheduler.schedule()
            self._start_copies()
            loading = not plan and self.kv_tiers is not None and self.tiering.busy
        if not plan:
            if loading:
                self.kv_tiers.mover.wait(LOAD_POLL_S)
            return []
        # Without the lock: the plan's blocks are referenced by its sequences, so whatever
        # another thread does meanwhile (take refs, reserve or publish free blocks) leaves
        # them alone, and nothing else the model run reads changes.
        if self.step_log is None:
            result = self.runner.execute(plan)
        else:
            start, cpu = time.perf_counter(), time.thread_time()
            result = self.runner.execute(plan)
            self.step_log(plan, time.perf_counter() - start, time.thread_time() - cpu)
        with self.lock:
            updates = self.scheduler.update(plan, result)
            self._start_copies()
            return [out for u in updates if (out := self._process(u, result)) is not None]

    def _process(self, update: SequenceUpdate, result: StepResult) -> RequestOutput | None:
        if update.new_token is None:
            return None
        seq = update.seq
        request = self._requests[seq.request_id]
        delta_logprobs = None
        if request.logprobs is not None:
            delta_logprobs = [result.logprobs[seq.request_id]]
            request.logprobs.extend(delta_logprobs)
        detok = request.detokenizer
        delta = detok.update(seq.output_token_ids, final=update.finished)
        if detok.stopped and not update.finished:
            self.scheduler.finish(seq, "stop")
        finished = seq.is_finished
        kept = None
        if finished:
            del self._requests[seq.request_id]
            self.runner.remove_request(seq.request_id)
            if seq.keep_blocks and seq.finish_reason != "abort":
                kept = KeptBlocks(list(seq.block_table), list(seq.block_hashes))
        return RequestOutput(
            request_id=seq.request_id,
            prompt=request.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    0, detok.text, seq.output_token_ids, seq.finish_reason, request.logprobs
                )
            ],
            finished=finished,
            num_cached_tokens=seq.num_cached_tokens,
            delta_text=delta,
            delta_token_ids=[update.new_token],
            delta_logprobs=delta_logprobs,
            kept_blocks=kept,
        )


@dataclass(slots=True)
class KVTiers:
    """The engine's lower tiers: the store and the thread that copies blocks to and from it."""

    ladder: Ladder
    mover: KVMover


def _build_tiers(config: EngineConfig, runner, model_id: str) -> KVTiers | None:
    from splitserve.engine.kv_mover import KVMover

    ladder = build_ladder(config.kv_tiers, model_id)
    if ladder is None:
        return None
    return KVTiers(ladder, KVMover(runner.kv_cache, ladder.store, ladder.names))


def _retention(config: EngineConfig, num_blocks: int) -> RetentionConfig:
    t = config.kv_tiers
    return RetentionConfig(
        default_ttl_s=t.retention_ttl_s,
        quota_blocks=int(t.retention_quota * num_blocks),
        max_pinned_blocks=int(t.retention_max_pinned * num_blocks),
    )
