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

mypyc compiles an ``__init__`` written in a class but leaves the one ``@dataclass`` generates
to the interpreter, 6-25x slower to build an object (docs/journal/2026-12-01.md). The copy
gets one written out (``write_inits``) in each dataclass of ``NATIVE_INITS``, which the
simulator makes by the million; the sources keep plain dataclasses.

``--pgo`` builds twice, the second time on the profile of a short ``sim_scale.py`` run on the
first (about 3 minutes against 1); its gain was within this machine's noise, so it is not
``make sim-compiled``'s default (docs/simulator.md, "## Scale").
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
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
    "splitserve/workload/metrics.py",
    "splitserve/workload/sessions.py",
    "splitserve/common/kv_hash.py",
    "splitserve/common/sampling_params.py",
    "splitserve/engine/block_manager.py",
    "splitserve/engine/block_views.py",
    "splitserve/engine/cache_events.py",
    "splitserve/engine/free_queue.py",
    "splitserve/engine/plan.py",
    "splitserve/engine/scheduler.py",
    "splitserve/engine/sequence.py",
    "splitserve/router/placement.py",
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
    "splitserve/sim/lazy_decodes.py",
    "splitserve/sim/shared_cores.py",
    "splitserve/sim/state.py",
    "splitserve/sim/step_log.py",
    "splitserve/sim/stepping.py",
]
# The dataclasses whose ``__init__`` the compiled copy writes out, by module.
NATIVE_INITS = {
    "splitserve/engine/block_manager.py": ["PrefixMatch"],
    "splitserve/engine/plan.py": ["ScheduledChunk", "StepPlan", "StepResult"],
    "splitserve/engine/scheduler.py": ["SequenceUpdate"],
    "splitserve/engine/sequence.py": ["Sequence"],
    "splitserve/router/policies/base.py": ["RequestInfo"],
    "splitserve/sim/cost_model.py": ["StepShape", "DecodeLine"],
    "splitserve/sim/engine.py": ["_Run"],
    "splitserve/sim/lazy_decodes.py": ["StepReport"],
    "splitserve/sim/state.py": ["SimRequest"],
    "splitserve/workload/metrics.py": ["RequestRecord"],
    "splitserve/workload/sessions.py": ["Segment", "TurnSpec", "SessionSpec"],
}

# The profile-guided build's training run (``--pgo``): the benchmark's own setup, small.
PGO_TRAINING = ["--sessions", "4000", "--block-size", "64"]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stale_sources(tree: Path) -> list[str]:
    """The compiled modules whose source in ``src/`` changed since ``tree`` was built."""
    manifest = tree / MANIFEST
    if not manifest.exists():
        return list(MODULES)
    built = dict(line.split(maxsplit=1)[::-1] for line in manifest.read_text().splitlines())
    return [m for m in MODULES if built.get(m) != digest(SRC / m)]


def write_inits(source: str, classes: list[str]) -> str:
    """``source`` with the ``__init__`` that ``@dataclass`` generates written out in each
    of the dataclasses ``classes``: every field in order with its default (None standing for
    a ``default_factory``, which makes a fresh value per instance), a frozen class's fields
    set through ``object.__setattr__``, then ``__post_init__`` where the class has one."""
    tree = ast.parse(source)
    found = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef) and c.name in classes}
    if len(found) != len(classes):
        raise ValueError(f"no class {sorted(set(classes) - set(found))} at the top level")
    lines = source.splitlines(keepends=True)
    for cls in sorted(found.values(), key=lambda c: c.lineno, reverse=True):
        lines.insert(cls.body[-1].end_lineno or cls.lineno, _init_source(cls))
    return "".join(lines)


def _init_source(cls: ast.ClassDef) -> str:
    options = [d for d in cls.decorator_list if "dataclass" in ast.unparse(d)]
    methods = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    if len(options) != 1 or "__init__" in methods:
        raise ValueError(f"{cls.name} is not a dataclass without an __init__ of its own")
    frozen = "frozen=True" in ast.unparse(options[0])
    params, body = [], []
    for stmt in cls.body:
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        name, kind = stmt.target.id, ast.unparse(stmt.annotation)
        param, value = _param(cls.name, name, kind, stmt.value)
        params.append(param)
        body.append(
            f"object.__setattr__(self, {name!r}, {value})" if frozen else f"self.{name} = {value}"
        )
    if "__post_init__" in methods:
        body.append("self.__post_init__()")
    indent = " " * (cls.col_offset + 4)
    head = f"\n{indent}def __init__(self, {', '.join(params)}) -> None:\n"
    return head + "".join(f"{indent}    {line}\n" for line in body)


