"""What is simulated: the deployment (worker pools) and the engine and router settings."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.config import check_scheduling_policy
from splitserve.router.config import DEFAULT_REMOTE_PREFILL_THRESHOLD
from splitserve.router.policies import POLICIES, make_policy
from splitserve.router.policies.base import RoutingPolicy
from splitserve.router.ring import DEFAULT_LOAD_FACTOR, DEFAULT_LOAD_FLOOR
from splitserve.sim.cost_model import CostModel
from splitserve.sim.hardware import HardwareProfile
from splitserve.sim.models import ModelProfile


@dataclass(frozen=True, slots=True)
class Deployment:
    """``prefill`` + ``decode`` disaggregated workers and ``collocated`` ones, each on
    ``tp`` GPUs. Collocated workers take both legs, as the router's ``both`` role."""

    prefill: int = 0
    decode: int = 0
    collocated: int = 0
    tp: int = 1

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.collocated) < 0 or self.tp < 1:
            raise ValueError("worker counts must be >= 0 and tp >= 1")
        if self.decode + self.collocated == 0:
            raise ValueError("a deployment needs decode or collocated workers")

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.collocated

    @property
    def gpus(self) -> int:
        return self.workers * self.tp

    def describe(self) -> str:
        parts = []
        if self.prefill or self.decode:
            parts.append(f"{self.prefill}P:{self.decode}D")
        if self.collocated:
            parts.append(f"{self.collocated} collocated")
        return f"{' + '.join(parts)} at TP{self.tp} ({self.gpus} GPUs)"


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The engine and router settings every simulated worker shares."""

    model: ModelProfile
    hardware: HardwareProfile
    dtype: str = "bf16"
    kv_dtype: str | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    kv_cache_gb: float | None = None  # per worker; None: what HBM leaves after the weights
    host_kv_gb: float = 0.0  # per worker: a host-RAM KV tier (0: none), as --host-kv-gb
    disk_kv_gb: float = 0.0  # per worker: a local-disk KV tier below it (0: none)
    policy: str = "session"
    prefill_policy: str = "prefix"
    load_factor: float = DEFAULT_LOAD_FACTOR  # the session policy's bounded loads, as the router
    load_floor: int = DEFAULT_LOAD_FLOOR
    scheduling_policy: str = "fcfs"  # the engine's admission order, as --scheduling-policy
    remote_prefill_threshold: int = DEFAULT_REMOTE_PREFILL_THRESHOLD
    # A turn the session ring moves off its home pulls the home's cached KV of the prompt
    # (router and worker --kv-peer-fetch) instead of recomputing it.
    kv_peer_fetch: bool = False
    # The workers share this many CPU cores (cpu-local: `bench compare`'s one-thread workers
    # on this machine); None: each worker has its own device.
    host_cores: int | None = None
    chat_template: bool = False  # chat-API sessions' prompts carry ChatML's tokens (sim/chat.py)
    exact: bool = False  # every step through the real schedule()/update() (slow; for tests)
    record_itl: bool = False  # every request's inter-token gaps (memory grows with tokens)
    # (url, role) of real workers to name the simulated ones after, in each role's order
    # (a real run's, from bench's ``info["workers"]``): the routers' hash rings are over
    # worker names, so the same names place every session where the real router did.
    # Empty: ``sim://prefill0``, ``sim://decode0``, ...
    worker_urls: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("policy", "prefill_policy"):
            if getattr(self, name) not in POLICIES:
                known = ", ".join(sorted(POLICIES))
                raise ValueError(f"unknown routing policy {getattr(self, name)!r}; use {known}")
        check_scheduling_policy(self.scheduling_policy)
        if self.host_cores is not None and self.host_cores < 1:
            raise ValueError(f"host_cores must be >= 1, got {self.host_cores}")
        if self.kv_peer_fetch and self.policy != "session":
            raise ValueError(
                f"kv_peer_fetch names a session's home worker: it needs policy 'session', "
                f"got {self.policy!r}"
            )
        if self.load_factor < 1.0 or self.load_floor < 1:
            raise ValueError("load_factor and load_floor must be >= 1")
        if self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size and max_num_seqs must be >= 1")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError("max_num_seqs must not exceed max_num_batched_tokens")
        if not (self.host_kv_gb >= 0 and self.disk_kv_gb >= 0):
            raise ValueError("host_kv_gb and disk_kv_gb must be >= 0")

    def routing_policy(self, name: str) -> RoutingPolicy:
        """A router policy by name, with this config's bounded loads for ``session``."""
        if name == "session":
            return make_policy(name, load_factor=self.load_factor, load_floor=self.load_floor)
        return make_policy(name)

    def cost_model(self, tp: int) -> CostModel:
        return CostModel(self.model, self.hardware, tp, self.dtype, self.kv_dtype)

    def kv_blocks(self, cost: CostModel) -> int:
        if self.kv_cache_gb is not None:
            tokens = int(self.kv_cache_gb * 2**30 // (cost.kv_bytes_per_token_gpu * cost.tp))
        else:
            tokens = cost.kv_pool_tokens()
        return max(1, tokens // self.block_size)

    def tier_blocks(self, cost: CostModel) -> list[tuple[str, int]]:
        """The lower KV tiers of one worker, fastest first, as (name, capacity in blocks): a
        block is the KV of ``block_size`` tokens on all of the worker's GPUs, as the real
        tiers count payload bytes."""
        block_bytes = self.block_size * cost.kv_bytes_per_token_gpu * cost.tp
        tiers = (("host", self.host_kv_gb), ("disk", self.disk_kv_gb))
        return [(name, int(gb * 2**30 // block_bytes)) for name, gb in tiers if gb > 0]

    def model_len(self, num_blocks: int) -> int:
        """The engine's rule: the model's context, bounded by the KV pool and the setting."""
        limit = min(self.model.max_context, num_blocks * self.block_size)
        return limit if self.max_model_len is None else min(limit, self.max_model_len)
