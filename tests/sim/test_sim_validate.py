"""``benchmarks/sim_validate.py``: which simulated system and which seed a stored real run gets."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from splitserve.sim.deployment import Deployment

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_validate.py"


def load_script():
    spec = importlib.util.spec_from_file_location("sim_validate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repeats_replay_the_same_seeds_and_a_sweep_the_next_ones():
    sv = load_script()
    repeats = [{"deployment": d, "repeat": k} for k in (1, 2) for d in ("rr", "tiers")]
    assert sv.load_indices(repeats) == [0, 0, 0, 0]
    sweep = [{"deployment": d} for d in ("rr", "rr", "tiers", "tiers")]
    assert sv.load_indices(sweep) == [0, 1, 0, 1]


def test_the_stored_serve_command_line_sets_the_simulated_system():
    sv = load_script()
    argv = "--port 1 --prefill 0 --decode 4 --threads-per-worker 1 --policy session "
    argv += "--host-kv-gb 2 --kv-cache-gb 0.06 --load-floor 3 --kv-peer-fetch"
    info = {"deployment": f"collocated-session-tiers-peer: collocated; {argv}"}
    run = {"deployment": "collocated-session-tiers-peer", "summary": {"info": info}}
    dep, settings = sv.simulated_system(run)
    assert dep == Deployment(collocated=4)
    assert settings["kv_peer_fetch"] is True and settings["load_floor"] == 3
    assert (settings["host_kv_gb"], settings["kv_cache_gb"]) == (2.0, 0.06)
    info["deployment"] = info["deployment"].replace(" --kv-peer-fetch", "")
    assert sv.simulated_system(run)[1]["kv_peer_fetch"] is False
    # A run without its command line: the named deployment's flags, at two workers.
    run = {"deployment": "collocated-session-tiers-peer", "summary": {}}
    dep, settings = sv.simulated_system(run)
    assert dep == Deployment(collocated=2) and settings["kv_peer_fetch"] is True
