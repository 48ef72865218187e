"""The engine on its own thread, and the bridge that lets asyncio handlers talk to it.

``LLMEngine`` is single-threaded: only the engine thread touches it, or another thread
holding the engine's lock, which the engine thread holds for everything but its model runs
(``call_now``). Handlers send commands (add, abort) through a thread-safe queue; the engine
thread answers through per-request asyncio queues, fed with one ``call_soon_threadsafe`` per
engine step (not per token), so a step with 32 running streams wakes the event loop once.

    handler ──_Add/_Abort──▶ SimpleQueue ──▶ engine thread: drain → step() → publish
       ▲                                                                   │
       └──── RequestStream.queue ◀── loop.call_soon_threadsafe(_dispatch) ◀┘
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.outputs import RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")

# How long the idle engine thread sleeps between checks for shutdown; commands wake it at once.
_IDLE_POLL_S = 0.5


class EngineLike(Protocol):
    """What the worker needs from an engine (``LLMEngine`` provides it)."""

    block_manager: Any  # .num_used_blocks, .num_blocks

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        keep_blocks: bool = False,
    ) -> None: ...
    def abort_request(self, request_id: str) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...


class QueueFull(Exception):
    """The engine's waiting queue is at ``max_waiting``; the client should retry later."""


class EngineError(Exception):
    """The engine failed while running this request (a bug, never the client's fault)."""


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The engine's load, published by the engine thread after every iteration."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    stream: RequestStream
    keep_blocks: bool = False
    options: dict[str, Any] = field(default_factory=dict)  # more add_request keywords


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    """Run ``fn(engine)`` on the engine thread; answer through ``future`` if one is given."""

    fn: Callable[[Any], Any]
    future: asyncio.Future | None = None


_ACCEPTED = object()
_STOP = object()


class RequestStream:
    """One request's outputs, as an async iterator. Closing it early aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self._engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it has finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Runs an engine on a daemon thread; ``add`` and ``abort`` are called from the event loop."""

    def __init__(self, engine: EngineLike, max_waiting: int | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.load = LoadSnapshot()
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # set if the engine thread itself died
        # The engine's lock (``LLMEngine.lock``), if it has one: see ``call_now``.
        self._lock: Any = getattr(engine, "lock", None)
        self._locked: Any = self._lock if self._lock is not None else contextlib.nullcontext()
        # Called on the engine thread with each step's wall and thread CPU seconds (metrics).
        self.on_step: Callable[[float, float], None] | None = None

    # ---- lifecycle (event loop side) ---------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._publish_load()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        keep_blocks: bool = False,
        **options: Any,
    ) -> RequestStream:
        """Queue a request and wait until the engine accepts it; ``options`` are passed on
        to the engine's ``add_request`` (``retention_s``, ``session_id``).

        Raises ``QueueFull``, ``InvalidParameter`` (from the engine) or ``EngineError``
        before any output, so the caller can still answer with an error status.
        """
        if not self.alive:
            raise EngineError("the engine is not running")
        stream = RequestStream(self, request_id)
        self._commands.put(
            _Add(request_id, prompt_token_ids, params, prompt, stream, keep_blocks, options)
        )
        try:
            ack = await stream.queue.get()
        except asyncio.CancelledError:
            stream.close()
            raise
        if isinstance(ack, BaseException):
            stream.finished = True
            raise ack
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        if not self.alive:
            raise EngineError("the engine is not running")
        future = asyncio.get_running_loop().create_future()
        self._commands.put(_Call(fn, future))
        return await future

    async def call_now(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(engine)`` on a helper thread under the engine's lock: like ``call``, but
        waiting only for the engine's bookkeeping between two model runs, not for a model
        run (a long prefill step). For short work on engine state, never on the model.
        An engine without a lock gets ``call``."""
        if not self.alive:
            raise EngineError("the engine is not running")
        lock = self._lock
        if lock is None:
            return await self.call(fn)

        def run() -> T:
            with lock:
                return fn(self.engine)

        return await asyncio.to_thread(run)

    def submit(self, fn: Callable[[Any], object]) -> None:
        """Run ``fn(engine)`` on the engine thread, from any thread, without waiting."""
        self._commands.put(_Call(fn))

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._drain(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._housekeeping()
                self._publish_load()
        except BaseException as e:  # the thread must not die silently: /health reports it
            log.exception("engine thread died")
            self.error = e
            self._fail_all(EngineError(f"engine thread died: {e!r}"))

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; wait for one if ``block``. False once asked to stop."""
        try:
            cmd = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is _STOP:
                self._fail_all(EngineError("the worker is shutting down"))
                return False
            with self._locked:
                self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: _Add | _Abort | _Call) -> None:
        if isinstance(cmd, _Call):
            self._run_call(cmd)
            return
        if isinstance(cmd, _Abort):
            if self._streams.pop(cmd.request_id, None) is not None:
                self.engine.abort_request(cmd.request_id)
            return
        if self.max_waiting is not None and self.engine.num_waiting >= self.max_waiting:
            self._send([(cmd.stream, QueueFull(f"{self.engine.num_waiting} requests waiting"))])
            return
        try:
            self.engine.add_request(
                cmd.request_id,
                cmd.prompt_token_ids,
                cmd.params,
                cmd.prompt,
                keep_blocks=cmd.keep_blocks,
                **cmd.options,
            )
        except ValueError as e:  # InvalidParameter and friends: the client's mistake
            self._send([(cmd.stream, e)])
            return
        self._streams[cmd.request_id] = cmd.stream
        self._send([(cmd.stream, _ACCEPTED)])

    def _run_call(self, cmd: _Call) -> None:
        try:
            result: Any = cmd.fn(self.engine)
        except Exception as e:
            if cmd.future is None:
                log.exception("engine call failed")
            result = e
        if cmd.future is not None and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(_resolve, cmd.future, result)
            except RuntimeError:
                pass  # the event loop has closed

    def _step(self) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            outputs = self.engine.step()
        except Exception as e:
            # Which request broke the step is unknown: fail the ones in flight, keep serving.
            log.exception("engine step failed; failing %d requests", len(self._streams))
            self._fail_all(EngineError(f"engine step failed: {e!r}"))
            return
        if self.on_step is not None:
            self.on_step(time.perf_counter() - start, time.thread_time() - cpu)
        batch = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its client while this step ran
            if out.finished:
                del self._streams[out.request_id]
            batch.append((stream, out))
        self._send(batch)

    def _housekeeping(self) -> None:
        # Idle work of engines that have some (finished KV tier copies, expired pins).
        work = getattr(self.engine, "housekeeping", None)
        if work is not None:
            try:
                with self._locked:
                    work()
            except Exception:
                log.exception("engine housekeeping failed")

    def _fail_all(self, error: Exception) -> None:
        streams, self._streams = self._streams, {}
        for request_id in streams:
            try:
                with self._locked:
                    self.engine.abort_request(request_id)
            except Exception:
                log.exception("abort of %s failed", request_id)
        self._send([(s, error) for s in streams.values()])

    def _send(self, batch: list[tuple[RequestStream, Any]]) -> None:
        if not batch or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_dispatch, batch)
        except RuntimeError:
            pass  # the event loop has closed: the worker is exiting and nobody is listening

    def _publish_load(self) -> None:
        bm = self.engine.block_manager
        self.load = LoadSnapshot(
            self.engine.num_running, self.engine.num_waiting, bm.num_used_blocks, bm.num_blocks
        )


def _resolve(future: asyncio.Future, result: Any) -> None:
    if future.done():
        return  # the caller was cancelled
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)


def _dispatch(batch: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in batch:
        stream.queue.put_nowait(item)
