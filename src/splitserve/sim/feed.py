"""Sessions whose random draws are made ahead, in a second process.

A seeded workload's sessions cost the simulation a numpy generator per session and a dozen
draw calls (a fifth of a large compiled run). They depend on nothing the simulation does, so
a child process makes them ahead, batch by batch, and the run replays them in order: the
same values in the same order, so the same sessions. Only compact arrays cross the pipe;
the run still builds the sessions (tuples of the shared token-id objects) itself::

    child:  session i's Generator ─▶ workload's session code ─▶ record every draw
                                                                  │ a batch of sessions:
                                                                  ▼ 3 arrays, one pickle
    run:    replay the draws in order ─▶ the same session code ─▶ SessionSpec

A full pipe stops the child: it runs at most a batch or two ahead. The child ends when the
``fed_sessions`` block ends, however it ends, and by itself when the run's end of the pipe
closes (the run killed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import itertools
import os
import pickle
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import numpy as np

from splitserve.bench.workloads import (
    AgenticConfig,
    MultiRoundQAConfig,
    RandomConfig,
    SessionSpec,
    Workload,
    session_rng,
)

# The workloads whose sessions take their draws from ``sessions(rate, rngs)``.
FED_WORKLOADS = (AgenticConfig, MultiRoundQAConfig, RandomConfig)
BATCH = 256  # sessions per message (~2 MB of agentic draws)


class DrawRecorder:
    """Session after session's ``Generator``, keeping every draw made from it."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = session_rng(seed, 0)
        self.arrays: list[np.ndarray] = []  # integers(..., size=n), in order
        self.scalars: list[Any] = []  # integers(...) without a size: numpy int64s
        self.normals: list[float] = []

    def streams(self) -> Iterator[DrawRecorder]:
        for i in itertools.count():
            self.rng = session_rng(self.seed, i)
            yield self

    def integers(self, low: int, high: int | None = None, size: int | None = None):
        value: Any = self.rng.integers(low, high, size)
        if size is None:
            self.scalars.append(value)
        else:
            self.arrays.append(value)
        return value

    def standard_normal(self) -> float:
        value = self.rng.standard_normal()
        self.normals.append(value)
        return value

    def take(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The draws made since the last ``take``, as three arrays."""
        arrays = np.concatenate(self.arrays) if self.arrays else np.empty(0, np.int64)
        batch = (arrays, np.array(self.scalars, np.int64), np.array(self.normals))
        self.arrays, self.scalars, self.normals = [], [], []
        return batch


class DrawReplay:
    """The recorded draws, given back in the order they were made. The session code asks
    for the same draws in the same order (its calls depend only on earlier draws), so each
    kind of draw is one queue."""

    def __init__(self) -> None:
        self.load((np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0)))

    def load(self, batch: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        self._arrays, self._scalars, normals = batch
        self._normals = normals.tolist()  # Python floats, as Generator.standard_normal gives
        self._a = self._s = self._n = 0

    def integers(self, low: int, high: int | None = None, size: int | None = None):
        if size is None:
            self._s += 1
            return self._scalars[self._s - 1]  # a numpy int64, as the Generator gives
        self._a += size
        return self._arrays[self._a - size : self._a]

    def standard_normal(self) -> float:
        self._n += 1
        return self._normals[self._n - 1]


@contextlib.contextmanager
def fed_sessions(workload: Workload, rate: float | None) -> Iterator[Iterator[SessionSpec]]:
    """``workload.sessions(rate)``, the same sessions, with their draws made ahead in a child
    process; it is stopped when the block ends."""
    if not isinstance(workload, FED_WORKLOADS):
        raise ValueError(f"sessions drawn ahead need a seeded workload, not {workload.name}")
    # A fresh interpreter on the same modules (``sys.path``: a compiled build too), rather
    # than a fork of the run's heap or multiprocessing's re-import of the main script.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = "from splitserve.sim.feed import child_main; child_main()"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    recv = None
    try:
        assert child.stdin is not None and child.stdout is not None
        with child.stdin:
            pickle.dump(_fields(workload), child.stdin)
        recv = Connection(os.dup(child.stdout.fileno()))
        child.stdout.close()
        yield workload.sessions(rate, _replays(recv, child))
    finally:
        if recv is not None:
            recv.close()
        child.terminate()
        child.wait()


def _fields(value: object) -> object:
    """A workload config as (class, init fields), nested: compiled (mypyc) frozen dataclasses
    do not unpickle."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return value
    kwargs = {f.name: _fields(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    return _Config(type(value).__module__, type(value).__qualname__, kwargs)


def _build(value: object) -> object:
    if not isinstance(value, _Config):
        return value
    cls = getattr(importlib.import_module(value.module), value.qualname)
    return cls(**{k: _build(v) for k, v in value.kwargs.items()})


class _Config(NamedTuple):
    module: str
    qualname: str
    kwargs: dict[str, object]


def _replays(recv: Connection, child: subprocess.Popen) -> Iterator[DrawReplay]:
    replay = DrawReplay()
    while True:
        try:
            count, batch = recv.recv()
        except EOFError:
            code = child.wait()
            raise RuntimeError(f"the session-draws process ended (exit {code})") from None
        replay.load(batch)
        for _ in range(count):
            yield replay


def child_main() -> None:
    """The child: the workload from stdin; its sessions' draws to stdout, batch by batch."""
    workload = _build(pickle.load(sys.stdin.buffer))
    assert isinstance(workload, FED_WORKLOADS)
    send = Connection(os.dup(1))
    os.dup2(2, 1)  # anything printed goes to stderr, not into the pipe
    recorder = DrawRecorder(workload.seed)
    sessions = workload.sessions(None, recorder.streams())
    try:
        while True:
            deque(itertools.islice(sessions, BATCH), maxlen=0)
            send.send((BATCH, recorder.take()))
    except (BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        pass  # the run ended or was interrupted: nothing to say
