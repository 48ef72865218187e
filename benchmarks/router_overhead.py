"""What the router costs, and what session stickiness buys, measured in the same run.

1. Overhead: ``--clients`` concurrent streaming clients, each sending requests back to back,
   straight to one worker and then through the router in front of that same worker
   (alternating ``--rounds`` times to cancel drift). Reports end-to-end latency and time to
   first chunk, p50/p99 of both paths, the router's added latency at each percentile (goal:
   p99 at most 5 ms), the throughput ratio, and the CPU the router process spent per
   request. By default the worker is the echo worker of the router tests (no model), which
   isolates the router; ``--worker-url`` measures a real worker.

   ``--placement pinned`` (default) gives the router a core of its own, as a deployment
   would: the router runs on the last CPU, the clients (this process) and the worker on the
   others, in both the direct and the routed run, so the one difference is the router hop.
   ``--placement shared`` lets every process use every core (on a 2-core machine it then
   measures mostly CPU queueing). ``--token-interval-ms`` paces the echo worker's tokens like
   a decoding model (default 20 ms, 50 tokens/s); 0 sends them back to back.
   ``--arrivals lockstep|staggered|poisson`` shapes when requests arrive (``router_load``).
   After each routed run the router's ``/metrics`` phase histograms (where its time went:
   ``splitserve.router.timing``) are scraped and their p50/p99 printed, with how bursty the
   arrivals were. ``--baseline-src DIR`` also measures a second router, run from another
   checkout's ``src`` (an older commit), alternating with this one in the same rounds.
   ``--peer vllm-router[:POLICY]`` (repeatable; policy round_robin by default) also measures
   vLLM's Rust router in front of the same worker, in the same rounds, on the router's CPUs;
   it adds a table of each router's added latency and our p99 over the peer's (goal: at
   most 1). ``router_peer`` has the details.
   ``--tls``: the echo worker and the router serve HTTPS with a private CA made for the run
   (``splitserve.cluster.tls``, as ``serve --tls``), so the client's and the worker's legs
   are both TLS, the direct path's too; the clients keep their connections alive, as the
   router does. Run it once without and once with to compare.
   ``--secure-pair``: both in the same rounds, alternating: a plain router over a plain echo
   worker, and a router with TLS on both legs, a keys file (each client sends a tenant's
   key) and a cluster secret (it signs each forwarded request's tenant) over an HTTPS echo
   worker. Each is measured against its own direct path; the report is what TLS plus the
   tenant checks add to the router's added p99 (goal: at most 1 ms), over the whole run and
   as the median of the per-round differences.
2. Stickiness (``--ttft``): growing sessions of ``--turns`` turns over ``--real-workers``
   real model workers, through a router with ``--policy session`` and one with
   ``round-robin``. Reports mean TTFT of the last turn over the first (goal for sticky:
   at most 1.5). ``--kv-cache-gb`` sizes each worker's pool: small enough that a worker
   cannot hold every session, round-robin loses its cache and the policies separate.

    python benchmarks/router_overhead.py [--clients 64] [--placement pinned|shared]
        [--token-interval-ms 20] [--max-tokens 32] [--arrivals lockstep|staggered|poisson]
        [--baseline-src DIR] [--peer vllm-router[:POLICY]] [--vllm-router-bin PATH]
        [--tls [--signed] | --secure-pair] [--ttft [--no-overhead] [--kv-cache-gb G]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import random
import signal
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

from splitserve.cluster.local import free_port
from splitserve.cluster.tls import DeploymentTLS, private_tls
from splitserve.cluster.vllm_router import READY_PATH
from splitserve.common.gc_pauses import quiet_gc
from splitserve.common.tls import client_context

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by file path
from router_load import (  # noqa: E402
    ARRIVALS,
    BURST_WINDOW_S,
    Run,
    bursts,
    load_run,
    make_plan,
    mean_duration,
    merge,
    phase_deltas,
    phase_summary,
    scrape_phases,
)
from router_peer import (  # noqa: E402
    Peer,
    cpu_description,
    parse_peer,
    pct,
    peer_command,
    report_peers,
    resolve_binary,
)

ROOT = Path(__file__).resolve().parent.parent
PHASE_ORDER = (  # splitserve.router.timing.PHASE_NAMES; not imported: --baseline-src routers
    "queued",
    "parse",
    "route",
    "upstream_headers",
    "upstream_first_chunk",
    "first_write",
    "stream",
    "total",
)
ECHO_WORKER = ROOT / "tests" / "router" / "fake_worker.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=10, help="per client and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--worker-url", default=None, help="an existing worker (default: echo worker)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per streamed request")
    p.add_argument(
        "--placement",
        choices=("pinned", "shared"),
        default="pinned",
        help="pinned: the router on the last CPU, clients and worker on the others",
    )
    p.add_argument(
        "--token-interval-ms",
        type=float,
        default=20.0,
        help="echo worker: delay between streamed tokens (0: back to back)",
    )
    p.add_argument(
        "--arrivals",
        choices=ARRIVALS,
        default="lockstep",
        help="lockstep: clients start together, equal lengths; staggered: spread starts, "
        "varied lengths; poisson: open-loop arrivals, mean concurrency --clients",
    )
    p.add_argument(
        "--baseline-src",
        type=Path,
        default=None,
        help="also measure the router of another checkout's src/ (e.g. an older commit)",
    )
    p.add_argument(
        "--peer",
        type=parse_peer,
        action="append",
        default=[],
        metavar="vllm-router[:POLICY]",
        help="also measure vllm-router with POLICY (default round_robin; e.g. consistent_hash, "
        "keyed by each client's body 'user'); repeatable",
    )
    p.add_argument(
        "--vllm-router-bin",
        default=None,
        metavar="PATH",
        help="the vllm-router executable (default: .venv-vllm, then PATH)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="FILE",
        help="run the router under cProfile (stats to FILE, top functions printed); "
        "its CPU figures then include the profiler's cost",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="part 1 over HTTPS: the echo worker and the router serve TLS (a private CA)",
    )
    p.add_argument(
        "--signed",
        action="store_true",
        help="give the router a cluster secret: it signs each forwarded request's tenant",
    )
    p.add_argument(
        "--secure-pair",
        action="store_true",
        help="alternate a plain router and one with TLS, a keys file and tenant signatures "
        "in the same rounds; report what the second adds to the router's p99",
    )
    p.add_argument("--ttft", action="store_true", help="also run part 2 (real model workers)")
    p.add_argument("--no-overhead", action="store_true", help="skip part 1")
    p.add_argument("--real-workers", type=int, default=2)
    # Odd: sessions that advance in step would otherwise meet round-robin's alternation in
    # the same phase every turn, and round-robin would keep each on one worker by accident.
    p.add_argument("--sessions", type=int, default=5)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--kv-cache-gb", type=float, default=0.15, help="per real worker (--ttft)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.clients < 1 or args.requests < 1 or args.rounds < 1 or args.max_tokens < 1:
        p.error("--clients, --requests, --rounds and --max-tokens must be >= 1")
    if args.token_interval_ms < 0:
        p.error("--token-interval-ms must be >= 0")
    if (args.tls or args.secure_pair) and (args.peer or args.baseline_src or args.worker_url):
        p.error(
            "--tls and --secure-pair measure this router over the echo worker: not with "
            "--peer, --baseline-src or --worker-url"
        )
    if args.secure_pair and (args.tls or args.signed):
        p.error("--secure-pair sets up both routers itself: not with --tls or --signed")
    if args.peer:
        args.vllm_router_bin = resolve_binary(args.vllm_router_bin)
    return args


# ---- processes -------------------------------------------------------------------------------


def split_cpus(placement: str, cpus: set[int]) -> tuple[set[int] | None, set[int] | None]:
    """(the router's CPUs, everyone else's) for ``placement``; None: no pinning."""
    if placement == "shared":
        return None, None
    if len(cpus) < 2:
        raise SystemExit("--placement pinned needs at least 2 CPUs; use --placement shared")
    ordered = sorted(cpus)
    return {ordered[-1]}, set(ordered[:-1])


def _pinned(cpus: set[int] | None) -> Callable[[], None] | None:
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


class Proc:
    """A child process serving HTTP on ``port``; stopped (its whole group) on ``stop``."""

    ready_path = "/health"
    phases = True  # serves splitserve's router phase histograms on /metrics

    def __init__(
        self,
        argv: list[str],
        port: int,
        cpus: set[int] | None = None,
        env: dict | None = None,
        quiet: bool = False,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.url = f"{'http' if tls is None else 'https'}://127.0.0.1:{port}"
        self.tls = tls  # what an https:// server is verified against
        self.stop_signal = signal.SIGTERM
        stdout = subprocess.DEVNULL if quiet else None
        self.proc = subprocess.Popen(
            argv, start_new_session=True, cwd=ROOT, preexec_fn=_pinned(cpus), env=env, stdout=stdout
        )

    def wait_ready(self, timeout_s: float = 180.0) -> Proc:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args} exited with {self.proc.returncode}")
            try:
                verify = True if self.tls is None else self.tls
                r = httpx.get(self.url + self.ready_path, timeout=1.0, verify=verify)
                if r.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.url} not ready after {timeout_s}s")

    def cpu_s(self) -> tuple[float, float]:
        """CPU seconds (user + system, system) the process has used so far."""
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system, t.system

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, self.stop_signal)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)


def echo_worker(
    cpus: set[int] | None = None, token_interval_s: float = 0.0, tls: DeploymentTLS | None = None
) -> Proc:
    """The router tests' echo worker in greedy mode: ``max_tokens`` chunks, a finish chunk
    and ``[DONE]``, like a real worker, each token ``token_interval_s`` after the last;
    ``tls``: serving HTTPS."""
    port = free_port()
    argv = [sys.executable, str(ECHO_WORKER), "--port", str(port), "--name", "echo"]
    if tls is not None:
        argv += ["--ssl-certfile", tls.cert, "--ssl-keyfile", tls.key]
    proc = Proc(argv, port, cpus, tls=_verify(tls)).wait_ready()
    mode = {"greedy": True, "delay_s": token_interval_s}
    verify = True if proc.tls is None else proc.tls
    httpx.post(proc.url + "/_mode", json=mode, timeout=5.0, verify=verify).raise_for_status()
    return proc


def _verify(tls: DeploymentTLS | None) -> ssl.SSLContext | None:
    return None if tls is None else client_context(tls.ca)


def real_worker(threads: int, kv_cache_gb: float) -> Proc:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "splitserve.cli",
        "worker",
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--kv-cache-gb",
        str(kv_cache_gb),
        "--log-level",
        "warning",
    ]
    return Proc(argv, port)


def router(
    workers: list[str],
    policy: str = "session",
    cpus: set[int] | None = None,
    src: Path | None = None,
    profile: Path | None = None,
    tls: DeploymentTLS | None = None,
    signed: bool = False,
    api_keys: Path | None = None,
) -> Proc:
    """A router process; ``src``: import splitserve from that directory instead;
    ``profile``: run it under cProfile, the stats written there when it stops; ``tls``:
    serving HTTPS, and verifying https:// workers against its CA; ``signed``: with a
    cluster secret, so it signs every forwarded request's tenant (``common/tenants.py``);
    ``api_keys``: authenticating clients by that keys file (needs ``signed``)."""
    port = free_port()
    env = None if src is None else {**os.environ, "PYTHONPATH": str(src.resolve())}
    if signed:
        env = {**(env or os.environ), "SPLITSERVE_KV_SECRET": os.urandom(16).hex()}
    profiler = [] if profile is None else ["-m", "cProfile", "-o", str(profile.resolve())]
    argv = [
        sys.executable,
        *profiler,
        "-m",
        "splitserve.router.cli",
        "--port",
        str(port),
        "--workers",
        *workers,
        "--policy",
        policy,
        "--log-level",
        "warning",
        *([] if tls is None else tls.server_args()),
        *([] if api_keys is None else ["--api-keys", str(api_keys)]),
    ]
    proc = Proc(argv, port, cpus, env, tls=_verify(tls))
    if profile is not None:
        # uvicorn re-raises SIGTERM after its shutdown, which would kill the process before
        # cProfile writes; SIGINT becomes a KeyboardInterrupt, and cProfile writes first.
        proc.stop_signal = signal.SIGINT
    return proc


class PeerRouter(Proc):
    """vllm-router: ready once it answers /readiness; its /metrics is a worker's."""

    ready_path = READY_PATH
    phases = False


