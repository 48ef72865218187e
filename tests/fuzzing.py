"""Schema-driven fuzzing of a live worker and a router in front of it.

schemathesis generates requests from each server's own ``/openapi.json``, valid ones and
invalid ones (``positive`` and ``negative`` modes), and sends each to the real process with a
bounded wait. A case fails when the answer is a 5xx, when it does not arrive within the
bound (a hang), when it contradicts the schema (status, media type or body), or when a 4xx
is not an OpenAI error body. After the run the worker must still be healthy and must still
give the same greedy answer it gave before.

Shared by ``tests/fuzz/test_schema_fuzz.py`` (a short run in the test suite) and
``make fuzz`` (``python tests/fuzzing.py``: thousands of cases, counts printed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import httpx

sys.path.insert(0, str(Path(__file__).parent))  # `python tests/fuzzing.py`: procs, below
from procs import die_with_parent, free_port, start_worker, stop_group, wait_healthy  # noqa: E402

WORKER_KEY = "sk-fuzz-worker"
ROUTER_KEY = "sk-fuzz-router"
MAX_MODEL_LEN = 256
# Generated requests may ask for up to the whole context (~25 s of decoding at 256 tokens on
# one thread). Valid ``max_tokens`` below the context are lowered to this many, and chat
# requests without one get it: a hostile value (0, -1, 2**63, the context or more) is sent
# as generated. ``tests/fuzz/test_hostile.py`` sends the omitted and the huge ones by hand.
MAX_GENERATED_TOKENS = 4
MAX_GENERATED_CHOICES = 2  # likewise for a valid ``n``
REQUEST_TIMEOUT_S = 30.0  # no answer within this is a hang
MAX_ROUNDS = 5
GREEDY = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 8,
    "temperature": 0,
}


@dataclass
class Tally:
    """What one server answered."""

    name: str
    cases: int = 0
    statuses: Counter = field(default_factory=Counter)
    timeouts: int = 0
    failures: list[str] = field(default_factory=list)
    by_operation: Counter = field(default_factory=Counter)
    slowest: list[tuple[float, str]] = field(default_factory=list)  # (seconds, case)

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s >= 500)

    def classes(self) -> dict[str, int]:
        out: Counter = Counter()
        for status, n in self.statuses.items():
            out[f"{status // 100}xx"] += n
        return dict(sorted(out.items()))

    def summary(self) -> str:
        return (
            f"{self.name}: {self.cases} cases, status classes {self.classes()}, "
            f"5xx {self.server_errors}, timeouts {self.timeouts}, "
            f"other check failures {len(self.failures) - self.server_errors - self.timeouts}"
        )


@dataclass
class Stack:
    worker: str
    router: str
    procs: list[subprocess.Popen]
    greedy: str = ""  # the worker's greedy answer to ``GREEDY`` before any test

    @property
    def worker_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {WORKER_KEY}"}

    @property
    def router_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ROUTER_KEY}"}


@contextmanager
def stack(max_body_mb: float | None = None) -> Iterator[Stack]:
    """A real worker (the default model, ``MAX_MODEL_LEN``) and a real router in front of
    it, both stopped at the end; ``max_body_mb``: both servers' body limit."""
    limit = [] if max_body_mb is None else ["--max-body-mb", str(max_body_mb)]
    procs: list[subprocess.Popen] = []
    try:
        worker, proc = start_worker(
            ["--max-model-len", str(MAX_MODEL_LEN), *limit],
            env={"SPLITSERVE_API_KEY": WORKER_KEY},
        )
        procs.append(proc)
        port = free_port()
        argv = [sys.executable, "-m", "splitserve.cli", "router", "--port", str(port), *limit]
        argv += ["--workers", worker, "--api-key", ROUTER_KEY, "--worker-api-key", WORKER_KEY]
        argv += ["--health-interval", "0.5", "--log-level", "warning"]
        procs.append(subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with_parent))
        router = f"http://127.0.0.1:{port}"
        wait_healthy(worker, proc)
        wait_healthy(router, procs[-1], timeout=60)
        s = Stack(worker, router, procs)
        s.greedy = greedy_answer(worker, s.worker_headers)
        yield s
    finally:
        for p in procs:
            stop_group(p)


