"""Loading the default model in a fresh process: from the GGUF file against the converted-model
cache (``splitserve.models.gguf_cache``).

Each load runs in its own Python process (as a worker start does) and is timed inside it,
from before ``load_model`` to a model and tokenizer ready (the imports are timed apart).
The three ways alternate, round after round, so a drifting machine moves them alike:

- ``file``: ``SPLITSERVE_MODEL_CACHE=off``, what every load cost before the cache;
- ``convert``: an empty cache, i.e. the first load, which also writes the entry;
- ``cached``: the entry the previous ``convert`` wrote.

    .venv/bin/python benchmarks/model_load.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import json, time
t0 = time.perf_counter()
from splitserve.models.loader import load_model
t1 = time.perf_counter()
loaded = load_model()
t2 = time.perf_counter()
assert loaded.tokenizer is not None
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1}))
"""


def timed_load(cache: str) -> dict[str, float]:
    env = {**os.environ, "SPLITSERVE_MODEL_CACHE": cache}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    times: dict[str, list[float]] = {"file": [], "convert": [], "cached": []}
    for r in range(args.rounds):
        root = tempfile.mkdtemp(prefix="splitserve-load-bench-")
        try:
            row = {
                "file": timed_load("off"),
                "convert": timed_load(root),
                "cached": timed_load(root),
            }
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for way, t in row.items():
            times[way].append(t["load_s"])
        print(
            f"round {r + 1}: "
            + ", ".join(
                f"{w} {t['load_s']:.2f} s (imports {t['import_s']:.2f} s)" for w, t in row.items()
            )
        )
    med = {way: statistics.median(v) for way, v in times.items()}
    print(
        f"median load: file {med['file']:.2f} s, convert {med['convert']:.2f} s, "
        f"cached {med['cached']:.2f} s -> cached is {med['file'] / med['cached']:.2f}x faster "
        f"than the file; load average at the end: {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
