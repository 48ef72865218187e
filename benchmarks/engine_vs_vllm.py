"""The built-in engine against the engines a user would otherwise run, on the same cores.

Every deployment runs alone on the machine, one after the other, through the same
``splitserve bench`` workloads (same seeds, so the same requests):

- ``builtin-single``: ``splitserve serve`` with its defaults (one worker on every core);
- ``vllm-single``: vLLM (``.venv-vllm``, ``make install-vllm``) with its own defaults, one
  engine thread with the other cores left to its API server;
- ``vllm-single-all``: the same vLLM bound to every core;
- ``vllm-single-all-fp32``: that, with ``--dtype float32``: on a CPU without native bfloat16
  (no AMX, no AVX-512 BF16) vLLM's default bfloat16 falls back from oneDNN and a user there
  runs float32, as ``--dtype auto`` does here; listed by default only on such a CPU;
- ``builtin-single-fp32``: ``builtin-single`` with ``--dtype float32`` (on request: where
  ``auto`` picks bfloat16, how float32 would serve);
- ``llamacpp-single``: llama.cpp's server (``.venv-llamacpp``, ``make install-llamacpp``)
  on the same GGUF, every core.

Workloads: random 256 in / 64 out at concurrency 1, 16 and 64 (output tokens/s), and the
agentic workload of ``make bench-agentic`` at four rates (session goodput). A peer that is
not installed, or does not start, is reported with the reason and skipped. The table gives
each figure and splitserve's ratio to it.

``--repeats N`` runs each workload's deployments N times over, the order reversed every other
time (A B, B A, A B, ...), so that a host whose speed drifts weighs on both sides alike. A
cell then gives the mean with the range, and a ratio is the mean of the repeats' ratios (each
repeat's pair ran next to each other) with their range.

    python benchmarks/engine_vs_vllm.py [--duration 60] [--cores 2] [--only D1,D2] [--workloads 0,1]
        [--repeats 3]
    make bench-peers
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from router_peer import cpu_description

from splitserve.models.loader import cpu_has_native_bf16

OURS = "builtin-single"
PEERS = ("vllm-single", "vllm-single-all", "llamacpp-single")
FP32_PEER = "vllm-single-all-fp32"
# A peer that is another deployment with more `splitserve serve` arguments.
FP32 = ["--serve-arg=--dtype", "--serve-arg=float32"]
VARIANTS = {FP32_PEER: ("vllm-single-all", FP32), f"{OURS}-fp32": (OURS, FP32)}
RANDOM = ["--workload", "random", "--input-len", "256", "--output-len", "64"]
RANDOM_SLO = ["--slo", "ttft:2000,tpot:250"]
AGENTIC = [
    *("--workload", "agentic", "--agent-types", "4", "--system-tokens", "256"),
    *("--task-tokens", "32", "--tool-calls", "2,4", "--tool-call-tokens", "8"),
    *("--answer-tokens", "16", "--tool-result-tokens", "48,0.5", "--tool-pause", "1.0,0.6"),
    *("--slo", "ttft:1000,tpot:250", "--session-slo", "jct:20000"),
]


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    args: list[str]
    metric: str  # the Summary field the table compares
    unit: str


WORKLOADS = (
    Workload("random 256/64, 1 client", [*RANDOM, "--concurrency", "1", *RANDOM_SLO],
             "output_throughput", "output tok/s"),
    Workload("random 256/64, 16 clients", [*RANDOM, "--concurrency", "16", *RANDOM_SLO],
             "output_throughput", "output tok/s"),
    Workload("random 256/64, 64 clients", [*RANDOM, "--concurrency", "64", *RANDOM_SLO],
             "output_throughput", "output tok/s"),
    Workload("agentic, 0.5 sessions/s", [*AGENTIC, "--rate", "0.5"],
             "session_goodput", "sessions/s in SLO"),
    Workload("agentic, 1.0 sessions/s", [*AGENTIC, "--rate", "1.0"],
             "session_goodput", "sessions/s in SLO"),
    Workload("agentic, 2.0 sessions/s", [*AGENTIC, "--rate", "2.0"],
             "session_goodput", "sessions/s in SLO"),
    Workload("agentic, 4.0 sessions/s", [*AGENTIC, "--rate", "4.0"],
             "session_goodput", "sessions/s in SLO"),
)  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per run")
    p.add_argument("--drain", type=float, default=60.0, help="seconds to let sessions finish")
    p.add_argument("--only", default=None, help="comma-separated deployments (default: all)")
    p.add_argument("--workloads", default=None, help="comma-separated indexes into WORKLOADS")
    p.add_argument("--out", default="benchmarks/out/peers", help="per-run JSON and the table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="runs per deployment and workload")
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def unavailable(deployment: str) -> str | None:
    """Why ``deployment`` cannot start here, or None."""
    try:
        if deployment.startswith("vllm"):
            from splitserve.cluster.vllm_worker import check_has_vllm, find_vllm_python

            check_has_vllm(find_vllm_python())
        elif deployment.startswith("llamacpp"):
            from splitserve.cluster.llamacpp import INSTALL_HINT, find_llamacpp_python

            python = find_llamacpp_python()
            probe = [python, "-c", "import llama_cpp.server.app"]
            done = subprocess.run(probe, capture_output=True, text=True)
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                return f"{python} cannot import llama_cpp.server ({last}); {INSTALL_HINT}"
    except ValueError as e:
        return str(e)
    return None


def run_one(
    args, deployment: str, workload: Workload, index: int, out: Path, repeat: int = 0
) -> dict | None:
    """One ``bench compare`` run of ``deployment`` alone; its summary, or None (reported)."""
    path = out / f"{deployment}-w{index}{f'-r{repeat}' if repeat else ''}.json"
    base, extra = VARIANTS.get(deployment, (deployment, []))
    argv = [sys.executable, "-m", "splitserve.cli", "bench", "compare"]
    argv += ["--deployments", base, *extra, "--cores", str(args.cores), *workload.args]
    argv += ["--duration", str(args.duration), "--drain", str(args.drain)]
    argv += ["--seed", str(args.seed), "--json", str(path), "--no-progress"]
    print(f"== {deployment}, {workload.name}: {' '.join(argv[3:])}", flush=True)
    if subprocess.run(argv).returncode != 0 or not path.is_file():
        print(f"!! {deployment} failed on {workload.name} (its output is above)", flush=True)
        return None
    return json.loads(path.read_text())[0]["summary"]


def schedule(deployments: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, deployment) in the order they run: the order reversed every other repeat."""
    return [
        (k, d) for k in range(repeats) for d in (deployments if k % 2 == 0 else deployments[::-1])
    ]


