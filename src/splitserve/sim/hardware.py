"""Accelerator profiles: peak throughput, memory, links, and how much of the peak one gets.

Peaks are the vendors' datasheet numbers (dense, no sparsity), per GPU. ``link_bw`` is one
GPU's one-direction bandwidth to its peers in the node (NVLink / Infinity Fabric);
``net_bw`` its share of the scale-out network (one 400 Gb/s NIC per GPU = 50 GB/s).
``host_bw`` is one GPU's host link, one direction (PCIe Gen5 x16: 32 GT/s x 16 lanes,
128b/130b = 63 GB/s, quoted as 128 GB/s both directions), over which KV blocks load from
the host-RAM tier; ``disk_bw`` one local NVMe drive's sequential read per GPU (DGX H100 and
B200 carry eight 3.84 TB U.2 NVMe data drives, PCIe Gen4 x4, ~7 GB/s each), over which
they load from the disk tier.

The efficiency factors and the step overhead are not datasheet numbers: for the GPUs they
are the usual published operating points of a tuned serving engine (prefill GEMMs at ~60%
of peak, decode streaming HBM at ~80% of its bandwidth, ~2 ms of scheduling, sampling and
launch per step), stated here so that every prediction names its assumptions. ``cpu-local``
(this machine, the bundled model at one thread) is fitted by ``splitserve sim calibrate``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    name: str
    peak_flops: dict[str, float]  # per dtype: "bf16", "fp8", "fp32"
    hbm_bw: float  # bytes/s
    hbm_bytes: float
    link_bw: float  # bytes/s, one direction, to a peer in the node
    net_bw: float  # bytes/s, one direction, to another node
    gpus_per_node: int = 8
    compute_eff: float = 0.6
    memory_eff: float = 0.8
    step_overhead_s: float = 2e-3
    seq_overhead_s: float = 0.0  # per scheduled sequence (host-side work that grows with batch)
    # Per step of more than one token: on cpu-local the weight products of a multi-row step
    # take the GEMM path (which packs the weights) where a 1-row decode step takes GEMV.
    multi_row_overhead_s: float = 0.0
    # Decode-only steps of at most this many sequences skip that overhead: on cpu-local the
    # engine runs them on its fused path (``models/decode_step.py``), one weight read for
    # all rows (the engine's ``ModelRunner.fused_max_seqs``; 0: no such path).
    fused_decode_max_seqs: int = 0
    # The fused path's arithmetic (weights and attention) as a fraction of the peak: plain
    # compiled loops, one pass over the weights for every row, not the BLAS the peak is
    # measured with (None: as other steps). Its weight read is at memory_eff like any step's.
    fused_compute_eff: float | None = None
    # Attention's share of the compute at its own efficiency (None: compute_eff's). On
    # cpu-local the runner gathers each chunk's context and runs SDPA, far below GEMM speed.
    attention_eff: float | None = None
    link_latency_s: float = 10e-6  # one KV transfer's setup, in the node
    net_latency_s: float = 50e-6
    allreduce_latency_s: float = 8e-6  # one small tensor-parallel all-reduce
    # The router's decode leg after a remote prefill: the prefill's HTTP answer, the second
    # request, the decode worker's pull setup (before any KV moves).
    remote_leg_s: float = 1e-3
    # Peer KV fetch: a worker's lease request to a session's home worker and its answer.
    peer_lease_s: float = 1e-3
    # Workers sharing a host's cores (``SimConfig.host_cores``): how much slower a step runs
    # while one more worker computes on another core (memory bandwidth and caches are shared
    # too); measured by ``sim calibrate --co-run``.
    co_run_slowdown: float = 0.0
    # What a request pays outside the engine's steps before its prefill can start (HTTP,
    # tokenizing, the engine loop's hand-off): added to every TTFT.
    request_overhead_s: float = 0.0
    # Workers sharing a host's cores: the host CPU a request costs outside the engines (HTTP,
    # chat template, tokenizing, the router), and each generated token (streamed through the
    # worker, the router and the client); it competes with the workers for those cores.
    serving_cpu_per_request_s: float = 0.0
    serving_cpu_per_token_s: float = 0.0
    # ... and the CPU a worker's KV mover thread spends on one block saved to or loaded from
    # a lower tier (the bundled model's block size on cpu-local).
    kv_copy_cpu_per_block_s: float = 0.0
    host_bw: float = 64 * GB  # bytes/s, one direction, host RAM <-> one GPU (KV tier loads)
    host_latency_s: float = 10e-6  # one tier load's setup (a copy launch)
    disk_bw: float = 7 * GB  # bytes/s, local disk reads per GPU
    disk_latency_s: float = 100e-6  # an NVMe read's latency
    memory_utilization: float = 0.9  # of HBM the engine may use (weights + KV), as vLLM's
    source: str = ""
    notes: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("hbm_bw", "hbm_bytes", "link_bw", "net_bw", "host_bw", "disk_bw"):
            if getattr(self, name) <= 0:
                raise ValueError(f"hardware {self.name}: {name} must be > 0")
        effs = (
            "compute_eff",
            "memory_eff",
            "memory_utilization",
            "attention_eff",
            "fused_compute_eff",
        )
        for name in effs:
            if getattr(self, name) is not None and not 0 < getattr(self, name) <= 1:
                raise ValueError(f"hardware {self.name}: {name} must be in (0, 1]")
        if self.fused_decode_max_seqs < 0:
            raise ValueError(f"hardware {self.name}: fused_decode_max_seqs must be >= 0")

    def flops(self, dtype: str) -> float:
        try:
            return self.peak_flops[dtype]
        except KeyError:
            known = ", ".join(sorted(self.peak_flops))
            raise ValueError(f"{self.name} has no {dtype} peak; it has {known}") from None

    def with_fit(self, **values: float | None) -> HardwareProfile:
        """This profile with fitted efficiency factors / overhead (from ``sim calibrate``)."""
        return dataclasses.replace(self, **values)

    def with_peaks(self, peaks: tuple[float, float] | None) -> HardwareProfile:
        """This profile with a measured fp32 peak and memory bandwidth (None: as it is)."""
        if peaks is None:
            return self
        flops, mem_bw = peaks
        return dataclasses.replace(
            self, peak_flops={**self.peak_flops, "fp32": flops}, hbm_bw=mem_bw
        )

    def steps_scaled(self, scale: float) -> HardwareProfile:
        """This profile with every engine step ``scale`` times as long: peaks divided,
        per-step overheads multiplied (links, tiers and serving work unchanged). A machine a
        few percent faster or slower than its calibration (``sim_validate.py --jitter``)."""
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        return dataclasses.replace(
            self,
            peak_flops={k: v / scale for k, v in self.peak_flops.items()},
            hbm_bw=self.hbm_bw / scale,
            step_overhead_s=self.step_overhead_s * scale,
            seq_overhead_s=self.seq_overhead_s * scale,
            multi_row_overhead_s=self.multi_row_overhead_s * scale,
        )


HARDWARE: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile(
            name="h100",
            peak_flops={"bf16": 989 * TFLOPS, "fp8": 1979 * TFLOPS},
            hbm_bw=3350 * GB,
            hbm_bytes=80 * GB,
            link_bw=450 * GB,
            net_bw=50 * GB,
            source="NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s BF16 and 1979 "
            "TFLOP/s FP8 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (both directions); "
            "ConnectX-7 400 Gb/s per GPU in DGX H100; PCIe Gen5 x16 to the host (128 GB/s both "
            "directions); DGX H100: 8 x 3.84 TB U.2 NVMe data drives",
        ),
        HardwareProfile(
            name="h200",
            peak_flops={"bf16": 989 * TFLOPS, "fp8": 1979 * TFLOPS},
            hbm_bw=4800 * GB,
            hbm_bytes=141 * GB,
            link_bw=450 * GB,
            net_bw=50 * GB,
            source="NVIDIA H200 Tensor Core GPU datasheet (SXM): H100's compute, 141 GB "
            "HBM3e at 4.8 TB/s, NVLink 900 GB/s; 400 Gb/s NIC per GPU in HGX H200; PCIe Gen5 "
            "x16 to the host (128 GB/s both directions)",
        ),
        HardwareProfile(
            name="mi300x",
            peak_flops={"bf16": 1307.4 * TFLOPS, "fp8": 2614.9 * TFLOPS},
            hbm_bw=5300 * GB,
            hbm_bytes=192 * GB,
            link_bw=448 * GB,
            net_bw=50 * GB,
            source="AMD Instinct MI300X datasheet: 1307.4 TFLOP/s BF16 and 2614.9 TFLOP/s FP8 "
            "dense, 192 GB HBM3 at 5.3 TB/s, 7 Infinity Fabric links of 64 GB/s per "
            "direction (448 GB/s); 400 Gb/s NIC per GPU in an 8-GPU platform; PCIe Gen5 x16 "
            "host interface (128 GB/s both directions)",
        ),
        HardwareProfile(
            name="b200",
            peak_flops={"bf16": 2250 * TFLOPS, "fp8": 4500 * TFLOPS},
            hbm_bw=8000 * GB,
            hbm_bytes=180 * GB,
            link_bw=900 * GB,
            net_bw=50 * GB,
            source="NVIDIA DGX B200 datasheet: 72 PFLOP/s FP8 training (sparse) over 8 GPUs = "
            "4.5 PFLOP/s FP8 and 2.25 PFLOP/s BF16 dense per GPU, 1,440 GB HBM3e (180 GB per "
            "GPU) at 64 TB/s (8 TB/s per GPU), NVLink 5 at 1.8 TB/s (both directions); PCIe "
            "Gen5 x16 to the host per GPU; 8 x 3.84 TB U.2 NVMe data drives",
        ),
        # This machine, one engine thread, float32. Peaks are what a 1-thread float32 matmul
        # and a large read-only sum reach here (`splitserve sim calibrate` measures both);
        # efficiency and overhead are fitted by `splitserve sim calibrate` (docs/simulator.md).
        HardwareProfile(
            name="cpu-local",
            peak_flops={"fp32": 92 * 1e9},
            hbm_bw=22.0 * GB,
            hbm_bytes=24 * GB,
            link_bw=1.0 * GB,
            net_bw=1.0 * GB,
            gpus_per_node=64,
            # `splitserve sim calibrate --repeats 5` on a quiet machine, every decode-only step
            # on the engine's C++ decode step: rms error 3.3%, max 8.0% over its 13 step shapes
            # (the run is tabled in docs/journal/2026-12-07.md; docs/simulator.md).
            compute_eff=0.96,
            memory_eff=0.91,
            attention_eff=0.41,
            fused_compute_eff=1.0,
            step_overhead_s=0.0,
            seq_overhead_s=2.4e-3,
            multi_row_overhead_s=25.5e-3,
            fused_decode_max_seqs=1024,
            link_latency_s=2e-3,
            net_latency_s=2e-3,
            allreduce_latency_s=0.0,
            # The second HTTP leg alone: benchmarks/disagg_latency.py's two-leg TTFT less the
            # prefill worker's prefill, the pull and the decode worker's step over the last
            # block (docs/benchmarks.md, quiet machine: 16 tokens 283 - 2 x 128 ms = 27 ms;
            # 256 tokens 1,003 - 852 - ~128 - 9 ms = ~14 ms). The simulator runs that last
            # step itself; 0.13 s (until 2026-12-02) counted it twice.
            remote_leg_s=0.025,
            # POST /v1/kv/lease to an idle worker on loopback: 1.8 ms median of 30 (1.3 min).
            peer_lease_s=2e-3,
            # The KV mover's host-RAM load, idle engine: 128 blocks of 720 KiB (2,048 tokens)
            # in 28-29 ms (benchmarks/kv_tier_overlap.py, docs/benchmarks.md) = 3.3 GB/s.
            host_bw=3.3 * GB,
            host_latency_s=1e-3,
            # DiskTier.load on a quiet machine: 42-45% of a 2.0-2.3 GB/s raw read
            # (benchmarks/kv_tiers.py, docs/benchmarks.md), then the host copy above.
            disk_bw=0.9 * GB,
            disk_latency_s=1e-3,
            memory_utilization=1.0,
            source="measured on the development machine (2-core VM, no GPU): float32 matmul "
            "at one thread and memory copy bandwidth; KV transfer over loopback TCP from "
            "benchmarks/kv_transfer.py; KV tier loads from benchmarks/kv_tier_overlap.py and "
            "benchmarks/kv_tiers.py; fitted factors from `splitserve sim calibrate`",
        ),
    )
}


def get_hardware(name: str) -> HardwareProfile:
    try:
        return HARDWARE[name]
    except KeyError:
        known = ", ".join(sorted(HARDWARE))
        raise ValueError(f"unknown hardware {name!r}; choose from {known}") from None


def _count(value: object, path: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"calibration file {path}: fused_decode_max_seqs must be an integer >= 0")
    return value


def fitted_peaks(fit: dict) -> tuple[float, float] | None:
    """The machine's (fp32 FLOP/s, memory bytes/s) a calibration's fit was made against, as
    ``sim calibrate`` measures and stores them (None: a file from before they were measured,
    fitted against the profile's nominal ones)."""
    flops, mem_bw = fit.get("peak_flops_fp32"), fit.get("mem_bw")
    if isinstance(flops, int | float) and isinstance(mem_bw, int | float):
        if flops > 0 and mem_bw > 0:
            return float(flops), float(mem_bw)
    return None


def load_calibration(hw: HardwareProfile, path: str) -> HardwareProfile:
    """``hw`` with the efficiency factors and overhead a ``sim calibrate --out`` file holds."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read calibration file {path}: {e}") from e
    fit = data.get("fit") if isinstance(data, dict) else None
    keys = ("compute_eff", "memory_eff", "step_overhead_s", "seq_overhead_s")
    if not isinstance(fit, dict) or not all(isinstance(fit.get(k), int | float) for k in keys):
        raise ValueError(f"calibration file {path} has no fit with {', '.join(keys)}")
    values: dict[str, float | None] = {k: float(fit[k]) for k in keys}
    # A file fitted before the multi-row term existed was fitted without it.
    values["multi_row_overhead_s"] = float(fit.get("multi_row_overhead_s", 0.0))
    # ... and a file fitted before the engine's fused decode path existed timed the torch path.
    values["fused_decode_max_seqs"] = _count(fit.get("fused_decode_max_seqs", 0), path)
    for key in ("attention_eff", "fused_compute_eff"):  # absent from older files: as compute
        value = fit.get(key)
        values[key] = float(value) if isinstance(value, int | float) else None
    if isinstance(fit.get("host_bw"), int | float) and fit["host_bw"] > 0:
        values["host_bw"] = float(fit["host_bw"])  # measured host-tier loads (newer files)
    if isinstance(fit.get("request_overhead_s"), int | float) and fit["request_overhead_s"] >= 0:
        values["request_overhead_s"] = float(fit["request_overhead_s"])
    if isinstance(fit.get("co_run_slowdown"), int | float):  # sim calibrate --co-run
        values["co_run_slowdown"] = max(0.0, float(fit["co_run_slowdown"]))
    serving = ("serving_cpu_per_request_s", "serving_cpu_per_token_s", "kv_copy_cpu_per_block_s")
    for key in serving:  # benchmarks/serving_cpu.py
        if isinstance(fit.get(key), int | float) and fit[key] >= 0:
            values[key] = float(fit[key])
    return hw.with_peaks(fitted_peaks(fit)).with_fit(**values)
