"""The calibrated simulator against real runs on this machine, same workload.

Two real sides:

- ``--bench-json FILE``: the output of ``splitserve bench compare --json FILE`` (real
  deployments behind the router); each of its runs is simulated with the same deployment,
  read from the `splitserve serve` command line the run stores (``--prefill 0 --decode 2``
  -> 2 collocated workers; ``--policy``; ``--kv-cache-gb`` and other `--serve-arg` s;
  ``--host-kv-gb`` -> a host-RAM KV tier per worker), the same workload (give the bench
  command's workload options and ``--seed``; each load i of a sweep replays seed + i, as
  `bench compare` does) and rate.
- otherwise: ``LLMEngine`` (bundled model, one thread) driven in this process with Poisson
  arrivals on the wall clock.

The simulated side runs on ``cpu-local`` (fitted by ``splitserve sim calibrate``) with the
engine's own settings. Both are summarized by ``workload.metrics``; the script prints goodput
and p50 TTFT side by side with their ratio (goal: within 15%). A busy system is chaotic: a
step a little faster or slower moves which turn waits behind which, and a single simulated
run's p50 TTFT by up to ~10%. ``--jitter PCT`` simulates each run with steps 1 +- PCT% as
long (five runs: a machine a little off its calibration) and compares their median.
``--speed-from-run`` (with ``--host-cores`` and a bench run that recorded its CPU figures)
first scales every step by the run's engine CPU seconds over the simulated engine seconds:
the machine's speed during the run, which drifts by 5-20% between a calibration and a run
minutes or hours apart on this shared machine.

    .venv/bin/python benchmarks/sim_validate.py --calibration cal.json --rate 0.5 --num 24
    .venv/bin/python benchmarks/sim_validate.py --calibration cal.json --bench-json cmp.json \
        --input-len 128 --output-len 16
    .venv/bin/python benchmarks/sim_validate.py --calibration cal.json --bench-json cmp.json \
        --workload agentic --agent-types 4 --system-tokens 256 ... --slo ttft:1000,tpot:250
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections import deque

from splitserve.bench.deployments import DEPLOYMENTS
from splitserve.bench.scrape import serving_cpu_seconds
from splitserve.common.sampling_params import SamplingParams
from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.hardware import get_hardware, load_calibration
from splitserve.sim.models import get_model
from splitserve.sim.run import simulate
from splitserve.workload.args import add_run_args, workload_from_args
from splitserve.workload.metrics import SLO, RequestRecord, summarize
from splitserve.workload.sessions import API_CHAT, SessionSpec


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
            # From its arrival, not from now: it waited for the step in progress, as a
            # request does at a worker (and in the simulator).
            records[s.session_id] = RequestRecord(
                s.session_id, 0, s.arrival_s, prompt_tokens=turn.new_tokens
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
    return rs, max(r.end_s for r in rs)  # from the start, as bench and the simulator count


def cpu_local(calibration: str, **settings) -> SimConfig:
    """The engine's defaults (1 GiB KV, 64 sequences, 1024-token budget) on cpu-local, with
    ``settings`` (a deployment's serve flags: policy, KV pool, tiers) over them."""
    base = dict(kv_cache_gb=1.0, max_num_seqs=64, max_num_batched_tokens=1024)
    return SimConfig(
        get_model("smollm2-135m"),
        load_calibration(get_hardware("cpu-local"), calibration),
        dtype="fp32",
        **{**base, **settings},
    )


def serve_flags() -> argparse.ArgumentParser:
    """The `splitserve serve` flags a bench deployment's command line sets that the simulated
    system takes (`bench compare` stores that command line in each run's info)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--prefill", type=int, default=0)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--policy", default="session")
    p.add_argument("--prefill-policy", default="prefix")
    p.add_argument("--scheduling-policy", default="fcfs")
    p.add_argument("--load-factor", type=float, default=None)
    p.add_argument("--load-floor", type=int, default=None)
    for flag in ("--kv-cache-gb", "--host-kv-gb"):
        p.add_argument(flag, type=float, default=None)
    p.add_argument("--disk-kv-gb", type=float, default=10.0)  # the worker's default
    p.add_argument("--disk-kv-dir", default=None)
    p.add_argument("--kv-peer-fetch", action="store_true")
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--block-size"):
        p.add_argument(flag, type=int, default=None)
    return p


def simulated_system(run: dict) -> tuple[Deployment, dict]:
    """The deployment and SimConfig settings of a `bench compare` run: its `splitserve serve`
    command line (after the `;` of its info), else the deployment's flags at 2 workers."""
    info = run["summary"].get("info", {}).get("deployment", "")
    if ";" in info:
        argv = info.split(";", 1)[1].split()
    else:
        dep = DEPLOYMENTS[run["deployment"]]
        prefill, decode = dep.pools(2)
        argv = ["--prefill", str(prefill), "--decode", str(decode), *dep.serve_args]
    a, _ = serve_flags().parse_known_args(argv)
    # `serve` with no prefill workers runs its decode workers collocated (role both).
    dep = Deployment(a.prefill, a.decode) if a.prefill else Deployment(collocated=a.decode)
    settings = {"policy": a.policy, "prefill_policy": a.prefill_policy}
    settings["scheduling_policy"] = a.scheduling_policy
    settings["kv_peer_fetch"] = a.kv_peer_fetch
    knobs = ("kv_cache_gb", "host_kv_gb", "max_num_seqs", "max_num_batched_tokens")
    for name in (*knobs, "load_factor", "load_floor"):
        if getattr(a, name) is not None:
            settings[name] = getattr(a, name)
    if a.block_size is not None:
        settings["block_size"] = a.block_size
    if a.disk_kv_dir is not None:  # the real disk tier needs a directory
        settings["disk_kv_gb"] = a.disk_kv_gb
    workers = run["summary"].get("info", {}).get("workers")
    if workers:  # runs since 2026-12-02: the simulated workers take the real ones' names
        # (collocated, `serve` starts them as decode workers; the simulator's are "both")
        roles = {"decode": "both"} if not dep.prefill else {}
        settings["worker_urls"] = tuple(
            (w["url"], roles.get(w["role"], w["role"])) for w in workers
        )
    return dep, settings


FIGURES = (
    ("goodput (req/s)", lambda s: s.request_goodput),
    ("session goodput (/s)", lambda s: s.session_goodput),
    ("p50 TTFT (ms)", lambda s: s.ttft.median),
    ("p50 TPOT (ms)", lambda s: s.tpot.median),
    ("p50 E2E (ms)", lambda s: s.e2e.median),
    ("prompt tokens", lambda s: s.total_input_tokens / max(s.completed, 1)),
    ("cached (%)", lambda s: 100 * s.cached_tokens / max(s.total_input_tokens, 1)),
)


def print_rows(real, sims) -> None:
    """Each figure real, simulated (the median over ``sims``, with their range when more
    than one) and their ratio."""
    sims = sims if isinstance(sims, list) else [sims]
    spread = len(sims) > 1
    print(f"{'':<22}{'real':>10}{'simulated':>12}{'sim/real':>10}" + ("  range" if spread else ""))
    for name, figure in FIGURES:
        a, values = figure(real), sorted(figure(x) for x in sims)
        b = statistics.median(values)
        ratio = b / a if a else float("nan")
        line = f"{name:<22}{a:>10.3f}{b:>12.3f}{ratio:>10.2f}"
        print(line + (f"  {values[0]:.3f}-{values[-1]:.3f}" if spread else ""))


# Below this share of requests meeting their SLOs (or with any left unfinished) a real run is
# past saturation: its goodput is what is left of a collapse, and two runs of the same command
# differ by up to 40% (docs/journal/2026-12-02.md, "A slower machine"), more than the 15%
# checked here.
SATURATED_ATTAINMENT = 0.5


def saturated(real) -> str | None:
    """Why the real run is past saturation, or None."""
    if real.failed:
        return f"{real.failed} requests unfinished"
    if real.slo_attainment < SATURATED_ATTAINMENT:
        return f"{real.slo_attainment:.0%} of requests met the SLOs"
    return None


def jitter_scales(percent: float, n: int = 5) -> list[float]:
    """``n`` step-time scales evenly over ``1 +- percent / 100`` (just 1.0 for 0): how
    a simulated run moves when the machine is a little faster or slower than calibrated."""
    if percent <= 0:
        return [1.0]
    return [1.0 + percent / 100 * (2 * i / (n - 1) - 1) for i in range(n)]


# (what, the bench run's server figure, the simulation's counter): where the host's time went
HOST_CPU = (
    ("engine busy, wall (s)", "engine_busy_seconds", "engine busy (s)"),
    ("engine compute (s)", "engine_cpu_seconds", "engine compute (s)"),
)


REAL_CPU = (
    "engine_busy_seconds",
    "engine_cpu_seconds",
    "worker_cpu_seconds",
    "router_cpu_seconds",
    "client_cpu_seconds",
)


def print_host_cpu(real: dict, sim: dict) -> None:
    """The engines' time, real (bench's CPU figures, recorded since they exist) against
    simulated (with --host-cores); and the serving CPU outside the engines."""
    if not all(k in real for k in REAL_CPU) or "engine busy (s)" not in sim:
        return
    for name, real_key, sim_key in HOST_CPU:
        a, b = real[real_key], sim[sim_key]
        print(f"{name:<22}{a:>10.1f}{b:>12.1f}{b / a if a else float('nan'):>10.2f}")
    serving = serving_cpu_seconds(real)
    b = sim["serving CPU on the shared cores (s)"]
    print(f"{'serving CPU (s)':<22}{serving:>10.1f}{b:>12.1f}{b / serving:>10.2f}")


def at_the_runs_speed(cfg: SimConfig, dep, wl, run: dict, duration: float, slo: SLO):
    """``cfg`` with every step scaled by the real run's engine CPU seconds over the simulated
    run's engine seconds: the machine's speed during the run, from the run's own engine
    threads (bench's CPU figures) rather than from a calibration taken before or after it."""
    server = run["summary"].get("server", {})
    if "engine_cpu_seconds" not in server or not cfg.host_cores:
        raise SystemExit("--speed-from-run needs a bench run with CPU figures and --host-cores")
    sim = simulate(cfg, dep, wl, run["rate"], duration, slo).summary
    scale = server["engine_cpu_seconds"] / sim.server["engine compute (s)"]
    print(f"\n{run['deployment']}: steps scaled by {scale:.3f} (the run's engine CPU)")
    return dataclasses.replace(cfg, hardware=cfg.hardware.steps_scaled(scale))


def against_bench(args, workload, slo: SLO) -> None:
    with open(args.bench_json) as f:
        runs = json.load(f)
    table = []
    for run, i in zip(runs, load_indices(runs), strict=True):
        wl = dataclasses.replace(workload, seed=workload.seed + i)
        check_workload(run, wl)
        dep, settings = simulated_system(run)
        settings["chat_template"] = chats(wl) and not args.no_chat_template
        settings["host_cores"] = args.host_cores
        records = [RequestRecord(**r) for r in run["requests"]]
        real = summarize(records, run["summary"]["duration_s"], slo)
        duration = max(r.start_s for r in records if r.turn == 0) + 1e-9
        cfg = cpu_local(args.calibration, **settings)
        if args.speed_from_run:
            cfg = at_the_runs_speed(cfg, dep, wl, run, duration, slo)
        sims = [
            simulate(dataclasses.replace(cfg, hardware=cfg.hardware.steps_scaled(x)), dep, wl,
                     run["rate"], duration, slo).summary
            for x in jitter_scales(args.jitter)
        ]  # fmt: skip
        shown = ", ".join(f"{k} {v}" for k, v in settings.items())
        print(f"\n{run['deployment']} ({dep.describe()}; {shown}) at {run['rate']:g}/s:")
        why = saturated(real)
        if why is not None:
            print(f"the real run is past saturation ({why}): its goodput repeats poorly")
        print_rows(real, sims)
        print_host_cpu(run["summary"].get("server", {}), sims[len(sims) // 2].server)
        table.append((run["deployment"], run["rate"], real, sims))
    print_markdown(table)


def load_indices(runs: list[dict]) -> list[int]:
    """Each run's load index in its sweep: `bench compare` replays seed + i for the i-th
    load of each deployment, with the same seeds in every repeat (`--repeats`)."""
    seen: dict[tuple[str, int], int] = {}
    out = []
    for run in runs:
        key = (run["deployment"], run.get("repeat", 1))
        seen[key] = seen.get(key, -1) + 1
        out.append(seen[key])
    return out


def chats(workload) -> bool:
    """Whether the workload's sessions go through the chat API (the template adds tokens)."""
    return next(iter(workload.sessions(1.0))).api == API_CHAT


def check_workload(run: dict, workload) -> None:
    described = run["summary"].get("info", {}).get("workload")
    if described is not None and described != workload.describe():
        raise SystemExit(
            f"the bench run's workload was\n  {described}\nbut these options give\n  "
            f"{workload.describe()}\ngive sim_validate.py the bench command's workload options"
        )


def print_markdown(table) -> None:
    print(
        "\n| deployment | rate | goodput real / sim (req/s) | sim / real "
        "| p50 TTFT real / sim (ms) | sim / real |"
    )
    print("|---|---|---|---|---|---|")
    for name, rate, real, sims in table:
        g = real.request_goodput, statistics.median(x.request_goodput for x in sims)
        t = real.ttft.median, statistics.median(x.ttft.median for x in sims)
        mark = " (past saturation)" if saturated(real) else ""
        print(
            f"| {name}{mark} | {rate:g}/s | {g[0]:.3f} / {g[1]:.3f} | **{g[1] / g[0]:.2f}** "
            f"| {t[0]:.0f} / {t[1]:.0f} | **{t[1] / t[0]:.2f}** |"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    add_run_args(ap)  # bench's workload and SLO options: repeat the bench command's
    ap.set_defaults(workload="random", rate=0.5)
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--num", type=int, default=24, help="requests (without --bench-json)")
    ap.add_argument("--bench-json", default=None, help="a `bench compare --json` output")
    ap.add_argument(
        "--no-chat-template", action="store_true", help="simulate chat prompts without it"
    )
    ap.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        metavar="PCT",
        help="with --bench-json: simulate each run with steps 1 +- PCT%% as long (5 runs) and "
        "compare the real run with their median (a single run of a busy system is chaotic)",
    )
    ap.add_argument(
        "--speed-from-run",
        action="store_true",
        help="with --bench-json and --host-cores: scale the calibration's steps to the real "
        "run's engine CPU seconds (the machine's speed during the run)",
    )
    ap.add_argument(
        "--host-cores",
        type=int,
        default=None,
        help="the cores the real workers shared (this machine: 2); default: one each",
    )
    args = ap.parse_args()
    if args.workload == "random":
        args.input_len = args.input_len or 96
        args.output_len = args.output_len or 24
    slo = SLO.parse(args.slo or "ttft:3000,tpot:400", args.session_slo)
    workload = workload_from_args(args)
    if args.bench_json:
        print(f"{workload.describe()} vs {args.bench_json}, SLO {slo.describe()}")
        against_bench(args, workload, slo)
        return
    if args.workload != "random":
        raise SystemExit("without --bench-json the engine replays single turns: --workload random")
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
