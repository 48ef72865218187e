"""Simulated clusters: conservation, determinism, and bulk decode equal to exact stepping."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.sim.cluster import Cluster
from splitserve.sim.cost_model import StepShape
from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.hardware import get_hardware
from splitserve.sim.models import get_model
from splitserve.sim.run import simulate
from splitserve.workload.sessions import AgenticConfig, RandomConfig, Segment, SessionSpec, TurnSpec
from tests.sim.helpers import COLLOCATED, DISAGG, config, run


def timings(records):
    return {(r.session_id, r.turn): (r.ok, r.ttft_s, r.e2e_s, r.cached_tokens) for r in records}


@pytest.mark.parametrize("dep", [COLLOCATED, DISAGG], ids=["collocated", "disagg"])
@pytest.mark.parametrize("kv_gb", [None, 0.5], ids=["roomy", "preempting"])
def test_bulk_decode_gives_the_timings_of_exact_stepping(dep, kv_gb):
    workload = AgenticConfig(seed=3)
    fast_cluster, fast = run(config(kv_cache_gb=kv_gb), dep, workload, 20.0, 60)
    exact_cluster, exact = run(config(kv_cache_gb=kv_gb, exact=True), dep, workload, 20.0, 60)
    a, b = timings(fast), timings(exact)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key][0] == b[key][0] and a[key][3] == b[key][3], key
        assert a[key][1] == pytest.approx(b[key][1], rel=1e-9), key
        assert a[key][2] == pytest.approx(b[key][2], rel=1e-9), key
    preemptions = [
        sum(w.engine.scheduler.num_preemptions for w in c.workers)
        for c in (fast_cluster, exact_cluster)
    ]
    assert preemptions[0] == preemptions[1]
    assert (preemptions[0] > 0) == (kv_gb is not None)  # the small pool really preempts
    # Bulk decoding is the point: far fewer engine events than steps taken.
    assert sum(w.steps for w in fast_cluster.workers) < sum(w.steps for w in exact_cluster.workers)


def test_decode_runs_cut_by_kv_pulls_keep_the_per_token_timings_of_exact_stepping():
    """Disaggregated, the decode worker's runs of decode steps are cut short by the KV
    pulls' engine calls and by admissions; every request's TTFT, inter-token gaps (TPOT),
    E2E, cached tokens and the goodput stay those of stepping one step at a time."""
    workload = AgenticConfig(seed=5)
    dep = Deployment(prefill=1, decode=1)
    fast_cluster, fast = run(config(record_itl=True), dep, workload, 12.0, 50)
    exact_cluster, exact = run(config(record_itl=True, exact=True), dep, workload, 12.0, 50)
    assert fast_cluster.stats.remote_prefills > 100
    a = {(r.session_id, r.turn): r for r in fast}
    b = {(r.session_id, r.turn): r for r in exact}
    assert a.keys() == b.keys() and all(r.ok for r in fast)
    for key, r in a.items():
        e = b[key]
        assert (r.output_tokens, r.cached_tokens) == (e.output_tokens, e.cached_tokens), key
        assert [r.ttft_s, r.e2e_s] == pytest.approx([e.ttft_s, e.e2e_s], rel=1e-9), key
        assert r.itl_s == pytest.approx(e.itl_s, rel=1e-9), key
    slo = dict(ttft_s=0.036, tpot_s=0.008)  # about the medians: the SLO splits the requests
    assert 0 < goodput(fast, **slo) == goodput(exact, **slo) < len(fast)
    decode = [w for w in fast_cluster.workers if w in fast_cluster.decode_pool]
    assert sum(w.steps for w in decode) < sum(w.engine.steps for w in decode) / 2  # in bulk


def test_kv_pull_engine_calls_run_while_the_decode_worker_computes():
    """The real decode worker looks a pulled prompt's blocks up, reserves and registers them
    with ``call_now``: under the engine's lock while a model run is in progress, not after
    it. A worker decoding a long reply in bulk: such a call made mid-step runs at once and
    cuts the run after the step in progress; one that could take blocks the run still needs
    waits for the step boundary, as a plain engine call does."""
    cluster = Cluster(config(), Deployment(collocated=1))
    (w,) = cluster.workers
    (spec,) = itertools.islice(RandomConfig(100, 1000, seed=3).sessions(1.0), 1)
    seen = []

    def probe(blocks: int):
        def fire(_) -> None:
            asked, in_run = cluster.now, w.engine.in_run
            cluster.on_engine_now(w, lambda: seen.append((asked, cluster.now, in_run)), blocks)

        return fire

    cluster.events.at(spec.arrival_s + 1.0, probe(0))
    cluster.events.at(spec.arrival_s + 2.0, probe(10**9))  # more than the pool holds
    (record,) = cluster.run(iter([spec]))
    assert record.ok and record.e2e_s > 3.0  # still decoding when both calls came
    (asked, ran, in_run), (asked2, ran2, in_run2) = seen
    assert in_run and in_run2  # both came in the middle of a run of decode steps
    assert ran == asked
    assert asked2 < ran2 < asked2 + 0.05  # the step in progress ended first


def goodput(records, ttft_s: float, tpot_s: float) -> int:
    return sum(
        r.ok and r.ttft_s <= ttft_s and (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) <= tpot_s
        for r in records
    )


@pytest.mark.parametrize("dep", [COLLOCATED, DISAGG], ids=["collocated", "disagg"])
def test_every_request_completes_or_is_counted_rejected(dep):
    # A 0.25 GiB pool holds 2048 tokens: longer agentic turns are rejected, the rest preempt.
    workload = AgenticConfig(seed=1, system_tokens=1200, min_tool_calls=3, max_tool_calls=8)
    sessions = list(itertools.islice(workload.sessions(30.0), 80))
    cluster = Cluster(config(kv_cache_gb=0.25), dep)
    records = cluster.run(iter(sessions))
    by_session = {s.session_id: s for s in sessions}
    sent = {}
    for r in records:
        sent.setdefault(r.session_id, []).append(r)
    assert set(sent) == set(by_session)
    rejected = 0
    for sid, rs in sent.items():
        rs.sort(key=lambda r: r.turn)
        spec = by_session[sid]
        assert [r.turn for r in rs] == list(range(len(rs)))
        for r in rs:
            if r.ok:  # the whole reply, or cut at the context limit as the engine does
                full = r.output_tokens == spec.turns[r.turn].output_len
                assert full or r.prompt_tokens + r.output_tokens == cluster.max_model_len
                assert r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s
            else:
                assert "maximum model length" in r.error
                rejected += 1
        # A session stops at its first rejected turn, else it ran every turn.
        assert len(rs) == len(spec.turns) or not rs[-1].ok
    assert 0 < rejected < len(records)
    assert not cluster.requests and not cluster.outputs and not cluster._contexts
    for w in cluster.workers:  # every block back in the pool, no lease left behind
        assert w.engine.block_manager.num_free_blocks == cluster.num_blocks
        assert w.router.in_flight == 0 and not w.engine.scheduler.has_unfinished()


def test_same_seed_same_run_other_seed_other_run():
    def once(seed):
        _, records = run(config(), DISAGG, AgenticConfig(seed=seed), 10.0, 40)
        return [r.to_dict() for r in records]

    assert once(0) == once(0)
    assert once(0) != once(1)


# Two prefill workers, so that the prefix key places the prefills; RandomConfig's sessions
# are not sticky, so that it places the decodes too.
_HASH_SEED_RUN = """
from splitserve.sim.deployment import Deployment
from splitserve.workload.sessions import AgenticConfig, RandomConfig
from tests.sim.helpers import config, run
for workload in (AgenticConfig(seed=0), RandomConfig(seed=0)):
    _, records = run(config(), Deployment(prefill=2, decode=2), workload, 10.0, 40)
    print([r.to_dict() for r in records])
