"""vllm-router as a peer of splitserve's router in ``router_overhead.py``: the ``--peer``
option, the peer's command line, the CPU the run had, and the comparison of the two routers'
added latency (the goal: ours at p99 no worse than vllm-router's on the same workers).

Both routers' added latency is measured against the same direct runs, round by round, so a
ratio of the two cancels what drifts between rounds but not the noise of each p99; the
per-round figures show how large that is.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import NamedTuple

from splitserve.cluster.vllm_router import (
    BINARY,
    VLLM_ROUTER_POLICIES,
    find_vllm_router,
    vllm_router_argv,
    vllm_router_env,
)

DEFAULT_POLICY = "round_robin"
CPU_FLAGS = (
    *("sse4_2", "avx", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"),
    "hypervisor",  # a VM: its vCPUs may share physical cores with other guests
)
OURS = "router"


class Peer(NamedTuple):
    """A vllm-router in front of the benchmark's worker, with ``policy``."""

    policy: str

    @property
    def name(self) -> str:
        return f"{BINARY}:{self.policy}"


def parse_peer(spec: str) -> Peer:
    """``vllm-router`` or ``vllm-router:POLICY`` (an argparse ``type``)."""
    kind, _, policy = spec.partition(":")
    if kind != BINARY:
        raise argparse.ArgumentTypeError(f"unknown peer {kind!r}; known: {BINARY}[:POLICY]")
    policy = policy or DEFAULT_POLICY
    if policy not in VLLM_ROUTER_POLICIES:
        known = ", ".join(VLLM_ROUTER_POLICIES)
        raise argparse.ArgumentTypeError(f"unknown {BINARY} policy {policy!r}; known: {known}")
    return Peer(policy)


def resolve_binary(explicit: str | None) -> str:
    """The vllm-router executable, or a one-line exit saying it is not installed."""
    try:
        return find_vllm_router(explicit)
    except ValueError as e:
        raise SystemExit(f"--peer: {e}") from None


def peer_command(
    binary: str, peer: Peer, port: int, worker_url: str
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of ``peer`` on loopback ``port`` in front of ``worker_url``."""
    argv = vllm_router_argv(binary, "127.0.0.1", port, [worker_url], peer.policy)
    return argv, vllm_router_env(log="error")


def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU model, logical CPU count, hypervisor and the ISA flags that matter here."""
    fields: dict[str, str] = {}
    count = 0
    for line in cpuinfo.read_text().splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        count += key == "processor"
        fields.setdefault(key, value.strip())
    flags = set(fields.get("flags", "").split())
    shown = [f for f in CPU_FLAGS if f in flags]
    model = fields.get("model name", "unknown")
    return f"{model}, {count} logical CPUs; flags: {' '.join(shown) or 'none'}"


# ---- the comparison ----------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if q < 100 else max(xs)


def added_ms(runs: dict, name: str, q: int, field: str, rounds: slice = slice(None)) -> float:
    """``name``'s latency at percentile ``q`` minus direct's, over ``rounds``; ms.
    ``field``: ``total_s`` (end to end) or ``first_s`` (time to first chunk)."""

    def values(path: str) -> list[float]:
        return [getattr(t, field) for r in runs[path][rounds] for t in r.timings]

    return (pct(values(name), q) - pct(values("direct"), q)) * 1e3


def report_peers(runs: dict, peers: list[str], cpu_per_request_s: dict) -> None:
    """Each router's added latency (ours, a baseline, the peers), then ours over each peer's."""
    rps_direct = statistics.mean(r.rps for r in runs["direct"])
    fronts = list(cpu_per_request_s)
    width = max(23, *(len(n) + 2 for n in fronts))
    print(f"\n{'added over direct, ms':<{width}}{'e2e p50':>9}{'e2e p99':>9}", end="")
    print(f"{'first p50':>11}{'first p99':>11}{'req/s ratio':>13}{'CPU/req ms':>12}")
    for name in fronts:
        row = [added_ms(runs, name, q, f) for f in ("total_s", "first_s") for q in (50, 99)]
        ratio = statistics.mean(r.rps for r in runs[name]) / rps_direct
        cpu = cpu_per_request_s[name][0] * 1e3
        print(f"{name:<{width}}{row[0]:>9.2f}{row[1]:>9.2f}{row[2]:>11.2f}{row[3]:>11.2f}", end="")
        print(f"{ratio:>13.3f}{cpu:>12.2f}")
    print("(first: time to the first chunk of the stream; CPU: the router process's)")
    print_rounds(runs, fronts, width)
    for peer in peers:
        print_ratio(runs, peer)


def per_round(runs: dict, name: str) -> list[float]:
    """``name``'s p99 added end to end in each round (against that round's direct run), ms."""
    rounds = range(len(runs[name]))
    return [added_ms(runs, name, 99, "total_s", slice(i, i + 1)) for i in rounds]


def print_rounds(runs: dict, fronts: list[str], width: int) -> None:
    """p99 added end to end, round by round: how noisy the whole-run figure is; then the
    median over the rounds, which one noisy round cannot move."""
    print("p99 added end to end, per round, ms (| median over rounds):")
    for name in fronts:
        rounds = per_round(runs, name)
        figures = " ".join(f"{v:>7.2f}" for v in rounds)
        print(f"  {name:<{width - 2}}{figures}  | {statistics.median(rounds):>7.2f}")


def print_ratio(runs: dict, peer: str) -> None:
    """Our p99 added latency over ``peer``'s (goal: at most 1, i.e. no worse)."""
    for label, field in (("end to end", "total_s"), ("first chunk", "first_s")):
        ours, theirs = added_ms(runs, OURS, 99, field), added_ms(runs, peer, 99, field)
        ratio = f"{ours / theirs:.2f}" if theirs > 0 else "n/a (its added p99 <= 0)"
        verdict = "met" if ours <= theirs else "NOT met"
        print(
            f"p99 added latency, {OURS} / {peer} ({label}): {ratio} "
            f"({ours:.2f} / {theirs:.2f} ms, {ours - theirs:+.2f} ms; goal no worse: {verdict})"
        )
    # Paired by round: both routers met the same machine within seconds of each other.
    diffs = [a - b for a, b in zip(per_round(runs, OURS), per_round(runs, peer), strict=True)]
    median = statistics.median(diffs)
    print(
        f"p99 added end to end, {OURS} - {peer}, round by round: median {median:+.2f} ms; "
        f"{OURS} no worse in {sum(d <= 0 for d in diffs)} of {len(diffs)} rounds "
        f"(goal no worse: {'met' if median <= 0 else 'NOT met'})"
    )
