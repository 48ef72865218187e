"""Issue 24's 1.3x question at K cores: can any splitserve placement or split beat the best
`vllm-router` policy by 1.3x in session goodput on `make bench-vllm`'s agentic workload?

For each core count K (one one-core worker per core, as the `vllm-*` deployments run), at the
rate where consistent hashing (vllm-router's best policy in the measured runs) keeps fewer than
90% of sessions within their SLO, simulate the routers vLLM users have and splitserve's options,
and print session goodput and the ratio of splitserve's best to the users' best.

    .venv/bin/python benchmarks/sim_vllm_goal.py --cores 2,4,8,16 --markdown out.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

WORKLOAD = (
    "--workload agentic --agent-types 4 --system-tokens 256 --task-tokens 32 --tool-calls 2,4 "
    "--tool-call-tokens 8 --answer-tokens 16 --tool-result-tokens 48,0.5 --tool-pause 1.0,0.6 "
    "--slo ttft:1000,tpot:250 --session-slo jct:20000"
).split()
HARDWARE = "--hardware cpu-local --model smollm2-135m --dtype fp32".split()

# What a vLLM user deploys (vllm-router's policies, as the simulator's nearest policy).
USERS = {
    "round_robin": ["--policy", "round-robin"],
    "least-loaded": ["--policy", "least-loaded"],
    "cache_aware (prefix)": ["--policy", "prefix"],
    "consistent_hash": ["--policy", "session", "--load-factor", "100"],
}
# splitserve's placements over the same collocated workers.
OURS = {
    "session c=1.25": ["--policy", "session"],
    "session c=2": ["--policy", "session", "--load-factor", "2"],
    "kv-events c=100": ["--policy", "kv-events", "--load-factor", "100"],
}


def simulate(cores: int, rate: float, deployment: list[str], args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "splitserve.cli", "sim", *WORKLOAD, *HARDWARE]
        cmd += ["--duration", str(args.duration), "--drain", "60", "--seed", str(args.seed)]
        cmd += ["--host-cores", str(cores), "--rate", f"{rate:g}", "--no-progress"]
        cmd += [*deployment, "--json", out.name]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())[0]["summary"]


def collocated(cores: int, policy: list[str]) -> list[str]:
    return ["--collocated", str(cores), *policy]


def threshold_rate(cores: int, args) -> float:
    """The lowest rate, in steps of 0.1 sessions/s per core, at which consistent hashing
    keeps fewer than 90% of sessions within their SLO."""
    rate = 0.1 * cores
    while rate < 2.0 * cores:
        s = simulate(cores, rate, collocated(cores, USERS["consistent_hash"]), args)
        if s["session_attainment"] < 0.9:
            return rate
        rate += 0.1 * cores
    return rate


def run(cores: int, args) -> list[tuple[str, str, float, float]]:
    rate = threshold_rate(cores, args)
    rows = []
    for side, options in (("users", USERS), ("splitserve", OURS)):
        for name, policy in options.items():
            s = simulate(cores, rate, collocated(cores, policy), args)
            rows.append((side, name, *_goodput(s)))
    for prefill in sorted({max(1, cores // 4), max(1, 3 * cores // 8), cores // 2}):
        if prefill >= cores:
            continue
        split = ["--prefill", str(prefill), "--decode", str(cores - prefill)]
        s = simulate(cores, rate, [*split, *USERS["consistent_hash"]], args)
        rows.append(("splitserve", f"P/D {prefill}:{cores - prefill}", *_goodput(s)))
    return [(f"{cores}, {rate:.1f}/s", *row) for row in rows]


def _goodput(s: dict) -> tuple[float, float]:
    return s["session_goodput"], s["session_attainment"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cores", default="2,4,8,16")
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    lines = [
        "| K, rate | side | deployment | session goodput /s | session SLO att. % |",
        "|---|---|---|---:|---:|",
    ]
    verdicts = []
    for cores in (int(c) for c in args.cores.split(",")):
        rows = run(cores, args)
        for where, side, name, goodput, attained in rows:
            lines.append(f"| {where} | {side} | {name} | {goodput:.2f} | {100 * attained:.0f} |")
        best = {
            side: max(g for _, s, _, g, _ in rows if s == side) for side in ("users", "splitserve")
        }
        ratio = best["splitserve"] / best["users"] if best["users"] else float("inf")
        verdicts.append(f"K={cores}: splitserve's best / users' best = {ratio:.2f}x")
        print("\n".join(lines[-len(rows) :]), flush=True)
        print(verdicts[-1], flush=True)
    text = "\n".join(lines + [""] + verdicts) + "\n"
    if args.markdown:
        Path(args.markdown).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
