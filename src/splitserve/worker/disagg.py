"""The worker's half of prefill/decode disaggregation.

Prefill role: a request with ``kv_transfer_params.do_remote_decode`` computes its prompt
(one token), keeps the prompt's full KV blocks under a lease and answers with the
``kv_transfer_params`` a decode worker needs to pull them. The lease ends when the decode
worker confirms or after its TTL; either way the blocks go back to this engine's pool.

Decode role: a request carrying ``do_remote_prefill`` first pulls the blocks it lacks into
its own pool and publishes them in its prefix cache, then runs as a normal request, whose
admission finds the prompt cached::

    prompt:  [ full block 0 ][ full block 1 ] ... [ full block n-1 ][ tail < B ]
              held here?  ──▶ skip            pull the rest ──▶      computed here

The tail (fewer than B tokens) and the first output token are always computed locally, so
the decode worker's answer is the same as when it prefills alone. Any transfer failure
falls back to that local prefill (policy ``recompute``) or fails the request (``fail``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from splitserve.engine.kv_pages import KVCacheBlocks, block_shape, dtype_name
from splitserve.engine.outputs import KeptBlocks
from splitserve.transfer import (
    KVConnectorScheduler,
    KVTransferError,
    Lease,
    LeaseTable,
    LoadPlan,
    RemoteKV,
    build_transfer_params,
    get_connector,
)
from splitserve.worker.disagg_config import DisaggConfig
from splitserve.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineCalls(Protocol):
    """Running code on the engine thread, the only one allowed to touch the engine, or
    (``call_now``) under the engine's lock, between two of its model runs."""

    async def call(self, fn: Callable[[Any], T]) -> T: ...
    async def call_now(self, fn: Callable[[Any], T]) -> T: ...
    def submit(self, fn: Callable[[Any], object]) -> None: ...


class KVLoadFailed(Exception):
    """The KV pull failed and the policy is ``fail``."""


class PrefillSide:
    """Serves kept prompt blocks to decode workers under leases."""

    def __init__(self, cfg: DisaggConfig, engine: Any, calls: EngineCalls, metrics: WorkerMetrics):
        self.cfg = cfg
        self.engine = engine
        self.calls = calls
        self.metrics = metrics
        self.engine_id = f"{cfg.kv_host}:{cfg.kv_port}"
        self.leases = LeaseTable(on_end=self._on_lease_end, default_ttl_s=cfg.lease_ttl_s)
        kv = engine.runner.kv_cache
        self._kv_dtype, self._kv_shape = dtype_name(kv.dtype), block_shape(kv)
        connector = get_connector(cfg.transport, cfg.transfer_config())
        segment = engine.runner.kv_segment
        source = KVCacheBlocks(kv, shm_segment=segment.name if segment is not None else None)
        self.server = connector.make_server(source, self.leases, cfg.kv_host, cfg.kv_port)
        block_bytes = engine.runner.bytes_per_block
        metrics.kv_blocks_sent.set_function(lambda: self.server.blocks_served)
        metrics.kv_bytes_sent.set_function(lambda: self.server.blocks_served * block_bytes)

    def start(self) -> None:
        host, port = self.server.start()
        self.address = (host, port)
        self.engine_id = f"{host}:{port}"
        log.info("KV %s server on %s:%d", self.cfg.transport, host, port)

    def stop(self) -> None:
        self.server.stop()

    def grant(
        self,
        request_id: str,
        kept: KeptBlocks,
        num_prompt_tokens: int,
        ttl_s: float | None = None,
    ) -> dict[str, Any]:
        """Lease ``kept`` to a decode worker (or a peer) for ``ttl_s`` seconds (default: the
        configured TTL); the ``kv_transfer_params`` to send it."""
        full = kept.block_ids[: len(kept.hashes)]
        self.leases.grant(request_id, kept.block_ids, kept.hashes, ttl_s)
        self.metrics.kv_leases_granted.inc()
        host, port = self.address
        return build_transfer_params(
            engine_id=self.engine_id,
            request_id=request_id,
            block_ids=full,
            block_hashes=kept.hashes,
            host=host,
            port=port,
            transport=self.cfg.transport,
            block_size=self.engine.config.block_size,
            num_tokens=num_prompt_tokens,
            model_id=self.engine.model_id,
            kv_dtype=self._kv_dtype,
            kv_block_shape=self._kv_shape,
        )

    def _on_lease_end(self, lease: Lease, reason: str) -> None:
        # Called on a transfer-server or reaper thread: hand the free to the engine thread.
        self.metrics.kv_leases_ended.labels(reason).inc()
        block_ids = list(lease.block_ids)
        self.calls.submit(lambda engine: engine.release_blocks(block_ids))


@dataclass(slots=True)
class ImportResult:
    remote: bool  # True when the prompt's KV came from the prefill worker
    blocks: int = 0
    nbytes: int = 0
    fallback: str | None = None  # why the prompt is recomputed locally


