"""vLLM's Rust router (PyPI ``vllm-router``, pinned to 0.1.17) as a peer in front of our workers.

The benchmark runs it where it runs splitserve's router, over the same workers, to compare
routing policies on the same traffic. It is a console script (``vllm-router``) installed into
``.venv-vllm`` next to vLLM (it pins no torch), or into a venv of its own. What 0.1.17 does,
checked against the binary with loopback workers:

- Command line: ``--host H --port P --worker-urls URL... --policy NAME``. It answers nothing
  until at least one worker's ``GET /health`` is 200 (it re-checks every
  ``--worker-startup-check-interval`` seconds, 30 by default: we pass 1), then serves
  ``GET /readiness`` (200 with ``healthy_workers``), ``/health`` and ``/liveness``.
- Its own Prometheus exporter listens on ``--prometheus-port`` (default 29000; a port in use
  makes it panic at start, so each router gets a free one). ``GET /metrics`` on the main port
  is *proxied to a worker*. Per-worker routing counts:
  ``vllm_router_processed_requests_total{worker=...}`` on the exporter.
- Session key (``consistent_hash``, ``sticky_least_loaded``): the first non-empty header of
  ``x-session-id``, ``x-user-id``, ``x-tenant-id``, ``x-correlation-id``, ``x-request-id``,
  ``x-trace-id`` (case-insensitive), then the body's ``session_params.session_id``, ``user``,
  ``session_id``, ``user_id``. Without one, ``consistent_hash`` hashes the whole body (a new
  key each turn, as a conversation grows) and ``sticky_least_loaded`` picks the least-loaded
  worker without remembering it.
- API keys: requests are forwarded with the client's own headers (``Authorization``
  included); ``--api-key`` is *not* added to them. It only goes on the router's own calls
  (``kv_aware``'s discovery and render requests, data-parallel discovery). Health checks
  carry no key: a worker's ``/health`` must be open (ours and vLLM's are).
- Bodies are re-serialised with extra fields (``skip_special_tokens``, ``ignore_eos``, ...);
  unknown fields (``kv_retention``, ``return_token_ids``) are kept.
- The process renames itself ``vllm::router`` (``ps`` shows that, not ``vllm-router``).
- Logs: ``--log-level warning`` is read as info (the Rust side expects ``warn``);
  ``--log-level error`` works, and ``RUST_LOG`` overrides either. A few ``DEBUG:`` lines go
  to stdout at start whatever the level.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from splitserve.cluster.local import free_port
from splitserve.cluster.vllm_worker import VENV_ENV, repo_root

BINARY = "vllm-router"
VERSION = "0.1.17"
READY_PATH = "/readiness"  # 200 once it serves; it binds only after a worker is healthy
SESSION_HEADER = "X-Session-Id"  # read by consistent_hash and sticky_least_loaded
FINISH_SESSION_PATH = "/finish_session"  # POST ?session_id=ID: sticky_least_loaded forgets it
LOG_ENV = "RUST_LOG"  # wins over --log-level
VENV_DIRS = (".venv-vllm", ".venv-vllm-router")

# The --policy choices of 0.1.17. What each needs from the workers:
#   round_robin, random: nothing.
#   power_of_two: the load each worker's GET /get_load reports, polled every 5 s (builtin
#       workers have no such endpoint).
#   cache_aware: nothing: a prefix tree of the request text it has routed. A request goes
#       where its text matches more than --cache-threshold (0.3); loads are balanced only
#       once they differ by more than 64 requests and 1.5x. Similar prompts: one worker.
#   consistent_hash: a session key (SESSION_HEADER), else a hash of the body.
#   sticky_least_loaded: a session key; a new session goes to the worker with the fewest
#       sessions; they expire after 2 h ($VLLM_ROUTER_SLL_SESSION_EXPIRATION_IN_S) or at
#       FINISH_SESSION_PATH.
#   kv_aware: prompt token ids from each worker's POST /v1/chat/completions/render, and
#       vLLM's KV events over ZMQ: from each worker's GET /kv_event_sources (vLLM started
#       with --kv-events-config), or --kv-event-source URL=tcp://HOST:PORT per worker plus
#       --kv-event-model NAME (--kv-event-block-size, default 16). Builtin workers have
#       neither endpoint: it then picks on load alone, one worker while load is low.
VLLM_ROUTER_POLICIES = (
    "round_robin",
    "random",
    "power_of_two",
    "cache_aware",
    "consistent_hash",
    "sticky_least_loaded",
    "kv_aware",
)

_INSTALL_HINT = f"run `make install-vllm` (pip install {BINARY}=={VERSION})"


def find_vllm_router(explicit: str | None = None) -> str:
    """The ``vllm-router`` executable: ``explicit``, else ``$SPLITSERVE_VLLM_VENV/bin``, the
    repository's ``.venv-vllm`` or ``.venv-vllm-router``, else ``PATH``. Raises
    ``ValueError`` naming ``make install-vllm`` when there is none."""
    candidates = _candidates(explicit)
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    looked = ", ".join(str(p) for p in candidates) or "nowhere"
    where = looked if explicit else f"{looked} and on PATH"
    raise ValueError(f"{BINARY} is not installed (looked at {where}); {_INSTALL_HINT}")


def _candidates(explicit: str | None) -> list[Path]:
    if explicit:
        return [Path(explicit)]
    venvs = [os.environ.get(VENV_ENV)] + [str(repo_root() / d) for d in VENV_DIRS]
    paths = [Path(v) / "bin" / BINARY for v in venvs if v]
    on_path = shutil.which(BINARY)
    return paths + ([Path(on_path)] if on_path else [])


def vllm_router_argv(
    binary: str,
    host: str,
    port: int,
    workers: list[str],
    policy: str,
    extra: Sequence[str] = (),
    *,
    metrics_port: int | None = None,
    api_key: str | None = None,
) -> list[str]:
    """The command line of a router on ``host:port`` in front of ``workers`` with ``policy``.

    Its Prometheus exporter goes on ``metrics_port`` (a free port when None). ``api_key`` is
    only for the router's own calls to the workers (see the module doc); ``extra`` is
    appended as is."""
    _check(workers, policy)
    exporter = free_port(host) if metrics_port is None else metrics_port
    argv = [binary, "--host", host, "--port", str(port), "--worker-urls", *workers]
    argv += ["--policy", policy, "--prometheus-host", host, "--prometheus-port", str(exporter)]
    argv += ["--worker-startup-check-interval", "1", "--log-level", "error"]
    if api_key:
        argv += ["--api-key", api_key]
    return argv + list(extra)


def _check(workers: list[str], policy: str) -> None:
    if policy not in VLLM_ROUTER_POLICIES:
        known = ", ".join(VLLM_ROUTER_POLICIES)
        raise ValueError(f"unknown {BINARY} policy {policy!r}; known: {known}")
    if not workers:
        raise ValueError(f"{BINARY} needs at least one worker URL")


def vllm_router_env(base: Mapping[str, str] | None = None, log: str = "warn") -> dict[str, str]:
    """The router's environment: ``base`` (default ours) with ``RUST_LOG=log``, so warnings
    show and the per-request info lines do not."""
    return {**(os.environ if base is None else base), LOG_ENV: log}