def greedy_answer(url: str, headers: dict[str, str]) -> str:
    r = httpx.post(f"{url}/v1/chat/completions", json=GREEDY, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def bounded(body: object, path: str) -> None:
    """Lower a valid generated ``max_tokens`` and ``n`` in place (see
    ``MAX_GENERATED_TOKENS``)."""
    responses = path.endswith("/v1/responses")
    if not isinstance(body, dict) or not (path.endswith("completions") or responses):
        return
    limits = ("max_output_tokens",) if responses else ("max_tokens", "max_completion_tokens")
    for name in limits:
        value = body.get(name)
        if type(value) is int and MAX_GENERATED_TOKENS < value < MAX_MODEL_LEN:
            body[name] = MAX_GENERATED_TOKENS
    n = body.get("n")
    if type(n) is int and MAX_GENERATED_CHOICES < n <= 128:  # each choice decodes its own
        body["n"] = MAX_GENERATED_CHOICES
    unset = all(body.get(name) is None for name in limits)
    if unset and (responses or path.endswith("/chat/completions")):
        body[limits[0]] = MAX_GENERATED_TOKENS


def openai_error_body(ctx, response, case) -> bool | None:
    """A 4xx answers ``{"error": {"message", "type", "param", "code"}}``."""
    if not 400 <= response.status_code < 500:
        return None
    error = json.loads(response.content).get("error")
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        raise AssertionError(f"not an OpenAI error body: {response.content[:200]!r}")
    if not isinstance(error["message"], str) or not error["message"]:
        raise AssertionError(f"an error without a message: {response.content[:200]!r}")
    return True


def fuzz(
    name: str,
    base_url: str,
    headers: dict[str, str],
    cases: int,
    seed: int = 0,
    last: tuple[str, ...] = (),
    reset: Callable[[], None] | None = None,
) -> Tally:
    """At least ``cases`` cases, spread over the operations that take input (a body or path
    parameters), half valid and half not; operations named in ``last`` (``METHOD /path``)
    after the others. The rest (probes, listings) get a few each. Hypothesis may stop an
    operation short of its share (no more distinct cases): then another round runs, with
    another seed, after ``reset``."""
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", timeout=10)
    operations = [r.ok() for r in schema.get_all_operations()]
    operations.sort(key=lambda op: op.label in last)
    inputs = [op for op in operations if op.body or op.path_parameters]
    examples = -(-cases // (2 * len(inputs)))  # two modes
    target = Target(base_url, headers, Tally(name))
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    for n in range(MAX_ROUNDS):
        for op in operations:
            for mode in modes:
                target.run(op, mode, examples if op in inputs else 5, seed + n)
        if reset is not None:
            reset()
        if target.tally.cases >= cases:
            break
    return target.tally


@dataclass
class Target:
    base_url: str
    headers: dict[str, str]
    tally: Tally

    def run(self, op, mode, examples: int, seed: int) -> None:
        """``examples`` cases of ``op`` in generation ``mode``."""
        from hypothesis import HealthCheck, Phase, Verbosity, given, settings
        from hypothesis import seed as with_seed
        from hypothesis.errors import Unsatisfiable

        @with_seed(seed)
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],  # a failure is counted, not shrunk
            suppress_health_check=list(HealthCheck),
            verbosity=Verbosity.quiet,
        )
        # The key is fixed, so negative cases break the request itself, not its key.
        @given(case=op.as_strategy(generation_mode=mode, headers=self.headers))
        def run(case) -> None:
            self.send(case, op.label)

        try:
            run()
        except Unsatisfiable:  # nothing to negate: no body, no parameters
            pass

    def send(self, case, label: str) -> None:
        import requests

        tally = self.tally
        bounded(case.body, case.path)
        tally.cases += 1
        tally.by_operation[label] += 1
        started = time.monotonic()
        try:
            response = case.call(
                base_url=self.base_url, headers=self.headers, timeout=REQUEST_TIMEOUT_S
            )
        except requests.Timeout:
            tally.timeouts += 1
            tally.failures.append(f"{label}: no answer in {REQUEST_TIMEOUT_S:.0f}s: {_curl(case)}")
            return
        except requests.RequestException as e:
            tally.failures.append(f"{label}: {e!r}: {_curl(case)}")
            return
        tally.statuses[response.status_code] += 1
        took = time.monotonic() - started
        tally.slowest = sorted([*tally.slowest, (took, f"{label} {_curl(case)}")])[-5:]
        if took > REQUEST_TIMEOUT_S:
            tally.timeouts += 1
            tally.failures.append(f"{label}: answered after {REQUEST_TIMEOUT_S:.0f}s")
        try:
            case.validate_response(response, checks=_checks(), headers=self.headers)
        except (Exception, BaseExceptionGroup) as e:  # schemathesis's FailureGroup
            body = response.content[:300]
            tally.failures.append(f"{label}: {response.status_code} {body!r}: {e}: {_curl(case)}")