def peer_router(binary: str, peer: Peer, worker_url: str, cpus: set[int] | None) -> Proc:
    """``peer`` on ``cpus`` (the router's, as ours gets); its start-up chatter discarded."""
    port = free_port()
    argv, env = peer_command(binary, peer, port, worker_url)
    return PeerRouter(argv, port, cpus, env, quiet=True)


# ---- part 1: overhead ------------------------------------------------------------------------


def overhead(args: argparse.Namespace) -> None:
    all_cpus = os.sched_getaffinity(0)
    router_cpus, other_cpus = split_cpus(args.placement, all_cpus)
    if other_cpus is not None:
        os.sched_setaffinity(0, other_cpus)  # the clients
    try:
        measure_overhead(args, router_cpus, other_cpus)
    finally:
        os.sched_setaffinity(0, all_cpus)


def measure_overhead(
    args: argparse.Namespace, router_cpus: set[int] | None, other_cpus: set[int] | None
) -> None:
    print(
        f"placement: router on {router_cpus or 'any'}, clients and worker on {other_cpus or 'any'}"
    )
    interval = args.token_interval_ms / 1e3
    if args.secure_pair:
        measure_secure_pair(args, router_cpus, other_cpus, interval)
        return
    tls = private_tls() if args.tls else None
    try:
        measure_fronts(args, router_cpus, other_cpus, interval, tls)
    finally:
        if tls is not None:
            tls.remove()