def _param(cls: str, name: str, kind: str, default: ast.expr | None) -> tuple[str, str]:
    """A field's parameter of ``__init__``, and the value the field takes."""
    if kind.startswith(("ClassVar", "InitVar", "KW_ONLY", "dataclasses.")):
        raise ValueError(f"{cls}.{name}: {kind} fields are not written out")
    if default is None:
        return f"{name}: {kind}", name
    is_field = isinstance(default, ast.Call) and ast.unparse(default.func) == "field"
    if not is_field:
        return f"{name}: {kind} = {ast.unparse(default)}", name
    assert isinstance(default, ast.Call)
    options = {k.arg: k.value for k in default.keywords}
    if default.args or len(options) != 1 or set(options) - {"default", "default_factory"}:
        raise ValueError(f"{cls}.{name}: only field(default=) or field(default_factory=)")
    if "default" in options:
        return f"{name}: {kind} = {ast.unparse(options['default'])}", name
    if "None" in kind:  # None stands for the factory's value
        raise ValueError(f"{cls}.{name}: a default_factory field that may hold None")
    factory = ast.unparse(options["default_factory"])
    return f"{name}: {kind} | None = None", f"{factory}() if {name} is None else {name}"


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


def build(out: Path, cflags: str = "", opt_level: str = "3", pgo: bool = False) -> None:
    """Compile ``MODULES`` into ``out``; with ``pgo`` twice, the second on the first's profile.

    ``cflags`` go to the C compiler (and the linker) after Python's own and before mypyc's
    (so an ``-O`` there is overridden: ``opt_level`` is mypyc's). With ``pgo`` the first build
    is instrumented (``-fprofile-generate``), a short run of ``sim_scale.py`` on it records
    where the time goes (``PGO_TRAINING``), and the second build, at the same paths (gcc finds
    the profile by the object files' paths), is optimised for that (``-fprofile-use``).
    """
    if pgo:
        profile = (out / "pgo-profile").resolve()
        shutil.rmtree(profile, ignore_errors=True)
        _compile(out, f"{cflags} -fprofile-generate={profile}", opt_level)
        t0 = time.perf_counter()
        cmd = [sys.executable, str(ROOT / "benchmarks" / "sim_scale.py"), *PGO_TRAINING]
        subprocess.run([*cmd, "--compiled", str(out)], check=True, stdout=subprocess.DEVNULL)
        print(f"pgo: training run took {time.perf_counter() - t0:.0f} s", flush=True)
        # -fprofile-partial-training: code the training run never reached stays optimised
        # as without a profile (not for size), so what it missed runs at the plain speed.
        use = f"-fprofile-use={profile} -fprofile-correction -fprofile-partial-training"
        _compile(out, f"{cflags} {use} -Wno-missing-profile", opt_level)
    else:
        _compile(out, cflags, opt_level)


def _compile(out: Path, cflags: str, opt_level: str) -> None:
    shutil.rmtree(out / "splitserve", ignore_errors=True)
    shutil.rmtree(out / "build", ignore_errors=True)
    (out / MANIFEST).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(SRC / "splitserve", out / "splitserve")
    # Digests of the sources copied, not of src/ after the build (it may change meanwhile).
    lines = [f"{digest(out / m)}  {m}" for m in MODULES]
    for module, classes in NATIVE_INITS.items():
        copy = out / module
        copy.write_text(write_inits(copy.read_text(), classes))
    (out / "mypy.ini").write_text(MYPY_CONFIG)
    env = dict(os.environ, MYPYC_OPT_LEVEL=opt_level)
    if cflags.strip():
        # setuptools takes a CFLAGS in the environment in place of Python's own (-DNDEBUG
        # -fwrapv -O3 ...), so those go first.
        base = env.get("CFLAGS", sysconfig.get_config_var("CFLAGS") or "")
        env["CFLAGS"] = f"{base} {cflags.strip()}"
    cmd = [sys.executable, "-m", "mypyc", "--config-file", "mypy.ini", *MODULES]
    subprocess.run(cmd, cwd=out, check=True, env=env)
    (out / MANIFEST).write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "build" / "sim-compiled"))
    ap.add_argument("--opt-level", default="3", choices="0123", help="mypyc's (the C -O level)")
    ap.add_argument("--cflags", default="", help="more C compiler flags, e.g. -march=native")
    ap.add_argument(
        "--pgo",
        action="store_true",
        help="profile-guided: build instrumented, run a short simulation, build on its profile",
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    build(Path(args.out), args.cflags, args.opt_level, args.pgo)
    print(f"compiled {len(MODULES)} modules into {args.out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
