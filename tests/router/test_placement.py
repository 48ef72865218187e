"""``router.placement``: the one placement decision, and the router and the simulator making
the same decisions for the same workload."""

from __future__ import annotations

import json

import pytest

from splitserve.router.config import RouterConfig
from splitserve.router.membership import Membership
from splitserve.router.metrics import RouterMetrics
from splitserve.router.placement import PlacementRules, Uncached, place, uncached_chars
from splitserve.router.policies import RequestInfo, make_policy
from splitserve.router.proxy import Proxy
from splitserve.router.timing import Timeline
from splitserve.router.upstream import Pool
from splitserve.router.worker import Worker
from splitserve.sim.cluster import Cluster
from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.hardware import get_hardware
from splitserve.sim.models import get_model
from splitserve.workload.sessions import AgenticConfig

D0, D1, P0 = (
    Worker("http://d0:1", "decode"),
    Worker("http://d1:1", "decode"),
    Worker("http://p0:1", "prefill"),
)
RULES = PlacementRules(disaggregate=True, remote_prefill_threshold=100, kv_peer_fetch=True)


def decide(home: Worker | None, uncached: Uncached, rules: PlacementRules = RULES, decode=(D0,)):
    least = make_policy("least-loaded")
    info = RequestInfo("s", None, 0)
    return place(info, decode, lambda d: (P0,), least, least, home, uncached, rules)


def test_on_its_home_a_turn_counts_only_what_follows_its_last_reply():
    assert decide(D0, Uncached(on_home=99, elsewhere=500)).prefill is None
    assert decide(D0, Uncached(on_home=100, elsewhere=500)).prefill is P0
    # off home nothing is cached: the whole prompt counts; and the home is named as peer
    off = decide(D1, Uncached(on_home=10, elsewhere=100))
    assert (off.decode, off.remote_prefill, off.prefill, off.peer) == (D0, True, P0, D1)


def test_no_remote_prefill_without_disaggregation_and_no_peer_without_peer_fetch():
    rules = PlacementRules(disaggregate=False, remote_prefill_threshold=0, kv_peer_fetch=False)
    d = decide(D1, Uncached(1000, 1000), rules)
    assert (d.decode, d.remote_prefill, d.prefill, d.peer) == (D0, False, None, None)


def test_an_unhealthy_home_is_not_named_and_no_candidate_is_no_decision():
    home = Worker("http://home:1", "decode", healthy=False)
    assert decide(home, Uncached(0, 0)).peer is None
    assert decide(None, Uncached(0, 0), decode=()) is None


def test_a_prefill_leg_wanted_with_no_prefill_worker_left_prefills_on_decode():
    least = make_policy("least-loaded")
    d = place(RequestInfo(), (D0,), lambda d: (), least, least, None, Uncached(500, 500), RULES)
    assert d.remote_prefill and d.prefill is None


def test_uncached_part_on_home_is_what_follows_the_last_assistant_message():
    body = {
        "messages": [
            {"role": "system", "content": "s" * 1000},
            {"role": "user", "content": "u" * 100},
            {"role": "assistant", "content": "a" * 50},
            {"role": "tool", "content": "t" * 30},
        ]
    }
    assert uncached_chars(body, on_home=True) == 30
    assert uncached_chars(body, on_home=False) == 1180
    assert uncached_chars({"prompt": "abc"}, on_home=True) == 3
    assert uncached_chars({"prompt": [[1, 2, 3]]}, on_home=True) == 12


def test_a_responses_request_counts_its_instructions_tools_and_input():
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    body = {
        "instructions": "i" * 40,
        "tools": tools,
        "input": [
            {"role": "user", "content": "u" * 100},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "a" * 20},
            {"type": "function_call_output", "call_id": "c", "output": "o" * 30},
            {"role": "user", "content": [{"type": "input_text", "text": "p" * 7}]},
        ],
    }
    want = 40 + len(json.dumps(tools)) + 100 + 20 + 30 + 7
    assert uncached_chars(body, on_home=True) == uncached_chars(body, on_home=False) == want
    assert uncached_chars({"input": "abc"}, on_home=False) == 3


# ---- one workload through the simulator and through the router -------------------------

PREFILL = ("http://127.0.0.1:9101", "http://127.0.0.1:9102")
DECODE = ("http://127.0.0.1:9201", "http://127.0.0.1:9202", "http://127.0.0.1:9203")


