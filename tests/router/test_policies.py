"""Routing policies behind one interface, chosen by name, deterministic across replicas."""

from __future__ import annotations

import pytest

from splitserve.router.policies import POLICIES, RequestInfo, make_policy
from splitserve.router.worker import LoadReport, Worker, healthy_workers

URLS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"]


def pool(*loads: int) -> list[Worker]:
    return [
        Worker(u, "decode", report=LoadReport(running=n)) for u, n in zip(URLS, loads, strict=False)
    ]


def test_registry_names():
    assert sorted(POLICIES) == ["kv-events", "least-loaded", "prefix", "round-robin", "session"]
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        make_policy("nope")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_returns_none_without_workers(name):
    assert make_policy(name).select_worker([], RequestInfo("s", "p")) is None


def test_session_policy_is_sticky_while_balanced():
    policy, workers = make_policy("session"), pool(0, 0, 0)
    info = RequestInfo(session_key="agent-1")
    first = policy.select_worker(workers, info)
    assert all(policy.select_worker(workers, info) is first for _ in range(10))
    assert policy.home_worker(workers, info) is first


def test_session_policy_spills_when_home_is_over_the_bound():
    policy, workers = make_policy("session"), pool(0, 0, 0)
    info = RequestInfo(session_key="agent-1")
    home = policy.select_worker(workers, info)
    home.report = LoadReport(running=4)  # cap = ceil(1.25 * 5 / 3) = 3
    other = policy.select_worker(workers, info)
    assert other is not home
    assert policy.home_worker(workers, info) is home


def test_hot_session_cannot_push_its_worker_over_the_bound_and_others_keep_homes():
    policy, workers = make_policy("session"), pool(0, 0, 0)
    homes = {k: policy.select_worker(workers, RequestInfo(k)).url for k in ("a", "b", "c", "d")}
    hot = RequestInfo("hot")
    for _ in range(30):  # 30 concurrent requests of one session, none finishes
        policy.select_worker(workers, hot).in_flight += 1
    assert max(w.load for w in workers) <= 13  # ceil(1.25 * 30 / 3)
    assert min(w.load for w in workers) >= 1  # the excess went elsewhere
    # Balanced again: every normal session is back home.
    for w in workers:
        w.in_flight = 0
    assert {k: policy.select_worker(workers, RequestInfo(k)).url for k in homes} == homes


def test_session_policy_without_key_picks_least_loaded():
    assert make_policy("session").select_worker(pool(3, 1, 2), RequestInfo()).url == URLS[1]


def test_session_policy_rejects_a_load_factor_below_one():
    with pytest.raises(ValueError, match="load_factor must be >= 1"):
        make_policy("session", load_factor=0.9)
    with pytest.raises(ValueError, match="load_floor must be >= 1"):
        make_policy("session", load_floor=0)


def test_session_policy_with_a_load_floor_queues_a_turn_at_home_behind_one_request():
    plain, floored, workers = (
        make_policy("session"),
        make_policy("session", load_floor=2),
        pool(0, 0, 0, 0),
    )
    info = RequestInfo(session_key="agent-1")
    home = plain.select_worker(workers, info)
    home.in_flight = 1  # the only request in the pool: cap = ceil(1.25 * 2 / 4) = 1
    assert plain.select_worker(workers, info) is not home
    assert floored.select_worker(workers, info) is home
    home.in_flight = 2
    assert floored.select_worker(workers, info) is not home


def test_unhealthy_worker_moves_only_its_sessions():
    policy, workers = make_policy("session"), pool(0, 0, 0)
    keys = [f"s{i}" for i in range(300)]
    before = {k: policy.select_worker(workers, RequestInfo(k)).url for k in keys}
    workers[1].healthy = False
    live = healthy_workers(workers)
    after = {k: policy.select_worker(live, RequestInfo(k)).url for k in keys}
    assert {k for k in keys if before[k] != after[k]} == {k for k in keys if before[k] == URLS[1]}


def test_two_replicas_place_200_sessions_identically():
    a, b = make_policy("session"), make_policy("session")
    wa, wb = pool(0, 0, 0), list(reversed(pool(0, 0, 0)))  # same workers, other order
    keys = [f"session-{i}" for i in range(200)]
    pa = [a.select_worker(wa, RequestInfo(k)).url for k in keys]
    pb = [b.select_worker(wb, RequestInfo(k)).url for k in keys]
    assert pa == pb
    assert len(set(pa)) == 3


def test_prefix_policy_prefers_least_loaded():
    policy = make_policy("prefix")
    assert policy.select_worker(pool(2, 0, 1), RequestInfo(prefix_key="sys")).url == URLS[1]


