"""Erasing KV blocks from one engine: the device pool, its pins and every lower tier.

Runs on the engine thread between two steps (``AsyncEngine.call``), so no model run reads
or writes the pool meanwhile. In order:

1. settle the tier copies: every save and load in flight lands and is applied, so no copy
   puts an erased block back down the ladder or up into the pool afterwards;
2. end the pins that hold one of the blocks (their blocks go back to the free queue);
3. erase the blocks from the lower tiers: host RAM, queued writes, disk files (unlinked);
4. uncache the device blocks no one references and overwrite them with zeros (the pool
   may be a shared-memory segment that peers map). A block still referenced (a running
   request, a lease a peer is reading) stays where it is and is reported ``in_use``.

Leases are the worker's (``worker.disagg``): it ends them before calling this.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from splitserve.common.kv_hash import BlockHash

if TYPE_CHECKING:
    from splitserve.engine.block_manager import BlockManager
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.tiering import Tiering


class ErasableEngine(Protocol):
    """What erasing needs of an engine (``LLMEngine``, which calls it)."""

    block_manager: BlockManager
    tiering: Tiering
    kv_tiers: Any  # ``llm_engine.KVTiers`` or None
    runner: ModelRunner

    def housekeeping(self) -> None: ...


SETTLE_TIMEOUT_S = 30.0


@dataclass(slots=True)
class ErasedBlocks:
    """What one erasure removed, by place, and the blocks it had to leave in the pool."""

    device: int = 0
    host: int = 0
    disk: int = 0
    queued: int = 0  # copies waiting for a lower tier, dropped before they were written
    pins: int = 0
    in_use: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def erase_blocks(engine: ErasableEngine, hashes: Collection[BlockHash]) -> ErasedBlocks:
    """Erase ``hashes`` from ``engine``'s pool, pins and tiers (see the module docstring)."""
    out = ErasedBlocks()
    if not hashes:
        return out
    settle_copies(engine)
    bm = engine.block_manager
    out.pins = engine.tiering.unpin_holding(bm.cached_ids(hashes))
    if engine.kv_tiers is not None:
        erased = engine.kv_tiers.ladder.store.erase(hashes)
        for name, n in zip(engine.kv_tiers.ladder.names, erased.per_tier, strict=True):
            setattr(out, name, getattr(out, name) + n)
        out.queued = erased.queued
    freed, in_use = bm.uncache(hashes)
    engine.runner.zero_blocks(freed)
    out.device, out.in_use = len(freed), len(in_use)
    return out


def settle_copies(engine: ErasableEngine, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """Let every tier copy decided so far finish, and apply it. Raises ``TimeoutError``."""
    tiers = engine.kv_tiers
    if tiers is None:
        return
    while True:
        engine.housekeeping()  # applies finished copies, submits the ones decided
        if tiers.mover.idle():
            return
        if not tiers.mover.drain(timeout_s):
            raise TimeoutError(f"KV tier copies still running after {timeout_s:g}s")