def table(results: dict, deployments: list[str], workloads: list[tuple[int, Workload]]) -> str:
    """``results[(deployment, workload index)]``: the figure of each repeat (None: failed)."""
    peers = [d for d in deployments if d != OURS]
    head = ["workload", "unit", *deployments, *(f"{OURS} / {p}" for p in peers)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, w in workloads:
        values = {d: results.get((d, i), []) for d in deployments}
        cells = [w.name, w.unit, *(_spread(values[d], "{:.3g}") for d in deployments)]
        for p in peers:
            pairs = zip(values[OURS] if OURS in values else [], values[p], strict=False)
            ratios = [ours / theirs for ours, theirs in pairs if ours is not None and theirs]
            cells.append(_spread(ratios, "{:.2f}x"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _spread(values: list[float | None], fmt: str) -> str:
    """The mean, and the range where there are several figures: '1.05x (0.98-1.12x)'."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = fmt.format(sum(values) / len(values))
    if len(values) == 1:
        return mean
    return f"{mean} ({fmt.format(min(values)).rstrip('x')}-{fmt.format(max(values))})"


def main() -> int:
    args = parse_args()
    if args.only:
        deployments = args.only.split(",")
    else:
        fp32 = [] if cpu_has_native_bf16() else [FP32_PEER]
        deployments = [OURS, *PEERS[:2], *fp32, *PEERS[2:]]
    picked = [int(i) for i in args.workloads.split(",")] if args.workloads else None
    workloads = [(i, w) for i, w in enumerate(WORKLOADS) if picked is None or i in picked]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_description()}; {args.cores} cores per deployment", flush=True)
    skipped = {d: why for d in deployments if (why := unavailable(d))}
    for d, why in skipped.items():
        print(f"-- {d} skipped: {why}", flush=True)
    running = [d for d in deployments if d not in skipped]
    results: dict[tuple[str, int], list[float | None]] = {}
    for i, w in workloads:
        for k, d in schedule(running, args.repeats):
            summary = run_one(args, d, w, i, out, k)
            value = None if summary is None else summary[w.metric]
            results.setdefault((d, i), [None] * args.repeats)[k] = value
    text = table(results, deployments, workloads)
    notes = [f"- {d}: skipped, {why}" for d, why in skipped.items()]
    report = "\n".join([f"CPU: {cpu_description()}", "", text, "", *notes]).rstrip() + "\n"
    (out / "table.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