"""


def test_a_run_is_the_same_under_any_python_hash_seed():
    """Regression: the simulator named prefixes with Python's ``hash()``, which a
    ``PYTHONHASHSEED`` may change (for strings and bytes); every key is a stable digest."""
    root = Path(__file__).resolve().parents[2]
    path = [p for p in (os.environ.get("PYTHONPATH"), str(root)) if p]  # a compiled build's
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    outs = [
        subprocess.run(
            [sys.executable, "-c", _HASH_SEED_RUN],
            env={**env, "PYTHONHASHSEED": seed},
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        for seed in ("1", "2")
    ]
    assert outs[0] == outs[1] and outs[0].count("\n") == 2


def test_disaggregated_requests_pay_the_transfer_and_reuse_session_caches():
    workload = AgenticConfig(seed=0)
    cluster, records = run(config(), DISAGG, workload, 5.0, 30)
    assert all(r.ok for r in records)
    assert cluster.stats.remote_prefills > 0 and cluster.stats.kv_blocks_moved > 0
    # Later turns land on their session's decode worker, which holds the earlier context.
    later = [r for r in records if r.turn > 0]
    assert sum(r.cached_tokens for r in later) > 0.8 * sum(r.prompt_tokens for r in later)


def test_random_requests_in_a_light_load_see_the_bare_step_times():
    # One request at a time on one collocated worker: TTFT is its prefill step exactly.
    cfg = config(max_num_batched_tokens=4096)
    cluster, records = run(cfg, Deployment(collocated=1), RandomConfig(1000, 8), 0.01, 3)
    prefill = cluster.cost.step_time(StepShape(1000, 1, 1000 * 1001 / 2, 1000, 1))
    for r in records:
        assert r.ttft_s == pytest.approx(prefill, rel=1e-12)
        decode = sum(
            cluster.cost.step_time(StepShape(1, 1, 1001 + k, 1001 + k, 1)) for k in range(7)
        )
        assert r.e2e_s == pytest.approx(prefill + decode, rel=1e-9)
    assert not math.isnan(records[0].e2e_s)


@pytest.mark.parametrize("dep", [COLLOCATED, DISAGG], ids=["collocated", "disagg"])
def test_inter_token_gaps_are_the_steps_each_request_took_part_in(dep):
    cluster, records = run(config(record_itl=True), dep, AgenticConfig(seed=2), 20.0, 40)
    checked = 0
    for r in records:
        if r.itl_s:
            assert len(r.itl_s) == r.output_tokens - 1
            assert sum(r.itl_s) == pytest.approx(r.e2e_s - r.ttft_s, rel=1e-9)
            checked += 1
    assert checked > 0.9 * len(records)


def test_a_run_leaves_what_it_made_to_the_oldest_collector_generation():
    # Regression: objects made while the collector was paused all counted as young, so the
    # first collection after a run scanned every one of them (seconds at scale). The
    # collector stays off here so that no collection moves them before they are looked at.
    import gc

    gc.disable()
    try:
        _, records = run(config(), DISAGG, AgenticConfig(seed=0), 10.0, 40)
        oldest = {id(o) for o in gc.get_objects(generation=2)}
    finally:
        gc.enable()
    assert id(records) in oldest and all(id(r) in oldest for r in records)


def test_shortest_prefill_admission_starts_more_turns_quickly_under_a_burst():
    # One worker past its knee: the real scheduler's shortest-prefill order lets returning
    # turns (short uncached parts) go before new sessions, as on a real worker.
    def ttfts(policy):
        cfg = config(scheduling_policy=policy, max_num_batched_tokens=2048)
        _, records = run(cfg, Deployment(collocated=1), AgenticConfig(seed=0), 40.0, 300)
        assert all(r.ok for r in records)
        return sorted(r.ttft_s for r in records)

    fcfs, sjf = ttfts("fcfs"), ttfts("shortest-prefill")
    assert len(fcfs) == len(sjf)
    assert sum(t < 0.5 for t in sjf) > 1.2 * sum(t < 0.5 for t in fcfs)
    assert sjf[len(sjf) // 2] < 0.5 * fcfs[len(fcfs) // 2]


def test_a_load_floor_keeps_more_turns_home_and_their_context_cached():
    cached = []
    for floor in (1, 2, 4):
        cluster, records = run(
            config(load_floor=floor), Deployment(collocated=4), AgenticConfig(seed=0), 5.0, 300
        )
        assert cluster.decode_policy.load_floor == floor
        cached.append(sum(r.cached_tokens for r in records))
    assert cached[0] < cached[1] < cached[2]


def test_bad_scheduling_and_load_settings_are_clear_errors():
    with pytest.raises(ValueError, match="scheduling policy must be one of .*, got 'lifo'"):
        config(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="load_factor and load_floor must be >= 1"):
        config(load_floor=0)


def _one_prefill_sessions(arrivals: list[float], prompt_len: int) -> list[SessionSpec]:
    """Single-turn sessions of one ``prompt_len`` prompt and one output token each."""
    return [
        SessionSpec(
            f"s{i}",
            t,
            0,
            (TurnSpec(0.0, (Segment("prompt", tuple(range(i, i + prompt_len))),), 1, (7,)),),
        )
        for i, t in enumerate(arrivals)
    ]


@pytest.mark.parametrize(
    ("cores", "second_at", "ttfts"),
    [
        (2, 0.0, (1.0, 1.0)),  # a core each
        (1, 0.0, (2.0, 2.0)),  # one core, shared from the start
        (1, 0.5, (1.5, 1.5)),  # half alone, then shared: each ends half a prefill later
    ],
)
def test_workers_on_shared_cores_share_them_evenly(cores, second_at, ttfts):
    # Two workers each prefill a 1,000-token prompt (p seconds alone). Under processor
    # sharing the first, alone for second_at * p, does the rest at half speed until done at
    # 1.5p; the second does half its work by then and the rest alone, ending at 2p.
    cfg = config(max_num_batched_tokens=4096, policy="round-robin", host_cores=cores)
    cluster = Cluster(cfg, COLLOCATED)
    p = cluster.cost.step_time(StepShape(1000, 1, 1000 * 1001 / 2, 1000, 1))
    records = cluster.run(iter(_one_prefill_sessions([0.0, second_at * p], 1000)))
    got = sorted(r.ttft_s / p for r in records)
    assert got == pytest.approx(list(ttfts), rel=1e-9)
    assert [w.busy_s / p for w in cluster.workers] == pytest.approx(list(ttfts), rel=1e-9)
    assert [w.engine_s / p for w in cluster.workers] == pytest.approx([1.0, 1.0], rel=1e-9)


@pytest.mark.parametrize(
    ("second_at", "ttfts"),
    [
        (0.0, (1.25, 1.25)),  # two engines at once: each 1.25x slower
        (0.5, (1.125, 1.125)),  # the first: 0.5 alone + 0.5 at 1.25x; the second the mirror
    ],
)
def test_engines_computing_at_once_slow_each_other_by_the_measured_factor(second_at, ttfts):
    hw = get_hardware("h100").with_fit(co_run_slowdown=0.25)
    cfg = SimConfig(
        get_model("llama3-8b"), hw, max_num_batched_tokens=4096, policy="round-robin", host_cores=2
    )
    cluster = Cluster(cfg, COLLOCATED)
    p = cluster.cost.step_time(StepShape(1000, 1, 1000 * 1001 / 2, 1000, 1))
    records = cluster.run(iter(_one_prefill_sessions([0.0, second_at * p], 1000)))
    assert sorted(r.ttft_s / p for r in records) == pytest.approx(list(ttfts), rel=1e-9)


@pytest.mark.parametrize(
    ("cores", "per_request", "per_token", "arrivals", "ttfts"),
    [
        # One core; half a prefill of serving work arrives with the request: both at half
        # speed until it is done (after one prefill of wall time), then the prefill's other
        # half alone.
        (1, 0.5, 0.0, (0.0,), (1.5,)),
        (1, 2.0, 0.0, (0.0,), (2.0,)),  # the backlog outlasts the prefill: half speed all along
        (2, 0.5, 0.0, (0.0,), (1.0,)),  # a core for each: no slowdown
        # The first request's one token leaves a prefill of serving work when it ends (at 1);
        # the second arrives at 1.5 with half of it left: half speed for one prefill of wall
        # time, then alone.
        (1, 0.0, 1.0, (0.0, 1.5), (1.0, 1.5)),
    ],
)
def test_serving_work_shares_the_cores_with_the_workers(
    cores, per_request, per_token, arrivals, ttfts
):
    p = Cluster(config(), COLLOCATED).cost.step_time(StepShape(1000, 1, 1000 * 1001 / 2, 1000, 1))
    hw = get_hardware("h100").with_fit(
        serving_cpu_per_request_s=per_request * p, serving_cpu_per_token_s=per_token * p
    )
    cfg = SimConfig(get_model("llama3-8b"), hw, max_num_batched_tokens=4096, host_cores=cores)
    cluster = Cluster(cfg, Deployment(collocated=1))
    records = cluster.run(iter(_one_prefill_sessions([a * p for a in arrivals], 1000)))
    assert [r.ttft_s / p for r in records] == pytest.approx(list(ttfts), rel=1e-9)
    assert cluster.cores is not None and cluster.cores.backlog == 0.0
    (w,) = cluster.workers  # its steps' wall time, and the engine seconds within it
    assert (w.busy_s / p, w.engine_s / p) == pytest.approx((sum(ttfts), len(arrivals)))
    assert cluster.cores.serving_s == pytest.approx((per_request + per_token) * p * len(arrivals))


MODEL, FOUR = get_model("llama3-8b"), Deployment(collocated=4)


def test_shared_cores_slow_a_busy_cluster_and_lose_no_request():
    workload = AgenticConfig(seed=0)
    own, shared = (
        run(config(host_cores=cores), Deployment(collocated=4), workload, 8.0, 40)
        for cores in (None, 2)
    )
    assert len(own[1]) == len(shared[1]) and all(r.ok for r in shared[1])
    assert mean_e2e(shared[1]) > 1.2 * mean_e2e(own[1])
    # Serving work on the same cores slows it further; it all gets done, none is lost.
    hw = get_hardware("h100").with_fit(serving_cpu_per_request_s=0.05, serving_cpu_per_token_s=0.01)
    without, result = (
        simulate(SimConfig(MODEL, h, max_num_seqs=32, host_cores=2), FOUR, workload, 8.0, 5.0)
        for h in (get_hardware("h100"), hw)
    )
    records = result.records
    assert len(records) == len(without.records) and all(r.ok for r in records)
    assert mean_e2e(records) > mean_e2e(without.records) and result.cluster.cores.backlog == 0.0
    serving = 0.05 * len(records) + 0.01 * sum(r.output_tokens for r in records)
    assert result.summary.server["serving CPU on the shared cores (s)"] == pytest.approx(serving)
    with pytest.raises(ValueError, match="host_cores must be >= 1"):
        config(host_cores=0)


def mean_e2e(records) -> float:
    return sum(r.e2e_s for r in records) / len(records)


def test_a_request_overhead_adds_to_every_ttft_exactly():
    # One request at a time: TTFT is the way in plus the bare prefill step.
    hw = get_hardware("h100").with_fit(request_overhead_s=0.05)
    cfg = SimConfig(get_model("llama3-8b"), hw, max_num_seqs=32, max_num_batched_tokens=4096)
    cluster = Cluster(cfg, Deployment(collocated=1))
    records = cluster.run(RandomConfig(1000, 8).sessions(0.01), limit=3)
    prefill = cluster.cost.step_time(StepShape(1000, 1, 1000 * 1001 / 2, 1000, 1))
    assert [r.ttft_s for r in records] == pytest.approx([0.05 + prefill] * 3, rel=1e-12)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "plain"])
def test_sessions_with_one_opening_share_its_blocks_hashed_as_from_scratch(chat):
    """A session's chain starts as its first message's shared chain: the hashes and tokens a
    chain of its own prompt would have, and for the sessions of one agent type (one system
    prompt) the very same token tuples."""
    from splitserve.common.kv_hash import BlockChain
    from splitserve.sim.chat import append_prompt

    cfg = config(chat_template=chat, block_size=16)
    cluster = Cluster(cfg, DISAGG)
    specs = list(itertools.islice(AgenticConfig(seed=4).sessions(2.0), 12))
    chains = {}
    for spec in specs:
        opening = cluster._opening(spec)
        prompt: list[int] = []
        append_prompt(prompt, spec.turns[0].segments, chat)
        own = BlockChain(cluster.root, cfg.block_size)
        own.extend(prompt, len(opening))
        assert len(opening) >= 384 // 16  # the system prompt's full blocks at least
        assert opening.hashes == own.hashes and opening.tokens == own.tokens
        chains.setdefault(spec.agent_type, []).append(opening)
    assert len(cluster._openings) == len(chains) > 1
    for same_type in chains.values():
        assert all(c.tokens[0] is same_type[0].tokens[0] for c in same_type)


def test_shared_openings_leave_a_run_as_it_was(monkeypatch):
    """The same records with no opening kept (every session hashing its own chain)."""
    from splitserve.sim import cluster as cluster_module

    cfg = config(block_size=16, kv_cache_gb=0.5)
    shared_cluster, shared = run(cfg, DISAGG, AgenticConfig(seed=6), 8.0, 40)
    monkeypatch.setattr(cluster_module, "MAX_OPENINGS", 0)
    own_cluster, own = run(cfg, DISAGG, AgenticConfig(seed=6), 8.0, 40)
    assert len(shared_cluster._openings) > 1 and not own_cluster._openings
    assert [r.to_dict() for r in shared] == [r.to_dict() for r in own]


def test_workers_named_after_real_ones_get_the_sessions_the_real_router_would_give_them():
    from splitserve.router.policies import RequestInfo
    from splitserve.router.worker import Worker

    urls = tuple((f"http://127.0.0.1:{port}", "both") for port in (40001, 40117, 51234, 60009))
    cfg = config(worker_urls=urls)
    sessions = AgenticConfig(seed=3, min_tool_calls=0, max_tool_calls=0).sessions(0.5)
    specs = list(itertools.islice(sessions, 12))
    homes = set()
    for spec in specs:  # one session at a time, on a fresh cluster: the ring alone places it
        cluster = Cluster(cfg, Deployment(collocated=4))
        (record,) = cluster.run(iter([spec]))
        assert record.ok
        (served,) = [w for w in cluster.workers if w.steps]
        # The router's own policy over real workers of the same URLs, as `serve` starts them.
        policy = cfg.routing_policy("session")
        real = [Worker(url, "decode") for url, _ in urls]
        home = policy.select_worker(real, RequestInfo(spec.session_id, "", 100))
        assert served.router.url == home.url
        homes.add(home.url)
    assert len(homes) > 1  # the sessions spread: the names decide, not the order
    with pytest.raises(ValueError, match="worker_urls name 4 both workers; the deployment has 2"):
        Cluster(cfg, Deployment(collocated=2))
