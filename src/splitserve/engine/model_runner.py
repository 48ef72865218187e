"""The model runner: owns the paged KV cache, turns a ``StepPlan`` into tensors, runs the
model and samples. It makes no policy decisions; the scheduler made them all."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.core_share import CoreShare
from splitserve.engine.kv_pages import zero_blocks
from splitserve.engine.plan import ScheduledChunk, StepPlan, StepResult
from splitserve.engine.sampler import apply_penalties, sample, token_logprobs
from splitserve.engine.shm_cache import SharedKVCache
from splitserve.engine.step_inputs import Batch, StepInputs
from splitserve.models.llama import SplitGemv
from splitserve.models.loader import LoadedModel

if TYPE_CHECKING:
    from splitserve.engine.grammar import GrammarMasks, PendingMasks
    from splitserve.models.decode_step import DecodeStep
    from splitserve.models.fused_decode import FusedDecoder

# Steps of fewer tokens than this run on one intra-op thread on plain weights (their weight
# products excepted when ``split_gemv`` splits them across the runner's threads, see
# ``SplitGemv``; packed weights keep every thread, see ``_threads_for``). MKL runs
# those few-row products on one core whatever the thread count, and every other op of such a
# step is too small to split, so a second OpenMP thread there only adds a fork/join per op: on
# this box a batch-1 decode step took 46 ms at 1 thread and 54-64 ms at 2, and far worse when
# another process holds the other core. From about 8 rows on, the GEMMs are compute-bound and
# use the threads themselves.
SMALL_STEP_TOKENS = 8
# With ``split_gemv``, steps of at most this many tokens split their weight products: up to here
# MKL's GEMM leaves a core idle for a product this narrow (benchmarks/gemv_split.py).
SPLIT_GEMV_MAX_TOKENS = 32

# Decode-only steps of at most this many sequences run on the numba fused path when it is on
# (models/fused_decode.py): it reads each weight once for all rows, but computes with plain
# vector loops, where MKL's GEMM wins once a step has enough rows to be compute-bound.
FUSED_DECODE_MAX_SEQS = 4
# The C++ step (models/decode_step.py) computes as the torch path does, without its per-op
# overhead: it takes every decode-only step up to this many sequences.
NATIVE_STEP_MAX_SEQS = 1024

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _History:
    """A penalized request's tokens: its prompt (for the repetition penalty) and outputs."""

    prompt: list[int]
    output: list[int]


