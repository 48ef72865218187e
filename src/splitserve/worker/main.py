"""``splitserve worker``: load the engine, then serve it over HTTP until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import os

from splitserve.common.body_limit import DEFAULT_MAX_BODY_BYTES
from splitserve.common.listen import bind_port, serve
from splitserve.common.tenants import Tenants
from splitserve.common.tls import ServerFiles, uvicorn_tls
from splitserve.config import EngineConfig
from splitserve.worker.disagg_config import DisaggConfig

# How long uvicorn lets open streams finish after SIGTERM before closing them.
GRACEFUL_SHUTDOWN_S = 3


def run_worker(
    engine_config: EngineConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    tenants: Tenants | None = None,
    max_waiting: int | None = None,
    served_model_name: str | None = None,
    log_level: str = "info",
    disagg: DisaggConfig | None = None,
    step_log_dir: str | None = None,
    kv_events_endpoint: str | None = None,
    kv_events_replay_endpoint: str | None = None,
    tls: ServerFiles | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    access_log: str | None = None,
    access_log_max_bytes: int = 100 * 2**20,
) -> None:
    """Bind the port, load the model, then serve until stopped (connections are refused until
    the model is ready, and the port is held meanwhile).

    ``disagg`` carries the worker's role and KV-transfer settings (default: collocated);
    ``step_log_dir``, where to log every engine step (``engine/step_log.py``);
    ``kv_events_endpoint``, where to publish the prefix cache's KV events (a ZMQ endpoint);
    ``tls``, the certificate and key to serve HTTPS with (``common.tls.server_files``);
    ``max_body_bytes``, the largest request body taken (a larger one is a 413);
    ``access_log``, where to write a JSON line per request (``common.access_log``)."""
    disagg = disagg or DisaggConfig()
    if max_waiting is not None and max_waiting < 0:
        raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
    sock = bind_port(host, port, "splitserve worker")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    # httpx logs every request at INFO (a peer's KV lease, worker.peer): no line per request.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))
    from splitserve.common.gc_pauses import quiet_gc
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine.omp_teams import build_off_thread
    from splitserve.worker.server import create_app

    # The engine thread must hold the process's only OpenMP team (engine/omp_teams.py).
    engine = build_off_thread(lambda: LLMEngine(engine_config))
    step_log = None
    if step_log_dir is not None:
        from splitserve.engine.step_log import StepLog

        path = os.path.join(step_log_dir, f"{disagg.role}-{port}.jsonl")
        scheme = "http" if tls is None else "https"
        step_log = StepLog(path, engine, role=disagg.role, url=f"{scheme}://{host}:{port}")
        engine.step_log = step_log
    kv_events = None
    if kv_events_endpoint is not None:
        from splitserve.common.kv_events import BlockEventSink, EventPublisher

        kv_events = EventPublisher(kv_events_endpoint, replay_endpoint=kv_events_replay_endpoint)
        bm = engine.block_manager
        bm.events = BlockEventSink(kv_events, bm.block_size)
    from splitserve.common.access_log import AccessLog

    log_file = None if access_log is None else AccessLog(access_log, access_log_max_bytes)
    app = create_app(
        engine,
        api_key=api_key,
        tenants=tenants,
        max_waiting=max_waiting,
        served_model_name=served_model_name,
        disagg=disagg,
        max_body_bytes=max_body_bytes,
        access_log=log_file,
    )
    quiet_gc()
    try:
        serve(
            app,
            sock,
            log_level=log_level,
            access_log=False,  # a log line per request costs throughput; /metrics counts them
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            **uvicorn_tls(tls),
        )
    finally:
        if step_log is not None:
            step_log.close()
        if kv_events is not None:
            kv_events.close()
