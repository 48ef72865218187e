"""``AsyncEngine.call_now``: work on engine state under the engine's lock, which the engine
holds for its bookkeeping but not while its model runs, so it never waits for a model run
(``call`` waits for the step to end). A peer's KV lease relies on this on a busy worker."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from splitserve.common.sampling_params import SamplingParams
from splitserve.worker.async_engine import AsyncEngine

WAIT_S = 10.0


class SteppingEngine:
    """One request at a time; its model run lasts until the test lets it end."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.block_manager = SimpleNamespace(num_used_blocks=0, num_blocks=1)
        self.model_running = threading.Event()
        self.end_model_run = threading.Event()
        self.pending = False
        self.num_running = self.num_waiting = 0

    def add_request(self, request_id, prompt_token_ids, params, prompt=None, keep_blocks=False):
        self.pending = True

    def abort_request(self, request_id: str) -> None:
        self.pending = False

    def has_unfinished_requests(self) -> bool:
        return self.pending

    def step(self) -> list:
        with self.lock:  # bookkeeping: schedule
            pass
        self.model_running.set()
        self.end_model_run.wait(WAIT_S)
        with self.lock:  # bookkeeping: update
            self.pending = False
        return []

    def lock_held(self) -> bool:
        """Whether some thread holds the lock: another thread cannot take it."""
        taken: list[bool] = []

        def probe() -> None:
            ok = self.lock.acquire(blocking=False)
            if ok:
                self.lock.release()
            taken.append(ok)

        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
        return not taken[0]


def test_call_now_runs_under_the_lock_while_the_model_runs_and_call_waits():
    async def main() -> None:
        engine = SteppingEngine()
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            await async_engine.add("r", [1], SamplingParams(max_tokens=1))
            await asyncio.to_thread(engine.model_running.wait, WAIT_S)
            later = asyncio.ensure_future(async_engine.call(lambda e: "after the step"))
            now = async_engine.call_now(lambda e: e.lock_held() and not e.end_model_run.is_set())
            assert await asyncio.wait_for(now, WAIT_S) is True
            assert not later.done()  # the engine thread is still inside the model run
            engine.end_model_run.set()
            assert await asyncio.wait_for(later, WAIT_S) == "after the step"
        finally:
            async_engine.shutdown()

    asyncio.run(main())


def test_call_now_on_an_engine_without_a_lock_is_call():
    async def main() -> None:
        engine = SimpleNamespace(
            block_manager=SimpleNamespace(num_used_blocks=0, num_blocks=1),
            num_running=0,
            num_waiting=0,
            has_unfinished_requests=lambda: False,
        )
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            thread = await async_engine.call_now(lambda e: threading.current_thread().name)
            assert thread == "engine-loop"
        finally:
            async_engine.shutdown()

    asyncio.run(main())
