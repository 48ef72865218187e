"""Sessions drawn ahead in a second process (sim/feed.py): the same sessions, the same run,
and the process never outlives its block (normal end, an error, Ctrl-C, the run killed)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from splitserve.common.kv_hash import BlockChain, root_hash
from splitserve.sim.chat import rendered, synthetic_stream
from splitserve.sim.cluster import Cluster, chain_plan
from splitserve.sim.feed import BATCH, ChainPlan, fed_sessions
from splitserve.workload.sessions import AgenticConfig, MultiRoundQAConfig, RandomConfig
from tests.sim.helpers import DISAGG, config, run

CHILD_MARK = "splitserve.sim.feed import child_main"


def _draw_children(parent: int) -> list[int]:
    """The session-draws processes whose parent is ``parent`` (read from /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        if ppid == parent and CHILD_MARK in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True  # exited; its parent (not us) reaps it
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("make", [AgenticConfig, MultiRoundQAConfig, RandomConfig])
def test_fed_sessions_are_the_same_sessions_made_of_the_shared_ids(make):
    workload = make(seed=7)
    n = BATCH + 20  # across a batch boundary
    direct = list(itertools.islice(workload.sessions(2.0), n))
    with fed_sessions(workload, 2.0) as sessions:
        fed = list(itertools.islice(sessions, n))
    assert fed == direct
    for a, b in zip(direct[-5:], fed[-5:], strict=True):
        for ta, tb in zip(a.turns, b.turns, strict=True):
            assert all(x is y for x, y in zip(ta.output_ids, tb.output_ids, strict=True))


def test_a_run_on_fed_sessions_gives_the_same_records():
    cfg = config(block_size=16)
    _, direct = run(cfg, DISAGG, AgenticConfig(seed=2), 4.0, 60)
    with fed_sessions(AgenticConfig(seed=2), 4.0) as sessions:
        fed = run(cfg, DISAGG, _Sessions(sessions), 4.0, 60)[1]
    assert [(r.session_id, r.turn, r.ttft_s, r.e2e_s, r.cached_tokens) for r in fed] == [
        (r.session_id, r.turn, r.ttft_s, r.e2e_s, r.cached_tokens) for r in direct
    ]


@pytest.mark.parametrize("make", [AgenticConfig, MultiRoundQAConfig, RandomConfig])
@pytest.mark.parametrize("chat", [False, True])
def test_hashes_made_ahead_are_the_chains_the_run_would_compute(make, chat):
    plan = ChainPlan(root_hash("m"), 16, chat)
    n = BATCH + 20  # across a batch boundary
    with fed_sessions(make(seed=3), 2.0, plan) as fed:
        specs = list(itertools.islice(fed, n))
        ahead = [fed.take(s.session_id) for s in specs]
        assert fed.take(specs[0].session_id) == []  # taken once
    assert specs == list(itertools.islice(make(seed=3).sessions(2.0), n))
    for spec, hashes in zip(specs, ahead, strict=True):
        stream = synthetic_stream(spec, rendered(chat, spec.api))
        chain = BlockChain(plan.root, 16)
        chain.extend(stream, len(stream) // 16)  # hashed here, block by block
        assert hashes == chain.hashes and len(hashes) >= 1
        assert all(type(h) is bytes and len(h) == 16 for h in hashes)


def test_a_chain_takes_the_hashes_made_ahead_in_place_of_its_own():
    chain = BlockChain(b"r", 2)
    chain.ahead = [b"a", b"b"]
    chain.extend([1, 2, 3, 4, 5, 6], 3)
    assert chain.hashes[:2] == [b"a", b"b"] and chain.tokens == [(1, 2), (3, 4), (5, 6)]
    plain = BlockChain(b"r", 2)
    plain.extend([1, 2, 3, 4, 5, 6], 3)
    assert chain.hashes[2] != plain.hashes[2]  # chained to the parent given


@pytest.mark.parametrize(
    "make, chat, cfg_kw",
    [
        (AgenticConfig, False, {}),
        (AgenticConfig, True, {}),
        (MultiRoundQAConfig, True, {}),
        # replies cut at the context limit, and the turns after them refused
        (MultiRoundQAConfig, False, {"max_model_len": 500}),
    ],
)
def test_a_run_with_hashes_made_ahead_gives_the_same_records(make, chat, cfg_kw):
    cfg = config(block_size=16, chat_template=chat, **cfg_kw)
    workload = make(seed=2)
    cluster, direct = run(cfg, DISAGG, workload, 4.0, 60)
    with fed_sessions(workload, 4.0, chain_plan(cfg)) as fed:
        ahead = Cluster(cfg, DISAGG)
        records = ahead.run(fed, limit=60, fed=fed)
        assert ahead._fed is fed  # the plan matched: the hashes were used
    assert _records(records) == _records(direct)
    for a, b in zip(cluster.workers, ahead.workers, strict=True):
        bm, bm2 = a.engine.block_manager, b.engine.block_manager
        assert (bm.prefix_queries, bm.prefix_hits) == (bm2.prefix_queries, bm2.prefix_hits)
    if cfg_kw:
        assert any(r.ok and r.output_tokens < workload.answer_tokens for r in direct)
        assert any(not r.ok for r in direct)


def test_hashes_of_another_plan_are_not_used():
    cfg = config(block_size=16)
    with fed_sessions(AgenticConfig(seed=2), 4.0, ChainPlan(root_hash("other"), 16, False)) as fed:
        cluster = Cluster(cfg, DISAGG)
        cluster.run(fed, limit=5, fed=fed)
        assert cluster._fed is None


def _records(records):
    return [
        (r.session_id, r.turn, r.ok, r.ttft_s, r.e2e_s, r.cached_tokens, r.output_tokens)
        for r in records
    ]


class _Sessions:
    """An iterator of sessions in the shape ``helpers.run`` takes (``.sessions(rate)``)."""

    def __init__(self, sessions):
        self._sessions = sessions

    def sessions(self, rate):
        return self._sessions


def test_the_child_ends_with_the_block_and_after_an_error_in_it():
    with fed_sessions(AgenticConfig(), 1.0) as sessions:
        next(sessions)
        (child,) = _draw_children(os.getpid())
    assert _gone(child)
    with pytest.raises(ZeroDivisionError), fed_sessions(AgenticConfig(), 1.0) as sessions:
        next(sessions)
        (child,) = _draw_children(os.getpid())
        1 / 0  # noqa: B018
    assert _gone(child)


def test_a_dead_child_is_an_error_not_a_hang():
    with fed_sessions(RandomConfig(), 1.0) as sessions:
        (child,) = _draw_children(os.getpid())
        os.kill(child, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="session-draws process ended"):
            list(itertools.islice(sessions, 10 * BATCH))


def test_only_seeded_workloads_are_drawn_ahead():
    class Trace:
        name, seed = "trace", 0

    with pytest.raises(ValueError, match="seeded workload"), fed_sessions(Trace(), 1.0):
        pass


# The run restores Ctrl-C's default handler first: a process started in the background of a
# non-interactive shell (a CI script's `cmd &`) inherits SIGINT ignored, which a terminal's
# foreground job never does.
RUN = textwrap.dedent(
    """
    import os, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from splitserve.workload.sessions import AgenticConfig
    from splitserve.sim.feed import fed_sessions
    with fed_sessions(AgenticConfig(), 1.0) as sessions:
        next(sessions)
        print("ready", flush=True)
        time.sleep(60)
    """
)


def _start_run() -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_ctrl_c_ends_the_run_and_the_child_quietly():
    proc = _start_run()
    (child,) = _draw_children(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert "child_main" not in err  # the child left without a traceback
    assert _gone(child)


def test_the_child_ends_when_the_run_is_killed():
    proc = _start_run()
    (child,) = _draw_children(proc.pid)
    proc.kill()
    proc.communicate(timeout=30)
    assert _gone(child)  # its pipe closed: the next send fails and it returns


def test_sim_gen_workers_gives_the_same_run(tmp_path, capsys):
    from splitserve.cli import main

    outs = []
    for workers in ("0", "1"):
        out = tmp_path / f"run{workers}.json"
        args = ["sim", "--workload", "agentic", "--rate", "4", "--duration", "5"]
        assert (
            main(
                [
                    *args,
                    "--prefill",
                    "1",
                    "--decode",
                    "2",
                    "--gen-workers",
                    workers,
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
        outs.append(json.loads(out.read_text())[0]["requests"])
    assert outs[0] == outs[1] and len(outs[0]) > 40
    with pytest.raises(SystemExit):
        main(["sim", "--rate", "1", "--gen-workers", "2"])
    assert "invalid choice" in capsys.readouterr().err
