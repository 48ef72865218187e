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

With a ``ChainPlan`` (the run's hash root, block size and chat template) the child also
hashes each session's whole synthetic token stream into its block chain: the run's session
chains take those hashes instead of hashing their blocks (16 bytes a block cross the pipe;
the block tuples are still made in the run, of the shared ids). They hold while the
session's replies are its synthetic ones; the run drops them where a reply differs.

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
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import numpy as np

from splitserve.common.kv_hash import BlockHash, hash_blocks
from splitserve.sim.chat import rendered, synthetic_stream
from splitserve.workload.sessions import (
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
HASH_BYTES = 16  # a block hash (xxh3-128)


class ChainPlan(NamedTuple):
    """How the run hashes a session's blocks: its root hash, block size and whether chat
    sessions carry the chat template's tokens (``SimConfig.chat_template``)."""

    root: BlockHash
    block_size: int
    chat_template: bool


def session_hashes(spec: SessionSpec, plan: ChainPlan) -> list[BlockHash]:
    """The hashes of every full block of ``spec``'s synthetic stream, as the run's session
    chain would compute them."""
    stream = synthetic_stream(spec, rendered(plan.chat_template, spec.api))
    return hash_blocks(stream, plan.root, plan.block_size)


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


class FedSessions:
    """The sessions, in order; with a plan, each one's block hashes (``take``) from the
    time it is given out until the run takes them."""

    def __init__(self, plan: ChainPlan | None) -> None:
        self.plan = plan
        self.specs: Iterator[SessionSpec] = iter(())
        self._hashes: dict[str, list[BlockHash]] = {}
        self._blob = b""
        self._counts: list[int] = []
        self._next = 0  # the next session's index in the batch, and its first byte
        self._offset = 0

    def __iter__(self) -> FedSessions:
        return self

    def __next__(self) -> SessionSpec:
        spec = next(self.specs)  # loads the session's batch first
        if self.plan is not None:
            start = self._offset
            self._offset = end = start + self._counts[self._next] * HASH_BYTES
            self._next += 1
            blob = self._blob
            self._hashes[spec.session_id] = [
                blob[i : i + HASH_BYTES] for i in range(start, end, HASH_BYTES)
            ]
        return spec

    def load(self, hashes: tuple[list[int], bytes] | None) -> None:
        """A batch's block hashes: per session a count, then all of them, concatenated."""
        if hashes is not None:
            self._counts, self._blob = hashes
            self._next = self._offset = 0

    def take(self, session_id: str) -> list[BlockHash]:
        """The hashes of a session given out (empty without a plan, or taken already)."""
        return self._hashes.pop(session_id, [])


@contextlib.contextmanager
def fed_sessions(
    workload: Workload, rate: float | None, plan: ChainPlan | None = None
) -> Iterator[FedSessions]:
    """``workload.sessions(rate)``, the same sessions, with their draws made ahead in a child
    process (and, with ``plan``, their block hashes); it is stopped when the block ends."""
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
            pickle.dump((_fields(workload), None if plan is None else tuple(plan)), child.stdin)
        recv = Connection(os.dup(child.stdout.fileno()))
        child.stdout.close()
        fed = FedSessions(plan)
        fed.specs = workload.sessions(rate, _replays(recv, child, fed))
        yield fed
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


def _replays(recv: Connection, child: subprocess.Popen, fed: FedSessions) -> Iterator[DrawReplay]:
    replay = DrawReplay()
    while True:
        try:
            count, batch, hashes = recv.recv()
        except EOFError:
            code = child.wait()
            raise RuntimeError(f"the session-draws process ended (exit {code})") from None
        replay.load(batch)
        fed.load(hashes)
        for _ in range(count):
            yield replay


def child_main() -> None:
    """The child: the workload (and chain plan) from stdin; its sessions' draws (and block
    hashes) to stdout, batch by batch."""
    fields, plan_fields = pickle.load(sys.stdin.buffer)
    workload = _build(fields)
    assert isinstance(workload, FED_WORKLOADS)
    plan = ChainPlan(*plan_fields) if plan_fields is not None else None
    send = Connection(os.dup(1))
    os.dup2(2, 1)  # anything printed goes to stderr, not into the pipe
    recorder = DrawRecorder(workload.seed)
    sessions = workload.sessions(None, recorder.streams())
    try:
        while True:
            batch = list(itertools.islice(sessions, BATCH))
            hashes = None
            if plan is not None:
                chains = [session_hashes(spec, plan) for spec in batch]
                hashes = ([len(c) for c in chains], b"".join(h for c in chains for h in c))
            send.send((BATCH, recorder.take(), hashes))
    except (BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        pass  # the run ended or was interrupted: nothing to say