class RecordingCluster(Cluster):
    """The simulator, noting each decision with the loads the policies saw."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.decisions: list[tuple] = []

    def decide(self, req, new_tokens):
        loads = {w.router.url: w.router.in_flight for w in self.workers}
        d = super().decide(req, new_tokens)
        urls = tuple(None if w is None else w.url for w in (d.decode, d.prefill, d.peer))
        self.decisions.append(
            (req.session, req.turn, loads, (urls[0], d.remote_prefill, *urls[1:]))
        )
        return d


def chat_body(spec, turn: int) -> dict:
    """Turn ``turn`` of ``spec`` as a client sends it: each token four characters (the
    router's ``chars_per_token``), the replies the simulator produced in between."""
    messages = []
    for k in range(turn + 1):
        messages += [
            {"role": s.role, "content": "x" * 4 * len(s.token_ids)} for s in spec.turns[k].segments
        ]
        if k < turn:
            messages.append(
                {"role": "assistant", "content": "y" * 4 * len(spec.turns[k].output_ids)}
            )
    return {"model": "m", "messages": messages, "max_tokens": spec.turns[turn].output_len}


CASES = {
    # 2P:3D: remote prefills for long uncached parts, local ones at home
    "disaggregated": (Deployment(prefill=2, decode=3), dict(remote_prefill_threshold=200)),
    # 3 collocated, peer fetch: turns moved off a busy home name the home
    "collocated": (Deployment(collocated=3), dict(kv_peer_fetch=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_the_router_and_the_simulator_place_one_workload_alike(case):
    deployment, options = CASES[case]
    if deployment.collocated:
        roles = {"workers": list(DECODE)}
        urls = tuple((u, "both") for u in DECODE)
    else:
        roles = {"prefill": list(PREFILL), "decode": list(DECODE)}
        urls = tuple((u, "prefill") for u in PREFILL) + tuple((u, "decode") for u in DECODE)
    sim = SimConfig(
        get_model("llama3-8b"),
        get_hardware("h100"),
        max_num_seqs=8,
        max_num_batched_tokens=512,
        prefill_policy="least-loaded",
        worker_urls=urls,
        **options,
    )
    cluster = RecordingCluster(sim, deployment)
    cluster.run(AgenticConfig().sessions(40.0), limit=60)

    config = RouterConfig(
        **roles,
        prefill_policy="least-loaded",
        disaggregate=bool(deployment.prefill),
        load_factor=sim.load_factor,
        load_floor=sim.load_floor,
        **options,
    )
    membership = Membership(config.initial_workers())
    decode = make_policy("session", load_factor=sim.load_factor, load_floor=sim.load_floor)
    proxy = Proxy(
        config, membership, decode, make_policy("least-loaded"), Pool(), RouterMetrics(lambda r: 0)
    )
    routed = []
    for spec, turn, loads, _ in cluster.decisions:
        for url, in_flight in loads.items():
            membership.get(url).in_flight = in_flight
        forwarding = proxy._place(
            {"x-session-id": spec.session_id}, chat_body(spec, turn), Timeline(0.0, 0.0)
        )
        d = proxy._decide(forwarding)
        urls_ = tuple(None if w is None else w.url for w in (d.decode, d.prefill, d.peer))
        routed.append((urls_[0], d.remote_prefill, *urls_[1:]))

    simulated = [d for *_, d in cluster.decisions]
    assert len(simulated) > 200
    assert routed == simulated
    # the workload reaches every branch of the decision
    if deployment.prefill:
        assert {d[1] for d in simulated} == {True, False}
        assert len({d[0] for d in simulated}) == len(DECODE)
    else:
        assert any(d[3] is not None for d in simulated)


def test_router_serve_and_sim_take_the_same_placement_options():
    from splitserve.cli import build_parser

    flags = ["--policy", "prefix", "--load-factor", "2", "--load-floor", "3"]
    flags += ["--remote-prefill-threshold", "100", "--kv-peer-fetch"]
    parser = build_parser()
    parsed = [
        parser.parse_args(["router", "--decode", "http://d:1", *flags]),
        parser.parse_args(["serve", *flags]),
        parser.parse_args(["sim", *flags]),
    ]
    for args in parsed:
        got = (args.policy, args.load_factor, args.load_floor, args.remote_prefill_threshold)
        assert got + (args.kv_peer_fetch,) == ("prefix", 2.0, 3, 100, True)
    defaults = [parser.parse_args(["router", "--decode", "http://d:1"]), parser.parse_args(["sim"])]
    for args in defaults:
        assert (args.prefill_policy, args.remote_prefill_threshold) == ("prefix", 64)
        assert (args.load_factor, args.load_floor) == (1.25, 1)