def measure_fronts(
    args: argparse.Namespace,
    router_cpus: set[int] | None,
    other_cpus: set[int] | None,
    interval: float,
    tls: DeploymentTLS | None,
) -> None:
    print(f"legs: {'HTTPS (TLS 1.3, a private CA)' if tls else 'plain HTTP'}")
    worker = None if args.worker_url else echo_worker(other_cpus, interval, tls)
    worker_url = args.worker_url or worker.url
    front = router(
        [worker_url], cpus=router_cpus, profile=args.profile, tls=tls, signed=args.signed
    )
    print(f"tenant signatures: {'on' if args.signed else 'off'}")
    fronts = {"router": front}
    if args.baseline_src is not None:
        fronts["baseline"] = router([worker_url], cpus=router_cpus, src=args.baseline_src)
    for peer in args.peer:
        fronts[peer.name] = peer_router(args.vllm_router_bin, peer, worker_url, router_cpus)
    for f in fronts.values():
        f.wait_ready()
    try:
        runs, cpu_s, phases = measure_paths(args, worker_url, fronts, _verify(tls))
    finally:
        for f in fronts.values():
            f.stop()
        if worker is not None:
            worker.stop()
    routed = args.rounds * args.clients * args.requests  # warm-ups are not measured
    cpu_per_request = {k: (v[0] / routed, v[1] / routed) for k, v in cpu_s.items()}
    report_overhead(runs, cpu_per_request)
    if args.peer:
        report_peers(runs, [peer.name for peer in args.peer], cpu_per_request)
    for name, histograms in phases.items():
        report_phases(name, histograms)
    if args.profile is not None:
        print(f"\nrouter profile ({args.profile}), by own time:")
        pstats.Stats(str(args.profile)).sort_stats("tottime").print_stats(30)


