"""The event queue: events run in order of (time, scheduling order), as a heap of
(time, sequence number) tuples orders them."""

from __future__ import annotations

import random

from splitserve.sim.events import EventQueue


def test_ties_run_in_scheduling_order_and_events_for_now_run_after_those_due():
    q, ran = EventQueue(), []

    def note(x):
        ran.append((q.now, x))
        if x == "b":
            q.at(q.now, note, "b-now")  # joins the end of the events due now
            q.at(q.now - 1.0, note, "b-past")  # never before now
            q.at(q.now + 1.0, note, "b-later")

    for t, x in [(2.0, "a"), (1.0, "b"), (2.0, "c"), (1.0, "d")]:
        q.at(t, note, x)
    assert len(q) == 4
    q.run()
    assert ran == [
        (1.0, "b"),
        (1.0, "d"),
        (1.0, "b-now"),
        (1.0, "b-past"),
        (2.0, "a"),
        (2.0, "c"),
        (2.0, "b-later"),
    ]
    assert len(q) == 0 and q.processed == 7


def test_random_schedules_run_as_a_tuple_heap_runs_them():
    """A heap of (time, sequence number) pops every event scheduled at or after now in
    sorted order of both: the run must give exactly that order."""
    rng = random.Random(3)
    q, ran = EventQueue(), []
    count = 0

    def schedule(t: float) -> None:
        nonlocal count
        count += 1
        q.at(t, handler, count)

    def handler(x: int) -> None:
        ran.append((q.now, x))
        for _ in range(rng.choice((0, 0, 1, 2))):
            schedule(q.now + rng.choice((0.0, 0.5, 1.0, rng.random())))

    for _ in range(200):
        schedule(rng.choice((0.0, 1.0, 2.0, rng.random() * 5)))
    q.run()
    assert len(ran) == count > 300 and ran == sorted(ran)
    assert len({t for t, _ in ran}) < count  # ties were there to order
