"""vLLM's Rust router (``vllm-router``) in front of two builtin workers, as the benchmark runs
it: chat answers through it, sessions stay on one worker under ``consistent_hash``, new
sessions balance under ``sticky_least_loaded``, ``round_robin`` alternates, and the client's
API key reaches the workers. Where each request landed is read from the workers' own
``splitserve:request_success`` counters. The command-line tests need no binary; the process
tests are skipped without one (``make install-vllm``)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from procs import die_with_parent, free_port, metric, start_worker, stop_group, wait_healthy

from splitserve.cluster import vllm_router
from splitserve.cluster.vllm_router import (
    READY_PATH,
    SESSION_HEADER,
    VLLM_ROUTER_POLICIES,
    find_vllm_router,
    vllm_router_argv,
    vllm_router_env,
)

try:
    BINARY: str | None = find_vllm_router()
    NO_BINARY = ""
except ValueError as e:
    BINARY, NO_BINARY = None, str(e)

needs_router = pytest.mark.skipif(BINARY is None, reason=f"no vllm-router here ({NO_BINARY})")

API_KEY = "sk-router-test"
ANSWERED = "splitserve:request_success_total"
READY_TIMEOUT_S = 30.0


# ---- the command line, no processes ---------------------------------------------------------


def test_argv_names_workers_policy_and_a_quiet_log():
    workers = ["http://a:1", "http://b:2"]
    argv = vllm_router_argv("/bin/vr", "127.0.0.1", 9000, workers, "round_robin")
    assert argv[:5] == ["/bin/vr", "--host", "127.0.0.1", "--port", "9000"]
    assert argv[5:8] == ["--worker-urls", *workers]
    assert argv[argv.index("--policy") + 1] == "round_robin"
    assert argv[argv.index("--log-level") + 1] == "error"
    assert int(argv[argv.index("--prometheus-port") + 1]) > 0  # never the shared default 29000
    assert "--api-key" not in argv


def test_argv_takes_the_exporter_port_the_key_and_extra_flags_last():
    extra = ["--router-temperature", "0.5"]
    argv = vllm_router_argv(
        "vr", "h", 1, ["http://a:1"], "kv_aware", extra, metrics_port=4321, api_key="sk-1"
    )
    assert argv[argv.index("--prometheus-port") + 1] == "4321"
    assert argv[argv.index("--api-key") + 1] == "sk-1"
    assert argv[-2:] == extra


def test_argv_knows_the_policies_the_benchmark_compares():
    for policy in ("cache_aware", "consistent_hash", "kv_aware", "sticky_least_loaded"):
        assert policy in VLLM_ROUTER_POLICIES
        vllm_router_argv("vr", "h", 1, ["http://a:1"], policy, metrics_port=2)


def test_argv_refuses_an_unknown_policy_and_no_workers():
    with pytest.raises(ValueError, match="unknown vllm-router policy 'least_load'.*round_robin"):
        vllm_router_argv("vr", "h", 1, ["http://a:1"], "least_load", metrics_port=2)
    with pytest.raises(ValueError, match="at least one worker"):
        vllm_router_argv("vr", "h", 1, [], "round_robin", metrics_port=2)


def test_env_sets_the_log_filter_that_wins_over_the_flag():
    env = vllm_router_env({"PATH": "/bin", "RUST_LOG": "debug"})
    assert env == {"PATH": "/bin", "RUST_LOG": "warn"}


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_find_takes_an_explicit_path_or_names_make_install_vllm(tmp_path):
    binary = _executable(tmp_path / "vllm-router")
    assert find_vllm_router(str(binary)) == str(binary)
    with pytest.raises(ValueError, match="make install-vllm"):
        find_vllm_router(str(tmp_path / "missing"))


def test_find_looks_in_the_venv_then_the_repository_then_path(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_router, "repo_root", lambda: tmp_path / "repo")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.delenv("SPLITSERVE_VLLM_VENV", raising=False)
    with pytest.raises(ValueError, match="make install-vllm"):
        find_vllm_router()
    on_path = _executable(tmp_path / "bin" / "vllm-router")
    assert find_vllm_router() == str(on_path)
    in_repo = _executable(tmp_path / "repo" / ".venv-vllm-router" / "bin" / "vllm-router")
    assert find_vllm_router() == str(in_repo)
    monkeypatch.setenv("SPLITSERVE_VLLM_VENV", str(tmp_path / "venv"))
    in_venv = _executable(tmp_path / "venv" / "bin" / "vllm-router")
    assert find_vllm_router() == str(in_venv)


# ---- real processes -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers() -> Iterator[list[str]]:
    """Two builtin workers that want an API key; they load in parallel."""
    procs = [start_worker(["--kv-cache-gb", "0.1", "--api-key", API_KEY]) for _ in range(2)]
    try:
        for url, proc in procs:
            wait_healthy(url, proc)
        yield [url for url, _ in procs]
    finally:
        for _, proc in procs:
            stop_group(proc)


@pytest.fixture(scope="module")
def model(workers) -> str:
    """The model name the workers serve."""
    r = httpx.get(f"{workers[0]}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    return r.json()["data"][0]["id"]


@contextmanager
def router(workers: list[str], policy: str, log: Path) -> Iterator[openai.OpenAI]:
    """A client of vllm-router with ``policy`` in front of ``workers``, once it is ready; the
    router's output goes to ``log``."""
    assert BINARY is not None
    url = f"http://127.0.0.1:{(port := free_port())}"
    argv = vllm_router_argv(BINARY, "127.0.0.1", port, workers, policy)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv,
            env=vllm_router_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    try:
        _wait_ready(url, proc, log)
        yield _client(url)
    finally:
        stop_group(proc)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {proc.returncode}: {_tail(log)}")
        try:
            if httpx.get(f"{url}{READY_PATH}", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"vllm-router at {url} not ready in {READY_TIMEOUT_S:.0f}s: {_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:]


def _client(url: str, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def _chat(client: openai.OpenAI, model: str, session: str | None = None) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Say hi to {session or 'everyone'}."}],
        max_tokens=2,
        temperature=0,
        extra_headers={SESSION_HEADER: session} if session is not None else None,
    )
    return reply.choices[0].message.content


def _answered(workers: list[str]) -> list[float]:
    return [metric(url, ANSWERED) for url in workers]


def _lands_on(workers: list[str], client: openai.OpenAI, model: str, session: str | None = None):
    """Send one chat turn; the index of the one worker that answered it."""
    before = _answered(workers)
    assert _chat(client, model, session)
    grown = [after - was for after, was in zip(_answered(workers), before, strict=True)]
    assert sorted(grown) == [0, 1], grown
    return grown.index(1)


@needs_router
def test_round_robin_alternates_and_streams(workers, model, tmp_path):
    with router(workers, "round_robin", tmp_path / "router.log") as client:
        landed = [_lands_on(workers, client, model) for _ in range(4)]
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Count to three."}],
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    assert landed in ([0, 1, 0, 1], [1, 0, 1, 0])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens >= 1


@needs_router
def test_consistent_hash_keeps_each_session_on_one_worker(workers, model, tmp_path):
    sessions = [f"session-{i}" for i in range(12)]
    with router(workers, "consistent_hash", tmp_path / "router.log") as client:
        home = {s: _lands_on(workers, client, model, s) for s in sessions}
        again = {s: _lands_on(workers, client, model, s) for s in sessions[:4]}
    assert all(again[s] == home[s] for s in again), (home, again)
    assert set(home.values()) == {0, 1}  # 12 keys on a ring of 2: both get some


@needs_router
def test_sticky_least_loaded_balances_new_sessions_and_keeps_old_ones(workers, model, tmp_path):
    sessions = ("a", "b", "c", "d")
    with router(workers, "sticky_least_loaded", tmp_path / "router.log") as client:
        home = {s: _lands_on(workers, client, model, s) for s in sessions}
        again = {s: _lands_on(workers, client, model, s) for s in sessions}
    assert again == home
    assert sorted(home.values()) == [0, 0, 1, 1]


@needs_router
@pytest.mark.parametrize("policy", ["cache_aware", "kv_aware"])
def test_the_cache_policies_answer_through_builtin_workers(workers, model, tmp_path, policy):
    with router(workers, policy, tmp_path / "router.log") as client:
        _lands_on(workers, client, model, "s1")


@needs_router
def test_the_clients_key_is_what_reaches_the_workers(workers, model, tmp_path):
    """The router adds no key of its own: with a wrong one, or none, the worker refuses."""
    with router(workers, "round_robin", tmp_path / "router.log") as client:
        with pytest.raises(openai.AuthenticationError):
            _chat(client.with_options(api_key="wrong"), model)
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        r = httpx.post(f"{client.base_url}chat/completions", json=body, timeout=30)
        assert r.status_code == 401, r.text


def test_no_router_is_left_behind():
    """Each test above stopped its router (which renames itself ``vllm::router``)."""
    assert not [n for n in _descendants() if "vllm::router" in n or "bin/vllm-router" in n]


def _descendants() -> list[str]:
    names = []
    for p in psutil.Process().children(recursive=True):
        try:
            names.append(" ".join(p.cmdline()))
        except psutil.Error:  # gone, or a zombie already
            continue
    return names