def measure_secure_pair(
    args: argparse.Namespace,
    router_cpus: set[int] | None,
    other_cpus: set[int] | None,
    interval: float,
) -> None:
    """A plain router and a TLS + keys file + signing one, each over its own echo worker,
    alternating round by round on the identical plan."""
    tls = private_tls()
    keys = Path(tls.ca).parent / "bench-keys.json"
    key = "sk-bench-" + os.urandom(8).hex()
    keys.write_text(json.dumps([{"key": key, "tenant": "bench"}]))
    print("legs: plain HTTP, and HTTPS (TLS 1.3, a private CA) with a keys file and signatures")
    procs: list[Proc] = []
    try:
        plain_worker = echo_worker(other_cpus, interval)
        procs.append(plain_worker)
        secure_worker = echo_worker(other_cpus, interval, tls)
        procs.append(secure_worker)
        plain = router([plain_worker.url], cpus=router_cpus)
        procs.append(plain)
        secure = router([secure_worker.url], cpus=router_cpus, tls=tls, signed=True, api_keys=keys)
        procs.append(secure)
        plain.wait_ready()
        secure.wait_ready()
        setups = {
            "plain": (plain_worker.url, plain, None, None),
            "secure": (secure_worker.url, secure, _verify(tls), {"authorization": f"Bearer {key}"}),
        }
        runs: dict[str, dict[str, list[Run]]] = {n: {"direct": [], "router": []} for n in setups}
        cpu = dict.fromkeys(setups, (0.0, 0.0))
        for _ in range(args.rounds):
            for name, (url, front, verify, headers) in setups.items():
                got, cpu_s, _ = measure_paths(args, url, {"router": front}, verify, 1, headers)
                for path in ("direct", "router"):
                    runs[name][path] += got[path]
                cpu[name] = (cpu[name][0] + cpu_s["router"][0], cpu[name][1] + cpu_s["router"][1])
    finally:
        for proc in reversed(procs):
            proc.stop()
        tls.remove()
    routed = args.rounds * args.clients * args.requests
    for name in setups:
        print(f"\n{name}:")
        per_request = {"router": (cpu[name][0] / routed, cpu[name][1] / routed)}
        report_overhead(runs[name], per_request)
    report_secure_pair(runs)
    if args.profile is not None:
        print(f"\nsecure router profile ({args.profile}), by own time:")
        pstats.Stats(str(args.profile)).sort_stats("tottime").print_stats(30)