def _checks() -> list:
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    return [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        openai_error_body,
    ]


def _curl(case) -> str:
    """The case as a curl command (schemathesis's own hides fields named like secrets)."""
    try:
        body = json.dumps(case.body) if case.body is not None else ""
    except TypeError:  # no body (schemathesis's marker)
        body = ""
    data = f" -d {shlex.quote(body)}" if body else ""
    return f"curl -X {case.method.upper()} URL{case.formatted_path}{data}"


def restore(stack: Stack) -> None:
    """Undo what the fuzzed membership endpoints did: the stack's worker alone."""
    with httpx.Client(headers=stack.router_headers, timeout=10) as client:
        workers = client.get(f"{stack.router}/workers").json()["workers"]
        for w in workers:
            if w["url"] != stack.worker:
                client.delete(f"{stack.router}/workers/{quote(w['url'], safe='')}")
        client.post(f"{stack.router}/workers", json={"url": stack.worker, "role": "both"})


def aftermath(s: Stack) -> list[str]:
    """What is wrong with the stack after an attack: an unhealthy worker, another greedy
    answer than before it (from the worker, or through the router)."""
    exited = [p.args[3] for p in s.procs if p.poll() is not None]  # "worker", "router"
    if exited:
        return [f"the {' and '.join(exited)} exited (killed, or crashed: see its log above)"]
    problems = []
    health = httpx.get(f"{s.worker}/health", timeout=10)
    if health.status_code != 200:
        problems.append(f"worker unhealthy: {health.status_code} {health.text}")
    for url, headers in ((s.worker, s.worker_headers), (s.router, s.router_headers)):
        after = greedy_answer(url, headers)
        if after != s.greedy:
            problems.append(f"{url}: the greedy answer changed: {s.greedy!r} -> {after!r}")
    return problems


def campaign(s: Stack, cases: int, seed: int = 0) -> tuple[Tally, Tally, list[str]]:
    """Fuzz the stack's worker, then its router (membership last, then undone); the
    problems found after."""
    worker = fuzz("worker", s.worker, s.worker_headers, cases, seed)
    membership = ("POST /workers", "DELETE /workers/{url}")
    router = fuzz("router", s.router, s.router_headers, cases, seed, membership, lambda: restore(s))
    return worker, router, aftermath(s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", type=int, default=2000, help="generated cases per server (at least)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("SPLITSERVE_CPU_BF16", "0")  # as the tests run it
    started = time.monotonic()
    load = os.getloadavg()[0]
    print(f"cases per server: {args.cases}+, seed {args.seed}; load average {load:.1f}")
    with stack() as s:
        worker, router, problems = campaign(s, args.cases, args.seed)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    for t in (worker, router):
        print(t.summary())
        print(f"  statuses {dict(sorted(t.statuses.items()))}")
        print(f"  cases by operation {dict(sorted(t.by_operation.items()))}")
        for took, case in t.slowest[::-1]:
            print(f"  slow {took:.1f}s: {case[:300]}")
        for f in t.failures[:50]:
            print(f"  FAILED {f}")
    print(f"after the run: {'; '.join(problems) or 'worker healthy, same greedy answer'}")
    print(f"{time.monotonic() - started:.0f}s")
    failed = any(t.failures for t in (worker, router)) or problems
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