class DecodeSide:
    """Pulls a prompt's missing KV blocks from a prefill worker into this engine's cache."""

    def __init__(self, cfg: DisaggConfig, engine: Any, calls: EngineCalls, metrics: WorkerMetrics):
        self.cfg = cfg
        self.engine = engine
        self.calls = calls
        self.metrics = metrics
        kv = engine.runner.kv_cache
        self.sink = KVCacheBlocks(kv)
        self.planner = KVConnectorScheduler(
            engine.config.block_size, engine.model_id, dtype_name(kv.dtype), block_shape(kv)
        )
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _client(self, transport: str):
        with self._lock:
            if transport not in self._clients:
                connector = get_connector(transport, self.cfg.transfer_config())
                self._clients[transport] = connector.make_client()
            return self._clients[transport]

    async def import_kv(
        self, prompt: list[int], params: dict[str, Any], salt: str = ""
    ) -> ImportResult:
        """Make the prompt's remote KV local. Raises ``ValueError`` on malformed params and
        ``KVLoadFailed`` when the pull fails under the ``fail`` policy."""
        remote = RemoteKV.from_params(params)
        result = await self.pull(prompt, remote, salt)
        if result.fallback is not None:
            self.metrics.kv_fallbacks.labels(result.fallback).inc()
            log.warning("KV load failed (%s); prefilling locally", result.fallback)
            if self.cfg.failure_policy == "fail":
                raise KVLoadFailed(f"loading the prompt's KV cache failed: {result.fallback}")
        self.metrics.prefills.labels("remote" if result.remote else "local").inc()
        return result

    async def pull(
        self, prompt: list[int], remote: RemoteKV, salt: str = "", local: int | None = None
    ) -> ImportResult:
        """Pull the blocks of ``remote`` this worker lacks and publish them in its prefix
        cache. ``local``: how many leading blocks of the prompt this worker holds, if the
        caller just asked ``local_blocks``. A failed transfer is no exception here: the
        result names it (``fallback``) and the prompt is computed locally."""
        try:
            return await self._import(prompt, remote, salt, local)
        except KVTransferError as e:
            return ImportResult(remote=False, fallback=e.reason)

    async def local_blocks(self, prompt: list[int], salt: str = "") -> int:
        """Leading blocks of the prompt held here, in the pool or one tier down; the ones
        below start their way up now and arrive while the rest crosses the wire."""
        held, loading = await self.calls.call_now(lambda e: e.local_prefix(prompt, salt))
        self.metrics.kv_local_tier_blocks.inc(loading)
        return held + loading

    async def _import(
        self, prompt: list[int], remote: RemoteKV, salt: str, local: int | None
    ) -> ImportResult:
        hashes = self.engine.block_hashes(prompt, salt)
        n = len(remote.block_hashes)
        if n > len(hashes) or tuple(hashes[:n]) != remote.block_hashes:
            await self._release_remote(remote)
            return ImportResult(remote=False, fallback="hash_mismatch")
        # Blocks this worker holds are not pulled.
        if local is None:
            local = await self.local_blocks(prompt, salt)
        plan = self.planner.plan_load(remote, set(hashes[:local]))
        # Blocks past what the prefix cache may reuse are recomputed anyway: don't pull them.
        usable = self.engine.block_manager.reusable_blocks(len(prompt))
        plan = LoadPlan(
            plan.remote, tuple(i for i in plan.load_indices if i < usable), plan.hit_indices
        )
        if plan.num_blocks == 0:  # everything usable is held here already
            await self._release_remote(remote)
            return ImportResult(remote=False)
        dest = await self.calls.call_now(lambda e: e.reserve_blocks(plan.num_blocks))
        if dest is None:
            await self._release_remote(remote)
            return ImportResult(remote=False, fallback="no_free_blocks")
        client = self._client(remote.transport)
        try:
            pulled = await asyncio.to_thread(client.pull, plan, self.sink, dest)
        except BaseException:
            await self.calls.call_now(lambda e: e.release_blocks(dest))
            raise
        start = plan.load_indices[0]
        loaded = hashes[start : start + plan.num_blocks]
        parent = hashes[start - 1] if start else None
        await self.calls.call_now(
            lambda e: e.register_blocks(dest, loaded, prompt, start, parent, salt)
        )
        self.metrics.kv_blocks_received.inc(pulled.num_blocks)
        self.metrics.kv_bytes_received.inc(pulled.nbytes)
        self.metrics.kv_transfer_seconds.observe(pulled.seconds)
        return ImportResult(remote=True, blocks=pulled.num_blocks, nbytes=pulled.nbytes)

    async def _release_remote(self, remote: RemoteKV) -> None:
        try:
            await asyncio.to_thread(self._client(remote.transport).release, remote)
        except KVTransferError as e:  # the lease will expire on its own
            log.info("could not release remote lease %s: %s", remote.request_id, e)