def _added_p99(direct: list[Run], routed: list[Run], first: bool = False) -> float:
    """The router's p99 over the direct path's, ms (end to end, or to the first chunk)."""

    def p99(rs: list[Run]) -> float:
        return pct([t.first_s if first else t.total_s for r in rs for t in r.timings], 99)

    return (p99(routed) - p99(direct)) * 1e3


def report_secure_pair(runs: dict[str, dict[str, list[Run]]]) -> None:
    """What TLS plus the tenant checks add to the router's added p99: whole run, and the
    median of the per-round differences (the figure drift moves least)."""
    whole = {n: _added_p99(r["direct"], r["router"]) for n, r in runs.items()}
    first = {n: _added_p99(r["direct"], r["router"], first=True) for n, r in runs.items()}
    rounds = len(runs["plain"]["router"])
    per_round = [
        _added_p99(runs["secure"]["direct"][i : i + 1], runs["secure"]["router"][i : i + 1])
        - _added_p99(runs["plain"]["direct"][i : i + 1], runs["plain"]["router"][i : i + 1])
        for i in range(rounds)
    ]
    paired = statistics.median(per_round)
    print("\nTLS + keys file + signatures over plain, router's added p99 (ms):")
    print(
        f"  whole run: plain {whole['plain']:.2f}, secure {whole['secure']:.2f}, "
        f"difference {whole['secure'] - whole['plain']:.2f}"
    )
    print(
        f"  to first chunk: plain {first['plain']:.2f}, secure {first['secure']:.2f}, "
        f"difference {first['secure'] - first['plain']:.2f}"
    )
    print(
        f"  per round (secure - plain): median {paired:.2f} over {rounds} rounds, "
        f"{sum(d <= 0 for d in per_round)} rounds secure no worse"
    )
    verdict = "met" if min(whole["secure"] - whole["plain"], paired) <= 1.0 else "NOT met"
    print(f"goal (at most 1 ms added to p99, whole run or paired median): {verdict}")


