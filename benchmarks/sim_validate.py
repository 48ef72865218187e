"""The calibrated simulator against real runs on this machine, same workload.

Two real sides:

- ``--bench-json FILE``: the output of ``splitserve bench compare --json FILE`` (real
  deployments behind the router); each of its runs is simulated with the same deployment
  (``collocated-rr`` -> 2 collocated workers, round-robin; ``disagg-session`` -> 1P:1D,
  session policy; ...), workload and rate.
- otherwise: ``LLMEngine`` (bundled model, one thread) driven in this process with Poisson
  arrivals on the wall clock.

The simulated side runs on ``cpu-local`` (fitted by ``splitserve sim calibrate``) with the
engine's own settings. Both are summarized by ``bench.metrics``; the script prints goodput
and p50 TTFT side by side with their ratio (goal: within 15%).

    .venv/bin/python benchmarks/sim_validate.py --calibration cal.json --rate 0.5 --num 24
    .venv/bin/python benchmarks/sim_validate.py --calibration cal.json --bench-json cmp.json \
        --input-len 128 --output-len 16
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque

from splitserve.bench.metrics import SLO, RequestRecord, summarize
from splitserve.bench.workloads import RandomConfig, SessionSpec
from splitserve.common.sampling_params import SamplingParams
from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.hardware import get_hardware, load_calibration
from splitserve.sim.models import get_model
from splitserve.sim.run import simulate


def real_run(sessions: list[SessionSpec]) -> tuple[list[RequestRecord], float]:
    from splitserve.config import EngineConfig
    from splitserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(threads=1))
    engine.add_request("warmup", list(range(1000, 1032)), SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    pending = deque(sessions)
    records: dict[str, RequestRecord] = {}
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0].arrival_s <= now:
            s = pending.popleft()
            turn = s.turns[0]
            params = SamplingParams(max_tokens=turn.output_len, temperature=0, ignore_eos=True)
            engine.add_request(s.session_id, s.prompt_token_ids(0), params)
            records[s.session_id] = RequestRecord(
                s.session_id, 0, now, prompt_tokens=turn.new_tokens
            )
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0].arrival_s - now))
            continue
        for out in engine.step():
            r = records[out.request_id]
            t = time.perf_counter() - t0
            if r.ttft_s is None:
                r.ttft_s = t - r.start_s
            if out.finished:
                r.ok, r.e2e_s = True, t - r.start_s
                r.output_tokens = len(out.outputs[0].token_ids)
    rs = list(records.values())
    return rs, max(r.end_s for r in rs) - min(r.start_s for r in rs)


# `splitserve bench compare` deployments as (deployment, routing policy) for 2 cores.
BENCH_DEPLOYMENTS = {
    "collocated-rr": (Deployment(collocated=2), "round-robin"),
    "collocated-session": (Deployment(collocated=2), "session"),
    "disagg": (Deployment(prefill=1, decode=1), "round-robin"),
    "disagg-session": (Deployment(prefill=1, decode=1), "session"),
}


def cpu_local(calibration: str, policy: str = "session") -> SimConfig:
    """The engine's defaults (1 GiB KV, 64 sequences, 1024-token budget) on cpu-local."""
    return SimConfig(
        get_model("smollm2-135m"),
        load_calibration(get_hardware("cpu-local"), calibration),
        dtype="fp32",
        kv_cache_gb=1.0,
        max_num_seqs=64,
        max_num_batched_tokens=1024,
        policy=policy,
    )


def print_rows(real, sim) -> None:
    rows = (
        ("goodput (req/s)", real.request_goodput, sim.request_goodput),
        ("p50 TTFT (ms)", real.ttft.median, sim.ttft.median),
        ("p50 TPOT (ms)", real.tpot.median, sim.tpot.median),
        ("p50 E2E (ms)", real.e2e.median, sim.e2e.median),
    )
    print(f"{'':<18}{'real':>10}{'simulated':>12}{'sim/real':>10}")
    for name, a, b in rows:
        print(f"{name:<18}{a:>10.2f}{b:>12.2f}{b / a:>10.2f}")


def against_bench(args, workload, slo: SLO) -> None:
    with open(args.bench_json) as f:
        runs = json.load(f)
    for run in runs:
        dep, policy = BENCH_DEPLOYMENTS[run["deployment"]]
        records = [RequestRecord(**r) for r in run["requests"]]
        real = summarize(records, run["summary"]["duration_s"], slo)
        duration = max(r.start_s for r in records if r.turn == 0) + 1e-9
        cfg = cpu_local(args.calibration, policy)
        sim = simulate(cfg, dep, workload, run["rate"], duration, slo).summary
        print(f"\n{run['deployment']} ({dep.describe()}, {policy}) at {run['rate']:g}/s:")
        print_rows(real, sim)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--num", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--slo", default="ttft:3000,tpot:400")
    ap.add_argument("--bench-json", default=None, help="a `bench compare --json` output")
    args = ap.parse_args()
    slo = SLO.parse(args.slo)
    workload = RandomConfig(args.input_len, args.output_len, seed=0)
    if args.bench_json:
        print(f"{workload.describe()} vs {args.bench_json}, SLO {slo.describe()}")
        against_bench(args, workload, slo)
        return
    sessions = [s for s, _ in zip(workload.sessions(args.rate), range(args.num), strict=False)]
    print(f"{workload.describe()}, {args.rate} req/s, {args.num} requests, SLO {slo.describe()}")
    records, duration = real_run(sessions)
    real = summarize(records, duration, slo)
    cfg = cpu_local(args.calibration)
    duration = sessions[-1].arrival_s + 1e-9  # the same sessions: those arriving before it
    sim = simulate(cfg, Deployment(collocated=1), workload, args.rate, duration, slo).summary
    print_rows(real, sim)


if __name__ == "__main__":
    main()
