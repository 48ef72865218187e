"""Where a request's time goes in the router: its timeline and the phase histograms."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.router.timing import PHASE_NAMES, RECEIVED_KEY, Timeline

from .conftest import HTTP

pytestmark = pytest.mark.timeout(120)


def test_phases_are_the_gaps_between_reached_stamps():
    t = Timeline(received=1.0, handler=1.5, parsed=1.75, routed=2.0, headers=3.0)
    assert t.phases() == [
        ("queued", 0.5),
        ("parse", 0.25),
        ("route", 0.25),
        ("upstream_headers", 1.0),
    ]


def test_queued_needs_the_arrival_stamp():
    assert Timeline.of({"extensions": {RECEIVED_KEY: 1.0}}).received == 1.0
    unstamped = Timeline.of({})
    unstamped.parsed = unstamped.handler + 1
    assert [name for name, _ in unstamped.phases()] == ["parse"]


def phase_histograms(router) -> dict[str, tuple[float, float]]:
    """{phase: (count, sum)} from the router's /metrics."""
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(HTTP.get(router.url + "/metrics").text):
        if family.name != "splitserve:router_request_phase_seconds":
            continue
        for s in family.samples:
            entry = out.setdefault(s.labels["phase"], [0.0, 0.0])
            if s.name.endswith("_count"):
                entry[0] = s.value
            elif s.name.endswith("_sum"):
                entry[1] = s.value
    return {k: (c, total) for k, (c, total) in out.items()}


def test_a_streamed_request_is_timed_phase_by_phase(workers3, make_router):
    router = make_router(workers=[workers3[0].url])
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    with HTTP.stream("POST", router.url + "/v1/chat/completions", json=body) as r:
        assert r.read().endswith(b"data: [DONE]\n\n")
    phases = phase_histograms(router)
    assert {name for name, (count, _) in phases.items() if count == 1} == set(PHASE_NAMES)
    steps = sum(total for name, (_, total) in phases.items() if name != "total")
    assert math.isclose(steps, phases["total"][1], rel_tol=1e-9)
    assert phases["stream"][1] > 0 and phases["queued"][1] > 0


def test_a_buffered_request_has_no_stream_phase(workers3, make_router):
    router = make_router(workers=[workers3[0].url])
    r = HTTP.post(router.url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 200
    phases = phase_histograms(router)
    assert phases["stream"][0] == 0
    assert phases["first_write"][0] == phases["total"][0] == 1


def test_rejected_requests_are_not_timed(workers3, make_router):
    router = make_router(workers=[workers3[0].url], api_key="k")
    assert HTTP.post(router.url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert phase_histograms(router)["total"][0] == 0