def measure_paths(
    args: argparse.Namespace,
    worker_url: str,
    fronts: dict[str, Proc],
    tls: ssl.SSLContext | None = None,
    rounds: int | None = None,
    headers: dict[str, str] | None = None,
):
    """Alternate the paths ``rounds`` (default ``--rounds``) times on the identical plan;
    (runs, router CPU seconds, router phase histograms) by path. ``tls``: the clients verify
    HTTPS by it; ``headers``: sent with every request."""
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
        "max_tokens": args.max_tokens,
        "temperature": 0,
    }
    warm = json.dumps(body).encode()
    duration = asyncio.run(mean_duration(worker_url, args.clients, warm, tls, headers))
    plan = make_plan(args.arrivals, args.clients, args.requests, body, duration, args.seed)
    print(f"arrivals: {args.arrivals}; one request's mean duration {duration * 1e3:.1f} ms")
    urls = {"direct": worker_url, **{k: f.url for k, f in fronts.items()}}
    runs: dict[str, list[Run]] = {name: [] for name in urls}
    cpu_s = dict.fromkeys(fronts, (0.0, 0.0))
    phases: dict[str, dict] = {name: {} for name, f in fronts.items() if f.phases}
    for _ in range(args.rounds if rounds is None else rounds):
        for name, url in urls.items():
            front = fronts.get(name)
            before: list = []

            def warmed(front: Proc | None = front, url: str = url, before: list = before) -> None:
                if front is not None:
                    histograms = scrape_phases(url, tls) if front.phases else {}
                    before[:] = [front.cpu_s(), histograms]

            run = load_run(url, args.clients, plan, warm, warmed, tls, headers)
            runs[name].append(asyncio.run(run))
            if front is not None:
                (cpu, system), (cpu0, system0) = front.cpu_s(), before[0]
                total, total_system = cpu_s[name]
                cpu_s[name] = (total + cpu - cpu0, total_system + system - system0)
                if front.phases:
                    after = scrape_phases(url, tls)
                    phases[name] = merge(phases[name], phase_deltas(before[1], after))
    return runs, cpu_s, phases


def report_overhead(
    runs: dict[str, list[Run]], cpu_per_request_s: dict[str, tuple[float, float]]
) -> None:
    total = {k: [t.total_s for r in rs for t in r.timings] for k, rs in runs.items()}
    first = {k: [t.first_s for r in rs for t in r.timings] for k, rs in runs.items()}
    rps = {k: statistics.mean(r.rps for r in rs) for k, rs in runs.items()}
    heads = ("requests", "p50 ms", "p99 ms", "TTFB p50", "TTFB p99", "req/s", "burst p50/p99")
    width = max(9, *(len(name) + 1 for name in runs))
    print(f"{'':<{width}}" + "".join(f"{h:>10}" for h in heads[:-1]) + f"{heads[-1]:>15}")
    for name in runs:
        lat, ttfb = total[name], first[name]
        burst = bursts([t for r in runs[name] for t in r.timings])
        print(
            f"{name:<{width}}{len(lat):>10}{pct(lat, 50) * 1e3:>10.2f}{pct(lat, 99) * 1e3:>10.2f}"
            f"{pct(ttfb, 50) * 1e3:>10.2f}{pct(ttfb, 99) * 1e3:>10.2f}{rps[name]:>10.1f}"
            f"{pct(burst, 50):>9.0f} /{pct(burst, 99):>3.0f}"
        )
    print(
        f"(burst: requests sent in the {BURST_WINDOW_S * 1e3:.0f} ms before each, itself included)"
    )
    for name in cpu_per_request_s:
        added = {q: (pct(total[name], q) - pct(total["direct"], q)) * 1e3 for q in (50, 99)}
        added_first = {q: (pct(first[name], q) - pct(first["direct"], q)) * 1e3 for q in (50, 99)}
        print(
            f"{name}: added latency p50 {added[50]:.2f} ms, p99 {added[99]:.2f} ms "
            f"(goal p99 <= 5 ms: {'met' if added[99] <= 5 else 'NOT met'})"
        )
        print(
            f"{name}: added time to first byte p50 {added_first[50]:.2f} ms, "
            f"p99 {added_first[99]:.2f} ms"
        )
        print(f"{name}: throughput ratio router/direct: {rps[name] / rps['direct']:.3f}")
        cpu, system = cpu_per_request_s[name]
        print(f"{name}: router CPU per request: {cpu * 1e3:.2f} ms (system {system * 1e3:.2f})")


