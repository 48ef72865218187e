"""A real worker and a real router in front of it, shared by the fuzz and hostile tests."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import httpx
import pytest
from fuzzing import Stack, stack
from procs import last_test_using

# Small, so that an oversize body costs the tests little to send.
MAX_BODY_MB = 1


@dataclass(frozen=True)
class Target:
    """One server under test: the worker itself, or the router in front of it."""

    name: str
    url: str
    headers: dict[str, str]

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60)


# The stack lives from the first test that asks for it to the end of the run of tests that
# ask for it in a row (see pytest_runtest_teardown), not to the end of the session: its
# worker holds ~3 GB that the later directories' workers need. A later test that asks again
# gets a fresh one.
_HELD: dict[str, tuple[ExitStack, Stack]] = {}


@pytest.fixture
def fuzz_stack() -> Stack:
    if "stack" not in _HELD:
        with ExitStack() as scope:
            s = scope.enter_context(stack(max_body_mb=MAX_BODY_MB))  # s.greedy: its answer now
            _HELD["stack"] = (scope.pop_all(), s)
    return _HELD["stack"][1]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if last_test_using("fuzz_stack", item, nextitem):
        stop_fuzz_stack()


def pytest_sessionfinish() -> None:
    stop_fuzz_stack()  # after an interrupted run too


def stop_fuzz_stack() -> None:
    if "stack" in _HELD:
        _HELD.pop("stack")[0].close()


@pytest.fixture(params=["worker", "router"])
def target(request, fuzz_stack: Stack) -> Target:
    s = fuzz_stack
    if request.param == "worker":
        return Target("worker", s.worker, s.worker_headers)
    return Target("router", s.router, s.router_headers)
