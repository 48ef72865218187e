"""What one engine step, one KV transfer and one worker's KV pool cost on given hardware.

A step is a batch of chunks; chunk ``i`` computes ``n_i`` tokens at positions
``s_i .. s_i + n_i - 1`` and so attends over contexts ``s_i + 1 .. s_i + n_i``::

    tokens      T = sum n_i                     (each multiplies through the active weights)
    sampled     S = chunks that end their sequence's last token   (the LM head runs on them)
    attention   A = sum (n_i * s_i + n_i (n_i + 1) / 2)   (context positions attended)
    KV read     R = sum (s_i + n_i)             (every chunk reads its whole context's KV)

    compute  = (2 P T + 2 V h S) / (tp * peak * compute_eff) + 4 L H d A / (tp * peak * attn_eff)
    memory   = (weights(T) + kv * (R + T)) / (bw * memory_eff)   [per GPU: weights / tp]
    step     = max(compute, memory) + overhead + per_seq * chunks + multi_row [multi-row]
               + all-reduces(T)

``attn_eff`` is ``compute_eff`` unless the profile sets its own (``cpu-local``).
``multi_row`` is a fixed cost of steps of more than one token (0 on the GPU profiles; on
``cpu-local`` the weight products leave GEMV for a GEMM that packs the weights), except
decode-only steps of at most ``fused_decode_max_seqs`` sequences (``T = chunks``), which the
engine runs on its fused path (one weight read for all rows, no GEMM). Their compute,
weights and attention alike, is at ``fused_compute_eff`` when the profile sets it: the fused
kernel's own loops, not BLAS.

``P`` is the per-token active parameters without embeddings, ``V h`` the LM head. An MoE
layer reads only the experts its tokens picked: ``E (1 - (1 - k/E)^T)`` of them on average
with uniform routing. Tensor parallelism splits FLOPs, weights and KV heads (a KV head is
replicated when ``tp`` exceeds their number) and adds two all-reduces per layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.sim.hardware import HardwareProfile
from splitserve.sim.models import DTYPE_BYTES, ModelProfile

ACTIVATION_BYTES = 2  # all-reduce payloads travel in 16-bit


@dataclass(slots=True)
class StepShape:
    """One step's work, made at every step (the compiled build writes its ``__init__`` out:
    ``benchmarks/sim_compile.py``)."""

    tokens: int
    sampled: int
    attended: float
    kv_read: int
    chunks: int


class CostModel:
    """Roofline step times for one worker: ``model`` on ``tp`` GPUs of ``hardware``."""

    def __init__(
        self,
        model: ModelProfile,
        hardware: HardwareProfile,
        tp: int = 1,
        dtype: str = "bf16",
        kv_dtype: str | None = None,
    ) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        for d in (dtype, kv_dtype or dtype):
            if d not in DTYPE_BYTES:
                raise ValueError(f"unknown dtype {d!r}; choose from {', '.join(DTYPE_BYTES)}")
        self.model, self.hw, self.tp = model, hardware, tp
        self.dtype, self.kv_dtype = dtype, kv_dtype or dtype
        self.seq_overhead_s = hardware.seq_overhead_s
        wb = DTYPE_BYTES[dtype]
        flops = tp * hardware.flops(dtype) * hardware.compute_eff
        bw = hardware.hbm_bw * hardware.memory_eff
        m = model
        # Seconds per unit of each term, per GPU.
        self._t_token = 2 * m.layers * (m.attention_params + m.active_mlp_params) / flops
        self._t_sampled = 2 * m.vocab * m.hidden / flops
        attention_eff = hardware.attention_eff or hardware.compute_eff
        attention_flops = tp * hardware.flops(dtype) * attention_eff
        self._t_attended = 4 * m.layers * m.heads * m.head_dim / attention_flops
        # The fused decode path's compute: the same terms at its own efficiency.
        self._t_token_fused = self._t_token
        self._t_sampled_fused = self._t_sampled
        self._t_attended_fused = self._t_attended
        if hardware.fused_compute_eff is not None:
            fused_flops = tp * hardware.flops(dtype) * hardware.fused_compute_eff
            self._t_token_fused *= flops / fused_flops
            self._t_sampled_fused *= flops / fused_flops
            self._t_attended_fused *= attention_flops / fused_flops
        kv_heads_per_gpu = math.ceil(m.kv_heads / tp)
        self.kv_bytes_per_token_gpu = (
            m.kv_bytes_per_token(self.kv_dtype) * kv_heads_per_gpu // m.kv_heads
        )
        self._t_kv = self.kv_bytes_per_token_gpu / bw
        dense = m.layers * m.attention_params + m.vocab * m.hidden
        if not m.is_moe:
            dense += m.layers * m.mlp_params
        else:
            dense += m.layers * m.hidden * m.experts  # routers
        self._t_dense_weights = dense * wb / tp / bw
        self._t_expert_layer = m.expert_params * wb / tp / bw * m.layers
        self.weight_bytes_gpu = m.total_params * wb / tp
        self._overhead = hardware.step_overhead_s
        self._multi_row = hardware.multi_row_overhead_s
        self._fused_max = hardware.fused_decode_max_seqs
        if tp > 1:
            per_token = 2 * (tp - 1) / tp * m.hidden * ACTIVATION_BYTES / hardware.link_bw
            self._t_comm0 = 2 * m.layers * hardware.allreduce_latency_s
            self._t_comm_token = 2 * m.layers * per_token
        else:
            self._t_comm0 = self._t_comm_token = 0.0

    # ---- steps ---------------------------------------------------------------------------

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts per layer that ``tokens`` tokens pick (uniform routing)."""
        m = self.model
        return m.experts * (1.0 - (1.0 - m.experts_per_token / m.experts) ** tokens)

    def weight_time(self, tokens: int) -> float:
        t = self._t_dense_weights
        if self.model.is_moe:
            t += self._t_expert_layer * self.experts_touched(tokens)
        return t

    def compute_time(self, shape: StepShape) -> float:
        if self.fused(shape.tokens, shape.chunks):
            return (
                self._t_token_fused * shape.tokens
                + self._t_sampled_fused * shape.sampled
                + self._t_attended_fused * shape.attended
            )
        return (
            self._t_token * shape.tokens
            + self._t_sampled * shape.sampled
            + self._t_attended * shape.attended
        )

    def memory_time(self, shape: StepShape) -> float:
        return self.weight_time(shape.tokens) + self._t_kv * (shape.kv_read + shape.tokens)

    def fused(self, tokens: int, chunks: int) -> bool:
        """Whether a step runs on the fused decode path: decode-only (one token per chunk)
        and small enough."""
        return tokens == chunks and 0 < chunks <= self._fused_max

    def multi_row(self, tokens: int, chunks: int) -> bool:
        """Whether a step pays the multi-row overhead: more than one token, and not a
        decode-only step small enough for the fused path."""
        return tokens > 1 and not self.fused(tokens, chunks)

    def fixed_time(self, tokens: int, chunks: int) -> float:
        """What no roofline covers: per-step overhead, per-sequence overhead, the multi-row
        step's overhead, all-reduces."""
        comm = self._t_comm0 + self._t_comm_token * tokens if tokens else 0.0
        multi_row = self._multi_row if self.multi_row(tokens, chunks) else 0.0
        return self._overhead + self.seq_overhead_s * chunks + comm + multi_row

    def step_time(self, shape: StepShape) -> float:
        if shape.tokens == 0:
            return 0.0
        roof = max(self.compute_time(shape), self.memory_time(shape))
        return roof + self.fixed_time(shape.tokens, shape.chunks)

    def decode_line(self, batch: int, context_sum: int) -> DecodeLine:
        """Step times of ``batch`` decoding sequences whose contexts (after this step's token)
        sum to ``context_sum``: each later step adds ``batch`` to that sum."""
        if self.fused(batch, batch):
            t_token = self._t_token_fused + self._t_sampled_fused
            t_attended = self._t_attended_fused
        else:
            t_token, t_attended = self._t_token + self._t_sampled, self._t_attended
        c0 = t_token * batch + t_attended * context_sum
        m0 = self.weight_time(batch) + self._t_kv * (context_sum + batch)
        return DecodeLine(
            c0=c0,
            c1=t_attended * batch,
            m0=m0,
            m1=self._t_kv * batch,
            fixed=self.fixed_time(batch, batch),
        )

    # ---- KV ------------------------------------------------------------------------------

    def kv_pool_tokens(self) -> int:
        """Tokens of KV one worker holds: HBM the engine may use, less the weights."""
        free = self.hw.hbm_bytes * self.hw.memory_utilization - self.weight_bytes_gpu
        if free <= 0:
            raise ValueError(
                f"{self.model.name} ({self.dtype}) does not fit on {self.tp} x {self.hw.name}: "
                f"{self.weight_bytes_gpu / 1e9:.1f} GB of weights per GPU"
            )
        return int(free // self.kv_bytes_per_token_gpu)

    def transfer_time(self, num_tokens: int, same_node: bool) -> float:
        """Moving ``num_tokens`` tokens of KV between two workers of this shape: every GPU of
        the sender ships its own shard to its peer, in parallel."""
        if num_tokens <= 0:
            return 0.0
        hw = self.hw
        bw, latency = (
            (hw.link_bw, hw.link_latency_s) if same_node else (hw.net_bw, hw.net_latency_s)
        )
        return latency + num_tokens * self.kv_bytes_per_token_gpu / bw

    def tier_load_time(self, host_tokens: int, disk_tokens: int) -> float:
        """Loading KV from this worker's lower tiers into its pool: each GPU reads its own
        shard, the tokens found in host RAM over its host link, those only on disk from its
        drive and then over the host link (the disk tier's latency when any is on disk)."""
        if host_tokens + disk_tokens <= 0:
            return 0.0
        hw, kv = self.hw, self.kv_bytes_per_token_gpu
        latency = hw.disk_latency_s if disk_tokens else hw.host_latency_s
        host = (host_tokens + disk_tokens) * kv / hw.host_bw
        return latency + host + disk_tokens * kv / hw.disk_bw


@dataclass(slots=True)
class DecodeLine:
    """Step ``k`` (from 0) of a run of pure decode steps costs
    ``max(c0 + c1 k, m0 + m1 k) + fixed``; sums and inverses in closed form."""

    c0: float
    c1: float
    m0: float
    m1: float
    fixed: float

    def step(self, k: int) -> float:
        return max(self.c0 + self.c1 * k, self.m0 + self.m1 * k) + self.fixed

    def total(self, k: int) -> float:
        """Time of the first ``k`` steps."""
        if k <= 0:
            return 0.0
        cross = self._crossover()
        if cross is None or cross >= k:
            a, b = self._dominant(k - 1 if cross is None else 0)
            return _series(a, b, 0, k) + self.fixed * k
        lo_a, lo_b = self._dominant(0)
        hi_a, hi_b = self._dominant(k - 1)
        return _series(lo_a, lo_b, 0, cross) + _series(hi_a, hi_b, cross, k) + self.fixed * k

    def steps_within(self, elapsed: float, limit: int) -> int:
        """How many whole steps (at most ``limit``) fit in ``elapsed`` seconds."""
        return largest_within(limit, lambda k: self.total(k) <= elapsed)

    def _crossover(self) -> int | None:
        """First step index (>= 1) at which the other line takes over; None when one line
        dominates every step."""
        dc, dm = self.c1 - self.m1, self.c0 - self.m0
        if dc == 0:
            return None
        x = -dm / dc
        if x <= 0:
            return None
        return math.ceil(x)

    def _dominant(self, k: int) -> tuple[float, float]:
        if self.c0 + self.c1 * k >= self.m0 + self.m1 * k:
            return self.c0, self.c1
        return self.m0, self.m1


def largest_within(limit: int, fits: Callable[[int], bool]) -> int:
    """The largest ``k`` in ``0..limit`` with ``fits(k)``, for ``fits`` true at 0 and
    monotone (true up to some point, false after): a binary search."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _series(a: float, b: float, lo: int, hi: int) -> float:
    """sum_{k=lo}^{hi-1} (a + b k)."""
    n = hi - lo
    return a * n + b * (lo + hi - 1) * n / 2
