"""A real worker and a real router in front of it, shared by the fuzz and hostile tests."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
from fuzzing import Stack, greedy_answer, stack

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


@pytest.fixture(scope="session")
def fuzz_stack() -> Stack:
    with stack(max_body_mb=MAX_BODY_MB) as s:
        s.greedy = greedy_answer(s.worker, s.worker_headers)  # what it answers untouched
        yield s


@pytest.fixture(params=["worker", "router"])
def target(request, fuzz_stack: Stack) -> Target:
    s = fuzz_stack
    if request.param == "worker":
        return Target("worker", s.worker, s.worker_headers)
    return Target("router", s.router, s.router_headers)
