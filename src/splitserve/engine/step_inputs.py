"""A step's model inputs: token ids, positions and the attention context (KV slots, block
tables, masks), built from the scheduler's ``StepPlan`` for the model runner."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from splitserve.engine.plan import ScheduledChunk, StepPlan
from splitserve.models.attention import (
    AttentionContext,
    DecodeGroup,
    PrefillSpan,
    offset_causal_mask,
)

# Decodes are attended in groups of this many sequences. Each layer gathers a group's pages
# into one padded buffer and SDPA reads it right back: for 4 sequences of up to ~1k tokens
# that is a few MB, which stays in L3, where a 32-sequence buffer (tens of MB) went out to
# memory and back, and each group is padded only to its own longest context. Measured at
# batch 32: 2.4x less time in decode attention than one group.
DECODE_GROUP_SIZE = 4


@dataclass(slots=True)
class Batch:
    """One step's model inputs, plus which rows to sample for which chunk."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: AttentionContext
    sample_rows: torch.Tensor
    sample_chunks: list[ScheduledChunk]


class StepInputs:
    """Builds and checks a step's inputs for one KV cache (its block size and block count)."""

    def __init__(
        self, block_size: int, num_blocks: int, max_num_seqs: int, device: torch.device
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.device = device

    def build(self, plan: StepPlan, sample_all: bool, paged: bool, threads: int) -> Batch:
        """The model inputs of ``plan``: ``sample_all`` samples every chunk's last row,
        ``paged``: decodes read the paged cache in place (else grouped gathers)."""
        if len(plan.chunks) > self.max_num_seqs:
            raise ValueError(
                f"step has {len(plan.chunks)} sequences, max_num_seqs is {self.max_num_seqs}"
            )
        for chunk in plan.chunks:
            self.check(chunk)
        decodes, prefills = _split(plan.chunks)
        ordered = decodes + prefills
        dev = self.device
        input_ids = torch.tensor(
            list(chain.from_iterable(c.token_ids for c in ordered)), dtype=torch.long
        )
        positions = [np.array([c.start_pos for c in decodes], dtype=np.int64)]
        positions += [np.arange(c.start_pos, c.context_len, dtype=np.int64) for c in prefills]
        positions_np = np.concatenate(positions)
        ctx = self._attention_context(decodes, prefills, positions_np, paged, threads)
        sample_rows, sample_chunks, offset = [], [], 0
        for c in ordered:
            offset += c.num_tokens
            if c.sample or sample_all:
                sample_rows.append(offset - 1)
                sample_chunks.append(c)
        return Batch(
            input_ids.to(dev),
            torch.from_numpy(positions_np).to(dev),
            ctx,
            torch.tensor(sample_rows, dtype=torch.long, device=dev),
            sample_chunks,
        )

    def _attention_context(
        self,
        decodes: list[ScheduledChunk],
        prefills: list[ScheduledChunk],
        positions: np.ndarray,
        paged: bool,
        threads: int,
    ) -> AttentionContext:
        bs = self.block_size
        slots = []
        if decodes:
            slots.append(np.array([self.slot(c.block_table, c.start_pos) for c in decodes]))
        tables = lens = None
        if decodes and paged:
            tables, lens = self.decode_tables(decodes)
            groups: tuple[DecodeGroup, ...] = ()
        else:
            groups = tuple(
                self._decode_group(decodes[i : i + DECODE_GROUP_SIZE], i)
                for i in range(0, len(decodes), DECODE_GROUP_SIZE)
            )
        spans, offset = [], len(decodes)
        for c in prefills:
            table = np.asarray(c.block_table[: _blocks_for(c.context_len, bs)], dtype=np.int64)
            pos = positions[offset : offset + c.num_tokens]
            slots.append(table[pos // bs] * bs + pos % bs)
            spans.append(self._prefill_span(c, offset, table))
            offset += c.num_tokens
        slot_mapping = torch.from_numpy(np.concatenate(slots)).to(self.device)
        return AttentionContext(
            slot_mapping, len(decodes), groups, tuple(spans), tables, lens, threads
        )

    def slot(self, block_table: list[int], pos: int) -> int:
        return block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _decode_group(self, decodes: list[ScheduledChunk], offset: int) -> DecodeGroup:
        table_np, lens = self.decode_tables(decodes)
        dev = self.device
        width = table_np.shape[1] * self.block_size
        lens_t = torch.from_numpy(lens).to(dev)
        mask = torch.arange(width, device=dev).unsqueeze(0) < lens_t.unsqueeze(1)
        return DecodeGroup(
            offset, torch.from_numpy(table_np).to(dev), mask.view(len(decodes), 1, 1, width)
        )

    def _prefill_span(self, c: ScheduledChunk, offset: int, table: np.ndarray) -> PrefillSpan:
        mask = offset_causal_mask(c.start_pos, c.num_tokens, self.device)
        return PrefillSpan(
            offset, c.num_tokens, c.start_pos, torch.from_numpy(table).to(self.device), mask
        )

    def decode_tables(self, decodes: list[ScheduledChunk]) -> tuple[np.ndarray, np.ndarray]:
        """Block tables padded to the longest (padding points at block 0, masked out) and
        context lengths, trimmed to the blocks the contexts actually use."""
        lens = np.array([c.context_len for c in decodes], dtype=np.int64)
        width = _blocks_for(int(lens.max()), self.block_size)
        tables = np.zeros((len(decodes), width), dtype=np.int64)
        for i, c in enumerate(decodes):
            used = c.block_table[: _blocks_for(c.context_len, self.block_size)]
            tables[i, : len(used)] = used
        return tables, lens

    def check(self, c: ScheduledChunk) -> None:
        if not c.token_ids or c.start_pos < 0:
            raise ValueError(f"request {c.request_id}: chunk needs >= 1 token and start_pos >= 0")
        needed = _blocks_for(c.context_len, self.block_size)
        if len(c.block_table) < needed:
            raise ValueError(
                f"request {c.request_id}: block table has {len(c.block_table)} "
                f"blocks, context of {c.context_len} tokens needs {needed}"
            )
        used = c.block_table[:needed]
        if min(used) < 0 or max(used) >= self.num_blocks:
            raise ValueError(
                f"request {c.request_id}: block id out of range [0, {self.num_blocks}) in {used}"
            )


def _split(chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
    """Single-token chunks (decodes) run batched; longer ones (prefills) one by one."""
    decodes = [c for c in chunks if c.num_tokens == 1]
    prefills = [c for c in chunks if c.num_tokens > 1]
    return decodes, prefills


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
