"""``splitserve bench`` options: parsed into workloads and loads; bad input is a clear
message and exit code 2, never a traceback."""

from __future__ import annotations

import pytest

from splitserve.bench.compare import serve_argv, stages_of
from splitserve.bench.deployments import DEPLOYMENTS, parse_deployments
from splitserve.cli import build_parser, main, serve_topology, serve_worker_args
from splitserve.cluster.serve import pool_workers
from splitserve.workload.args import loads_from_args, workload_from_args
from splitserve.workload.sessions import AgenticConfig, LogNormal, MultiRoundQAConfig


def _args(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_workload_options_reach_the_config_and_keep_other_defaults():
    wl = workload_from_args(
        _args("--rate", "1", "--tool-calls", "1,3", "--tool-pause", "0.5,0.2", "--seed", "4")
    )
    assert wl == AgenticConfig(
        min_tool_calls=1, max_tool_calls=3, tool_pause_s=LogNormal(0.5, 0.2), seed=4
    )
    qa = workload_from_args(_args("--workload", "multi-round-qa", "--rate", "1", "--rounds", "2"))
    assert qa == MultiRoundQAConfig(rounds=2)


def test_loads():
    sweep = loads_from_args(_args("--sweep", "0.5,1,2", "--duration", "10"))
    assert [ld.rate for ld in sweep] == [0.5, 1.0, 2.0] and sweep[0].duration_s == 10
    (closed,) = loads_from_args(_args("--concurrency", "3"))
    assert closed.concurrency == 3 and closed.rate is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rate", "1"], "give --url"),
        (["--url", "http://x"], "give the load"),
        (["--url", "http://x", "--rate", "0"], "rate must be > 0"),
        (["--url", "http://x", "--sweep", "1,fast"], "--sweep"),
        (["--url", "http://x", "--rate", "1", "--slo", "ttft:soon"], "SLO"),
        (["--url", "http://x", "--rate", "1", "--tool-calls", "3"], "--tool-calls"),
        (["--url", "http://x", "--rate", "1", "--tool-calls", "3,1"], "min_tool_calls"),
        (["--url", "http://x", "--rate", "1", "--workload", "azure"], "needs --trace"),
        (
            ["--url", "http://x", "--rate", "1", "--workload", "mooncake", "--trace", "/nope"],
            "not found",
        ),
        (["compare", "--rate", "1", "--deployments", "collocated-rr,warp"], "unknown deployment"),
        (["compare", "--rate", "1", "--deployments", "disagg", "--cores", "1"], "two workers"),
        (["compare", "--rate", "1", "--repeats", "0"], "--repeats must be >= 1"),
    ],
)
def test_bad_input_is_a_clear_error(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitserve bench: error:") and message in err


def test_deployments_share_the_cores_the_same_way():
    assert [d.name for d in parse_deployments("disagg, collocated-rr")] == [
        "disagg",
        "collocated-rr",
    ]
    for dep in DEPLOYMENTS.values():
        prefill, decode = dep.pools(4)
        if dep.front == "none":  # one worker given the cores
            assert (prefill, decode) == (0, 1)
            continue
        assert prefill + decode == 4 and (prefill > 0) == dep.disaggregated
    argv = serve_argv(DEPLOYMENTS["collocated-rr"], 2, 1, 8123)
    assert argv[3:] == [
        "serve",
        "--port",
        "8123",
        "--prefill",
        "0",
        "--decode",
        "2",
        "--threads-per-worker",
        "1",
        "--policy",
        "round-robin",
    ]


def test_every_deployment_is_a_valid_serve_command():
    from splitserve.cli import build_parser, serve_worker_args

    for dep in DEPLOYMENTS.values():
        if dep.front != "splitserve":
            continue
        argv = serve_argv(dep, 2, 1, 8123)
        args = build_parser().parse_args(argv[argv.index("serve") :])
        assert args.decode + args.prefill == 2, dep.name
    sjf = build_parser().parse_args(
        serve_argv(DEPLOYMENTS["collocated-session-tiers-sjf"], 2, 1, 8123)[3:]
    )
    assert "shortest-prefill" in serve_worker_args(sjf) and sjf.host_kv_gb == 2.0
    peer = build_parser().parse_args(
        serve_argv(DEPLOYMENTS["collocated-session-tiers-peer"], 2, 1, 8123)[3:]
    )
    assert peer.kv_peer_fetch and peer.host_kv_gb == 2.0 and peer.policy == "session"


def test_vllm_deployments_start_the_processes_a_user_would_run(monkeypatch):
    def last_argv(name: str) -> list[str]:
        stages = stages_of(parse_deployments(name)[0], 2, 1, 8123, "k")
        return stages[-1].workers[0].argv

    single = build_parser().parse_args(last_argv("vllm-single")[3:])
    assert (single.command, single.engine, single.threads) == ("worker", "vllm", None)
    assert build_parser().parse_args(last_argv("vllm-single-all")[3:]).threads == 2
    session = build_parser().parse_args(last_argv("vllm-session")[3:])
    assert (session.engine, session.decode, session.policy) == ("vllm", 2, "session")
    disagg = build_parser().parse_args(last_argv("vllm-disagg")[3:])
    assert (disagg.engine, disagg.prefill, disagg.decode) == ("vllm", 1, 1)
    assert (disagg.policy, disagg.threads_per_worker) == ("session", 1)
    pool = pool_workers("127.0.0.1", None, serve_worker_args(disagg), {}, serve_topology(disagg))
    p, d = (build_parser().parse_args(w.argv[3:]) for w in pool)
    assert (p.role, d.role, p.engine, d.engine) == ("prefill", "decode", "vllm", "vllm")
    assert p.cpus != d.cpus and p.kv_port != d.kv_port  # own core, own NIXL side channel
    monkeypatch.setattr(
        "splitserve.cluster.vllm_router.find_vllm_router", lambda explicit=None: "/bin/vr"
    )
    stages = stages_of(parse_deployments("vllm-router:cache_aware")[0], 2, 1, 8123, "k")
    workers, (router,) = stages[0].workers, stages[1].workers
    assert router.argv[0] == "/bin/vr" and "cache_aware" in router.argv
    assert [w.url for w in workers] == router.argv[
        router.argv.index("--worker-urls") + 1 : router.argv.index("--worker-urls") + 3
    ]
    parsed = [build_parser().parse_args(w.argv[3:]) for w in workers]
    assert len({w.cpus for w in parsed}) == 2  # a core each
    assert all(w.role == "both" for w in parsed)  # whole requests: no KV connector
    with pytest.raises(ValueError, match="unknown vllm-router policy 'nope'"):
        parse_deployments("vllm-router:nope")