def report_phases(name: str, histograms: dict[str, dict[float, float]]) -> None:
    """The router's own phase histograms over the measured runs (not their warm-ups)."""
    if not histograms:
        print(f"{name}: no phase histograms on /metrics (a router before they existed)")
        return
    print(f"\n{name}: where a request's time went in the router (its /metrics; ms)")
    print(f"{'phase':<22}{'requests':>10}{'mean':>10}{'p50':>10}{'p99':>10}")
    for phase in PHASE_ORDER:
        if phase in histograms:
            count, mean, p50, p99 = phase_summary(histograms[phase])
            print(
                f"{phase:<22}{count:>10.0f}{mean * 1e3:>10.3f}{p50 * 1e3:>10.3f}{p99 * 1e3:>10.3f}"
            )


# ---- part 2: TTFT over growing sessions ------------------------------------------------------


async def ttft(
    client: httpx.AsyncClient, url: str, messages: list[dict], key: str
) -> tuple[float, str]:
    """Time to the first generated text (not to the role chunk a worker sends at once)."""
    body = {"messages": messages, "stream": True, "max_tokens": 16, "temperature": 0}
    start, first, text = time.perf_counter(), None, []
    async with client.stream(
        "POST", url + "/v1/chat/completions", json=body, headers={"X-Session-Id": key}
    ) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            content = choices[0].get("delta", {}).get("content")
            if content and first is None:
                first = time.perf_counter() - start
            text.append(content or "")
    return first or 0.0, "".join(text)


async def sessions_run(url: str, args: argparse.Namespace, tag: str) -> list[list[float]]:
    rng = random.Random(args.seed)
    words = "agent tool call result file test patch error trace branch commit log".split()

    async def session(i: int) -> list[float]:
        # The tag keeps the two policies' runs from sharing cached prefixes.
        system = f"You are coding agent {tag}-{i}. Be brief."
        messages = [{"role": "system", "content": system}]
        times = []
        async with httpx.AsyncClient(timeout=300.0) as client:
            for t in range(args.turns):
                observation = " ".join(rng.choice(words) for _ in range(60))
                messages.append({"role": "user", "content": f"Turn {t}: {observation}"})
                took, reply = await ttft(client, url, messages, f"{tag}-{i}")
                messages.append({"role": "assistant", "content": reply})
                times.append(took)
        return times

    return await asyncio.gather(*(session(i) for i in range(args.sessions)))


def warm_up(url: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    httpx.post(url + "/v1/chat/completions", json=body, timeout=120.0).raise_for_status()


def stickiness(args: argparse.Namespace) -> None:
    workers = [
        real_worker(args.threads_per_worker, args.kv_cache_gb) for _ in range(args.real_workers)
    ]
    fronts: list[Proc] = []
    try:
        for w in workers:
            w.wait_ready()
            warm_up(w.url)  # the first forward pass of a fresh worker is slow
        urls = [w.url for w in workers]
        fronts = [router(urls, "session").wait_ready(), router(urls, "round-robin").wait_ready()]
        print(f"\n{'policy':<14}{'TTFT turn 1 ms':>16}{'TTFT turn N ms':>16}{'ratio':>8}")
        last: dict[str, float] = {}
        for name, front in zip(("session", "round-robin"), fronts, strict=True):
            per_session = asyncio.run(sessions_run(front.url, args, name))
            first = statistics.mean(s[0] for s in per_session)
            last[name] = statistics.mean(s[-1] for s in per_session)
            print(
                f"{name:<14}{first * 1e3:>16.1f}{last[name] * 1e3:>16.1f}{last[name] / first:>8.2f}"
            )
        print("goal for session: ratio <= 1.5")
        print(f"TTFT turn N, round-robin / session: {last['round-robin'] / last['session']:.2f}")
    finally:
        for p in [*fronts, *workers]:
            p.stop()


def main() -> None:
    args = parse_args()
    print(f"config: {vars(args)}  cpus={os.cpu_count()}")
    print(f"cpu: {cpu_description()}")
    quiet_gc()  # the load generator's collector pauses would land in both paths' tails
    if not args.no_overhead:
        overhead(args)
    if args.ttft:
        stickiness(args)


if __name__ == "__main__":
    main()
