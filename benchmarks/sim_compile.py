"""Compile the simulator's hot, torch-free modules with mypyc into a separate tree.

The simulator spends its time in plain Python: the real scheduler, block manager, free
queue, hash chain, routing policies and ring, and the simulator's own engine, cluster, cost
model and event queue. mypyc compiles these (typed) modules to C extensions without changing
what they compute: ``benchmarks/sim_fingerprint.py`` gives the same hashes on both.

The compiled copy goes to ``--out`` (``build/sim-compiled``), never into ``src/``, so an
edited source is never shadowed by a stale extension. ``SOURCES.sha256`` there records the
sources it was built from; ``use_compiled`` (for the benchmarks) refuses a stale tree::

    .venv/bin/python benchmarks/sim_compile.py          # or: make sim-compiled
    .venv/bin/python benchmarks/sim_scale.py --compiled build/sim-compiled
    PYTHONPATH=build/sim-compiled .venv/bin/python -m pytest -q tests/sim
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
MANIFEST = "SOURCES.sha256"
# mypy follows imports for their types; the heavy third-party ones (torch above all) would
# take minutes and gigabytes to analyse and are never called on the simulator's paths.
SKIPPED = "torch transformers tokenizers gguf safetensors numpy fastapi starlette pydantic uvicorn"
SKIPPED += " httpx prometheus_client cryptography matplotlib"
MYPY_CONFIG = (
    "[mypy]\nignore_missing_imports = True\nfollow_imports = silent\n"
    f"[mypy-{','.join(f'{m}.*' for m in SKIPPED.split())}]\nfollow_imports = skip\n"
)
MODULES = [
    "splitserve/bench/metrics.py",
    "splitserve/bench/workloads.py",
    "splitserve/common/kv_hash.py",
    "splitserve/common/sampling_params.py",
    "splitserve/engine/block_manager.py",
    "splitserve/engine/free_queue.py",
    "splitserve/engine/plan.py",
    "splitserve/engine/scheduler.py",
    "splitserve/engine/sequence.py",
    "splitserve/router/ring.py",
    "splitserve/router/worker.py",
    "splitserve/router/policies/__init__.py",
    "splitserve/router/policies/base.py",
    "splitserve/router/policies/least_loaded.py",
    "splitserve/router/policies/prefix.py",
    "splitserve/router/policies/round_robin.py",
    "splitserve/router/policies/session.py",
    "splitserve/sim/chat.py",
    "splitserve/sim/cluster.py",
    "splitserve/sim/cost_model.py",
    "splitserve/sim/engine.py",
    "splitserve/sim/events.py",
    "splitserve/sim/feed.py",
    "splitserve/sim/kv_moves.py",
    "splitserve/sim/shared_cores.py",
    "splitserve/sim/state.py",
    "splitserve/sim/step_log.py",
]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stale_sources(tree: Path) -> list[str]:
    """The compiled modules whose source in ``src/`` changed since ``tree`` was built."""
    manifest = tree / MANIFEST
    if not manifest.exists():
        return list(MODULES)
    built = dict(line.split(maxsplit=1)[::-1] for line in manifest.read_text().splitlines())
    return [m for m in MODULES if built.get(m) != digest(SRC / m)]


def use_compiled(tree: str) -> None:
    """Import ``splitserve`` from the compiled ``tree`` (call before importing it)."""
    path = Path(tree).resolve()
    if "splitserve" in sys.modules:
        raise RuntimeError("use_compiled must run before splitserve is imported")
    stale = stale_sources(path)
    if stale:
        raise SystemExit(
            f"{path} is stale or missing ({', '.join(stale[:3])}...): "
            "run benchmarks/sim_compile.py (make sim-compiled) again"
        )
    sys.path.insert(0, str(path))


def build(out: Path) -> None:
    shutil.rmtree(out / "splitserve", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(SRC / "splitserve", out / "splitserve")
    # Digests of the copies compiled, not of src/ after the build (it may change meanwhile).
    lines = [f"{digest(out / m)}  {m}" for m in MODULES]
    (out / "mypy.ini").write_text(MYPY_CONFIG)
    cmd = [sys.executable, "-m", "mypyc", "--config-file", "mypy.ini", *MODULES]
    subprocess.run(cmd, cwd=out, check=True)
    (out / MANIFEST).write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "build" / "sim-compiled"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    build(Path(args.out))
    print(f"compiled {len(MODULES)} modules into {args.out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