def test_prefix_policy_breaks_ties_toward_the_prefix_owner():
    policy, workers = make_policy("prefix"), pool(0, 0, 0)
    owners = {policy.home_worker(workers, RequestInfo(prefix_key=f"p{i}")).url for i in range(30)}
    assert len(owners) > 1  # prefixes spread over workers
    for i in range(30):
        info = RequestInfo(prefix_key=f"p{i}")
        assert policy.select_worker(workers, info) is policy.home_worker(workers, info)


def test_prefix_policy_slack_widens_the_tie():
    workers = pool(0, 0, 0)
    info = RequestInfo(prefix_key="sys")
    owner = make_policy("prefix").home_worker(workers, info)
    owner.report = LoadReport(running=1)
    assert make_policy("prefix").select_worker(workers, info) is not owner
    assert make_policy("prefix", slack=1).select_worker(workers, info) is owner


def test_least_loaded_counts_in_flight_and_breaks_ties_by_url():
    workers = pool(1, 1, 1)
    workers[0].in_flight = 2
    assert make_policy("least-loaded").select_worker(workers, RequestInfo()).url == URLS[1]


def test_round_robin_cycles_in_url_order():
    policy = make_policy("round-robin")
    workers = list(reversed(pool(0, 0, 0)))
    assert [policy.select_worker(workers, RequestInfo()).url for _ in range(4)] == [
        URLS[0],
        URLS[1],
        URLS[2],
        URLS[0],
    ]


def test_worker_role_and_url_normalization():
    w = Worker("127.0.0.1:9001/", "both")
    assert w.url == "http://127.0.0.1:9001"
    assert w.serves("prefill") and w.serves("decode")
    assert not Worker("http://x", "prefill").serves("decode")
    with pytest.raises(ValueError, match="worker role"):
        Worker("http://x", "primary")


def test_stale_report_of_own_finished_request_does_not_push_a_session_away():
    # Regression: sequential turns spilled off home (149 of 250 stayed) because the last
    # /load report still counted this router's own, already finished, request.
    policy, workers = make_policy("session"), pool(0, 0, 0)
    info = RequestInfo(session_key="agent-1")
    home = policy.select_worker(workers, info)
    home.report, home.report_own = LoadReport(running=1), 1  # probed while our turn ran
    assert home.load == 0
    assert policy.select_worker(workers, info) is home


def test_load_counts_other_routers_requests_once():
    w = Worker("http://x", report=LoadReport(running=3, waiting=1), report_own=1, in_flight=2)
    assert w.load == 2 + 3  # own now + others (4 reported - 1 own)


@pytest.mark.parametrize("name", ["session", "prefix"])
def test_ring_follows_candidates_that_change_between_calls(name):
    # The ring skips its resync while the candidates are the same workers; a worker that
    # leaves, comes back, or is replaced by a new object under its URL must still count.
    policy, workers = make_policy(name), pool(0, 0, 0)
    info = RequestInfo(session_key="agent-1", prefix_key="agent-1")
    home = policy.home_worker(workers, info)
    rest = [w for w in workers if w is not home]
    assert policy.select_worker(rest, info) in rest
    assert policy.home_worker(rest, info) in rest
    assert policy.home_worker(workers, info) is home
    replaced = [Worker(w.url, "decode") if w is home else w for w in workers]
    assert policy.home_worker(replaced, info).url == home.url
    assert policy.home_worker(replaced, info) is not home


def test_load_follows_in_flight_and_reports():
    w = Worker("http://x")
    w.in_flight += 2
    assert w.load == 2
    w.report = LoadReport(running=4)
    w.report_own = 1
    assert w.load == 2 + 3
    w.in_flight -= 2
    assert w.load == 3


def test_a_watched_load_map_follows_the_worker_until_unwatched():
    w, loads = Worker("http://x"), {}
    w.watch(loads)
    assert loads == {"http://x": 0}
    w.in_flight += 1
    w.report = LoadReport(waiting=2)
    assert loads == {"http://x": 3}
    w.unwatch(loads)
    w.in_flight -= 1
    assert loads == {"http://x": 3} and w.load == 2


def test_prefix_policy_sees_load_changes_between_calls_on_the_same_candidates():
    policy, workers = make_policy("prefix"), pool(0, 0, 0)
    info = RequestInfo(prefix_key="system-a")
    owner = policy.select_worker(workers, info)
    owner.in_flight += 1  # no longer among the least loaded: the next tied one takes it
    assert policy.select_worker(workers, info) is not owner
    owner.in_flight -= 1
    assert policy.select_worker(workers, info) is owner
