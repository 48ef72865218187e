"""The engine's C++ kernels (``models/csrc``), compiled on first use for this machine's CPU.

Each source is built once with the system's ``g++`` against the installed torch (``-O3
-march=native``, a few seconds) into ``$XDG_CACHE_HOME/splitserve/kernels`` (or
``SPLITSERVE_KERNEL_CACHE``), named by a digest of the sources, torch's version, the flags, the
variant and the CPU's flags, and loaded with ``torch.ops.load_library``: the ops then appear
under ``torch.ops.splitserve``. The variant is the widest vector ISA the CPU has (``VARIANTS``:
AVX-512, else AVX2 with FMA; ``csrc/vec16.h`` holds the lanes of each). Where there is no
compiler, neither ISA, or the build fails, ``load`` returns the reason and the caller keeps its
portable path. A kernel may need more (``NEEDS``: AMX for ``amx_linear``); where the CPU lacks
it, ``load`` says so. ``SPLITSERVE_NATIVE=0`` turns every native kernel off,
``SPLITSERVE_NATIVE_OFF=name,...`` the ones named (``KERNELS``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CACHE_ENV = "SPLITSERVE_KERNEL_CACHE"
SWITCH_ENV = "SPLITSERVE_NATIVE"
OFF_ENV = "SPLITSERVE_NATIVE_OFF"
CSRC = Path(__file__).parent / "csrc"
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c++20", "-fopenmp")
# The builds, best first: a name (its -DSPLITSERVE_<NAME> selects csrc/vec16.h's lanes) and
# the CPU flags it needs (/proc/cpuinfo names).
VARIANTS = (("avx512", ("avx512f",)), ("avx2", ("avx2", "fma")))
KERNELS = ("paged_decode", "panel_linear", "fused_ops", "decode_step", "amx_linear")  # csrc/*.cpp
# Kernels that need more than their variant: the build and the CPU flags each one needs.
NEEDS = {"amx_linear": ("avx512", ("amx_tile", "amx_bf16"))}


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV, "").strip()
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "splitserve" / "kernels"


def variant(flags: frozenset[str]) -> str | None:
    """The build a CPU with ``flags`` gets: the first of ``VARIANTS`` whose flags it has, or
    ``None``."""
    for name, needs in VARIANTS:
        if all(f in flags for f in needs):
            return name
    return None


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's flags as ``/proc/cpuinfo`` names them (empty where it cannot be read)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def load(name: str) -> str | None:
    """Build (once per machine) and load ``csrc/<name>.cpp``. Returns ``None`` once its ops are
    registered, else why they are not (logged once)."""
    reason = _load(name)
    if reason is not None:
        log.info("native kernel %s is off: %s", name, reason)
    else:
        log.info("native kernel %s: the %s build", name, variant(cpu_flags()))
    return reason


def load_all() -> dict[str, str | None]:
    """Build and load every kernel (``make install`` does, so that no worker waits for one):
    each name with ``load``'s answer."""
    return {name: load(name) for name in KERNELS}


@contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """torch's intra-op thread count (which the kernels run on) set to ``threads`` for the
    block, then restored."""
    before = torch.get_num_threads()
    if threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads != before:
            torch.set_num_threads(before)


def _load(name: str) -> str | None:
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return f"{SWITCH_ENV}=0"
    if name in os.environ.get(OFF_ENV, "").replace(" ", "").split(","):
        return f"{OFF_ENV} names it"
    flags = cpu_flags()
    isa = variant(flags)
    if isa is None:
        return "the CPU has neither avx512f nor avx2 and fma"
    if name in NEEDS:
        build, needs = NEEDS[name]
        missing = [f for f in needs if f not in flags]
        if isa != build or missing:
            return f"it needs the {build} build and the CPU flags {', '.join(needs)}"
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        return "no C++ compiler (g++ or $CXX) on PATH"
    source = CSRC / f"{name}.cpp"
    defines = (f"-DSPLITSERVE_{isa.upper()}",)
    digest = hashlib.sha256()
    for header in sorted(CSRC.glob("*.h")):  # what the sources include
        digest.update(header.read_bytes())
    for part in (source.read_bytes(), torch.__version__.encode(), " ".join(_FLAGS).encode()):
        digest.update(part)
    digest.update(" ".join((*defines, *sorted(flags))).encode())
    target = cache_dir() / f"{name}-{isa}-{digest.hexdigest()[:20]}.so"
    if not target.exists():
        error = _build(compiler, source, target, defines)
        if error is not None:
            return error
    torch.ops.load_library(str(target))
    return None


def _build(compiler: str, source: Path, target: Path, defines: tuple[str, ...]) -> str | None:
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: workers starting together may each
    # build, and none loads a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [
        compiler,
        *_FLAGS,
        *defines,
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        str(source),
        "-o",
        tmp,
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_lib}",
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        return f"building {source.name} failed: {e}"
    if done.returncode != 0:
        os.unlink(tmp)
        last = done.stderr.strip().splitlines()[-1:] or ["no output"]
        return f"building {source.name} failed: {last[0]}"
    os.replace(tmp, target)
    return None
