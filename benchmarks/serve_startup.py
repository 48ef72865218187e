"""Time from ``splitserve serve`` (what ``make serve`` runs) to its first answer, against an
earlier commit of this repository, on a machine where the install is done.

Each variant is a ``src/`` tree: this checkout's, and ``--baseline``'s extracted with ``git
archive`` (default: the commit before the engine's vLLM-speed work). Both run on this
checkout's virtualenv with their ``src`` first on ``PYTHONPATH``. One untimed start of each fills
the caches an install leaves (converted model, compiled kernels); then the variants alternate,
round after round, so a drifting machine moves them alike. A round starts ``splitserve serve
--host 127.0.0.1 --port P`` in its own process group and times, from the launch:

- ``ready``: the first ``GET /health`` answered 200;
- ``answer``: the first chat completion (8 tokens, greedy) answered 200, asked as soon as the
  server is ready.

then ends the whole group.

    .venv/bin/python benchmarks/serve_startup.py [--rounds 5] [--baseline REV]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import httpx

from splitserve.cluster.local import free_port, healthy, stop_group

ROOT = Path(__file__).resolve().parents[1]
# The parent of 746d61a, the first commit of the engine-vs-vLLM work (--dtype auto).
DEFAULT_BASELINE = "746d61a^"
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="timed starts of each variant")
    p.add_argument("--baseline", default=DEFAULT_BASELINE, help="git revision to compare with")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a start may take")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if not args.timeout > 0:
        p.error("--timeout must be > 0")
    return args


def extract_src(rev: str, dest: Path) -> Path:
    """``rev``'s ``src/`` tree under ``dest``; returns its ``src`` directory."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", rev, "src"],
            capture_output=True,
            check=True,
        ).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"git archive {rev}: {e.stderr.decode().strip()}") from None
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest / "src"


def launch(src: Path, port: int, log: Path) -> subprocess.Popen:
    """``splitserve serve`` from ``src`` on ``port``, in a session of its own (its workers too),
    its output appended to ``log``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [str(Path(sys.executable).parent / "splitserve"), "serve", "--host", "127.0.0.1"]
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*cmd, "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def first_answer(
    proc: subprocess.Popen, url: str, start: float, timeout: float
) -> dict[str, float]:
    """Seconds from ``start`` to the server at ``url`` ready, and to its first chat answer."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    deadline = start + timeout
    while not healthy(url):
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode} before it was ready")
        if time.perf_counter() > deadline:
            raise SystemExit(f"serve not ready in {timeout:.0f} s")
        time.sleep(0.05)
    times = {"ready": time.perf_counter() - start}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
    if reply.status_code != 200:
        raise SystemExit(f"serve answered {reply.status_code}: {reply.text}")
    times["answer"] = time.perf_counter() - start
    return times


def one_start(src: Path, timeout: float, log: Path) -> dict[str, float]:
    """Start ``serve`` from ``src``, time readiness and the first answer, stop it."""
    port = free_port()
    start = time.perf_counter()
    proc = launch(src, port, log)
    try:
        return first_answer(proc, f"http://127.0.0.1:{port}", start, timeout)
    except SystemExit as e:
        raise SystemExit(f"{src}: {e}; its output: {log}") from None
    finally:
        stop_group(proc)


def cpu_description() -> str:
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wide = sorted(f for f in flags if f in {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"})
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(wide) or 'no AVX2'}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline],
        capture_output=True,
        text=True,
    )
    if rev.returncode != 0:
        raise SystemExit(f"--baseline {args.baseline}: not a revision of {ROOT}")
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(f"CPU: {cpu_description()}")
    with tempfile.TemporaryDirectory(prefix="serve-startup-") as tmp:
        variants = {
            f"baseline {rev.stdout.strip()}": extract_src(args.baseline, Path(tmp) / "baseline"),
            f"this checkout ({head})": ROOT / "src",
        }
        log = Path(tmp) / "serve.log"
        for name, src in variants.items():  # the caches an install leaves
            one_start(src, args.timeout, log)
            print(f"warm-up: {name}")
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for r in range(args.rounds):
            for name, src in variants.items():
                times = one_start(src, args.timeout, log)
                runs[name].append(times)
                print(
                    f"round {r + 1}: {name}: ready {times['ready']:.2f} s, "
                    f"answer {times['answer']:.2f} s"
                )
    medians = {
        name: {k: statistics.median(t[k] for t in times) for k in ("ready", "answer")}
        for name, times in runs.items()
    }
    (base, base_t), (ours, ours_t) = medians.items()
    print(f"\nmedian of {args.rounds}    ready     first answer")
    for name, t in medians.items():
        print(f"{name:24s} {t['ready']:6.2f} s  {t['answer']:6.2f} s")
    ratio = ours_t["answer"] / base_t["answer"]
    print(f"first answer: {ratio:.2f}x the baseline's time (goal: <= 1.0x)")
    if args.json:
        result = {"cpu": cpu_description(), "rounds": runs, "medians": medians, "ratio": ratio}
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