class ModelRunner:
    """Runs steps of a loaded model over a paged KV cache of ``num_blocks`` blocks of
    ``block_size`` tokens, sized to fit ``kv_cache_bytes``.

    The cache is one tensor ``[num_layers, 2 (k, v), num_blocks, block_size, kvh, head_dim]``,
    so block ``b`` of every layer is ``kv_cache[:, :, b]`` (what a KV transfer moves). With
    ``shared_kv`` it lives in a shared-memory segment named ``kv_segment.name``, from which
    same-host decode workers copy blocks directly; ``close()`` unlinks that name.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        block_size: int = 16,
        kv_cache_bytes: int = 512 * 2**20,
        max_num_seqs: int = 256,
        device: str | torch.device = "cpu",
        threads: int | None = None,
        shared_kv: bool = False,
        split_gemv: bool = False,
        fused_decode: bool = False,
        paged_decode: bool = True,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if threads is not None:
            self.set_threads(threads)
        self.threads = torch.get_num_threads()
        self.split_gemv = split_gemv
        self.model, self.config = loaded.model, loaded.config
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        cfg, dtype = self.config, self.model.dtype
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        self.bytes_per_block = per_token * block_size
        self.num_blocks = kv_cache_bytes // self.bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} is less than one KV block "
                f"({self.bytes_per_block} bytes at block_size={block_size})"
            )
        shape = (cfg.num_layers, 2, self.num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeros, not empty: padded decode gathers read unwritten slots, and masked-out NaNs
        # would still poison the attention output (0 * NaN). Shared memory starts zeroed.
        self.kv_segment: SharedKVCache | None = None
        if shared_kv:
            self.kv_segment = SharedKVCache(shape, dtype)
            self.kv_cache = self.kv_segment.tensor
        else:
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.model.bind_kv_cache(self.kv_cache)
        self.packed = self.model.lm_head_packed is not None  # see models.llama.packed_weight
        self.paged_decode = paged_decode and self._paged_decode_available()
        self.inputs = StepInputs(block_size, self.num_blocks, max_num_seqs, self.device)
        self.fused: DecodeStep | FusedDecoder | None = None
        self.core_share = CoreShare()  # the fused path's threads: those others leave free
        self.use_fused_decode(fused_decode)
        # Per-request sampling state, for the requests that need some (add_request).
        self.tokenizer = loaded.tokenizer
        self._grammar: GrammarMasks | None = None  # made on the first constrained request
        self._histories: dict[str, _History] = {}

    def add_request(
        self,
        request_id: str,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: Sequence[int] = (),
    ) -> None:
        """Set up what sampling a request needs beyond its params: its grammar's matcher
        (``ValueError`` if the grammar does not compile), its penalties' token history.
        ``output_token_ids``: what it has generated already (a resumed stream), consumed by
        both. ``remove_request`` drops it."""
        output = list(output_token_ids)
        if params.grammar is not None:
            self.grammar_masks().add(request_id, params.grammar, params.grammar_trigger, output)
        if params.penalized:
            self._histories[request_id] = _History(list(prompt_token_ids), output)

    def remove_request(self, request_id: str) -> None:
        if self._grammar is not None:
            self._grammar.remove(request_id)
        self._histories.pop(request_id, None)

    def grammar_masks(self) -> GrammarMasks:
        """The runner's matchers (the first call builds llguidance's view of the vocabulary,
        ~2 s for the bundled model)."""
        if self._grammar is None:
            from splitserve.engine.grammar import GrammarMasks  # imports llguidance

            if self.tokenizer is None:
                raise ValueError("constrained decoding needs the model's tokenizer")
            self._grammar = GrammarMasks(self.tokenizer, self.config.vocab_size)
        return self._grammar

    def _paged_decode_available(self) -> bool:
        from splitserve.models import paged_decode  # imports numba: only when asked for

        if not paged_decode.available(self.kv_cache):
            logger.warning("decode attention runs the torch path (gather + SDPA)")
            return False
        return True

    def use_fused_decode(self, on: bool) -> bool:
        """Turn the fused decode path on or off; returns whether it is on (it stays off, with
        a warning, where numba or the model does not allow it)."""
        if not on:
            self.fused = None
        elif self.fused is None:
            self.fused = self._make_fused()
        return self.fused is not None

    @property
    def fused_max_seqs(self) -> int:
        """The most sequences a decode-only step may have to run on the fused path (0: off)."""
        if self.fused is None:
            return 0
        return NATIVE_STEP_MAX_SEQS if self.fused.exact else FUSED_DECODE_MAX_SEQS

    def _make_fused(self) -> DecodeStep | FusedDecoder | None:
        from splitserve.models import decode_step

        native = decode_step.unavailable_reason(self.model)
        if native is None:
            return decode_step.DecodeStep(self.model)
        logger.info("decode steps in one C++ call are off: %s", native)
        from splitserve.models import fused_decode  # imports numba: only when asked for

        reason = fused_decode.unavailable_reason(self.model, self.device)
        if reason is not None:
            logger.warning("fused decode is off, the torch path runs every step: %s", reason)
            return None
        return fused_decode.FusedDecoder(self.model, parts=self.threads)

    def close(self) -> None:
        """Unlink the shared cache's name, if any (the cache itself stays usable)."""
        if self.kv_segment is not None:
            self.kv_segment.close()

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Overwrite KV blocks with zeros (erased KV); between steps, on the engine thread."""
        if block_ids:
            zero_blocks(self.kv_cache, block_ids)

    @staticmethod
    def set_threads(n: int) -> None:
        """Intra-op CPU threads for torch (process-wide)."""
        if n < 1:
            raise ValueError(f"threads must be >= 1, got {n}")
        torch.set_num_threads(n)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step: write every chunk's KV, and sample for chunks with ``sample=True``."""
        if not plan:
            return StepResult()
        self._bind()
        if self._fused_applies(plan):
            return self._execute_fused(plan)
        batch = self._prepare(plan)
        masks = self._start_masks(batch.sample_chunks)
        with torch.inference_mode(), self._threads_for(plan.num_tokens):
            hidden = self.model(batch.input_ids, batch.positions, batch.ctx)
            if not batch.sample_chunks:
                return StepResult()
            logits = self.model.compute_logits(hidden[batch.sample_rows])
            return self._sample(logits, batch.sample_chunks, masks)

    def _start_masks(self, chunks: list[ScheduledChunk]) -> PendingMasks | None:
        """Start the grammar masks of the rows to sample; they compute while the model runs."""
        if self._grammar is None:
            return None
        return self._grammar.start([c.request_id for c in chunks])

    def _sample(
        self, logits: torch.Tensor, chunks: list[ScheduledChunk], masks: PendingMasks | None
    ) -> StepResult:
        """Penalties, grammar masks, sampling, log-probabilities (of the model's own
        distribution, before penalties and masks, as vLLM reports them by default)."""
        ids = [c.request_id for c in chunks]
        params = [c.params for c in chunks]
        processed = logits
        if self._histories:
            histories = [self._histories.get(rid) for rid in ids]
            processed = apply_penalties(
                logits,
                params,
                [h.prompt if h else None for h in histories],
                [h.output if h else None for h in histories],
            )
        if self._grammar is not None:
            processed = self._grammar.apply(processed, masks)
        tokens = sample(processed, params, [c.num_output_tokens for c in chunks])
        logprobs = token_logprobs(logits, tokens, [p.logprobs for p in params])
        if self._grammar is not None:
            self._grammar.advance(ids, tokens)
        for rid, token in zip(ids, tokens, strict=True):
            if (h := self._histories.get(rid)) is not None:
                h.output.append(token)
        return StepResult(
            dict(zip(ids, tokens, strict=True)),
            {rid: lp for rid, lp in zip(ids, logprobs, strict=True) if lp is not None},
        )

    def last_logits(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """Run one step like ``execute`` but return, per chunk, the float32 logits of its last
        token instead of sampling (tests, scoring tools)."""
        self._bind()
        if self._fused_applies(plan):
            logits = self._fused_logits(plan)
            return dict(zip((c.request_id for c in plan.chunks), logits, strict=True))
        batch = self._prepare(plan, sample_all=True)
        with torch.inference_mode():
            hidden = self.model(batch.input_ids, batch.positions, batch.ctx)
            logits = self.model.compute_logits(hidden[batch.sample_rows])
        return {c.request_id: row for c, row in zip(batch.sample_chunks, logits, strict=True)}

    def _fused_applies(self, plan: StepPlan) -> bool:
        chunks = plan.chunks
        return (
            self.fused is not None
            and len(chunks) <= self.fused_max_seqs
            and all(c.num_tokens == 1 for c in chunks)
        )

    def _execute_fused(self, plan: StepPlan) -> StepResult:
        rows = [i for i, c in enumerate(plan.chunks) if c.sample]
        chunks = [plan.chunks[i] for i in rows]
        masks = self._start_masks(chunks)
        logits = self._fused_logits(plan)
        if not rows:
            return StepResult()
        if len(rows) < len(plan.chunks):
            logits = logits[rows]
        with torch.inference_mode(), self._threads_for(1, fused=True):
            return self._sample(logits, chunks, masks)

    def _fused_logits(self, plan: StepPlan) -> torch.Tensor:
        """Logits of a decode-only step (one row per chunk, in plan order) on the fused path."""
        decodes = plan.chunks
        for c in decodes:
            self.inputs.check(c)
        tables, lens = self.inputs.decode_tables(decodes)
        slots = np.array([self.inputs.slot(c.block_table, c.start_pos) for c in decodes])
        input_ids = torch.tensor([c.token_ids[0] for c in decodes], dtype=torch.long)
        # Small steps take their threads from CoreShare, which compares their times; a larger
        # one keeps every thread, as the torch path does (and would skew those times).
        small = len(decodes) <= FUSED_DECODE_MAX_SEQS
        with torch.inference_mode(), self._threads_for(1, fused=True):
            threads = self.core_share.threads(self.threads) if small else self.threads
            start = time.perf_counter()
            logits = self.fused.forward(input_ids, slots, tables, lens, threads)
            if small:
                self.core_share.record(threads, self.threads, time.perf_counter() - start)
            return logits

    @contextmanager
    def _threads_for(self, num_tokens: int, fused: bool = False) -> Iterator[None]:
        """One intra-op thread for small steps (see ``SMALL_STEP_TOKENS``) and around the
        fused path (``fused``: its kernel has threads of its own), ``threads`` otherwise;
        weight products of steps up to ``SPLIT_GEMV_MAX_TOKENS`` split over ``threads``.
        Restores the process-wide setting afterwards."""
        # On packed weights every step keeps all the threads: oneDNN spreads even a one-row
        # product over them with the same result at any count.
        small = fused or (num_tokens < SMALL_STEP_TOKENS and not self.packed)
        split = self.split_gemv and not self.packed and num_tokens <= SPLIT_GEMV_MAX_TOKENS
        before = torch.get_num_threads()
        torch.set_num_threads(1 if small else self.threads)
        try:
            with SplitGemv.over(self.threads if split else 1):
                yield
        finally:
            torch.set_num_threads(before)

    def _bind(self) -> None:
        # Several runners may share one model (tests, a tool next to an engine): make sure
        # its layers point at this runner's cache.
        if self.model.kv_cache is not self.kv_cache:
            self.model.bind_kv_cache(self.kv_cache)

    def _prepare(self, plan: StepPlan, sample_all: bool = False) -> Batch:
        return self.inputs.build(plan, sample_all, self.paged_decode, self.threads)
