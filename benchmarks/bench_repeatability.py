"""How far one real `bench compare` run is from another of the same command: the real
system's own spread, the floor under any prediction of it (the simulator's 15% included).

Reads the ``--json`` files of two or more runs of one `splitserve bench compare` command and
prints, per deployment and load, goodput, p50 TTFT and the engines' CPU seconds of each, and
each run's ratio to the first::

    .venv/bin/python benchmarks/bench_repeatability.py run1.json run2.json
"""

from __future__ import annotations

import argparse
import json


def rows(path: str) -> dict[tuple[str, str], dict]:
    with open(path) as f:
        runs = json.load(f)
    return {(r["deployment"], r["load"]): r["summary"] for r in runs}


def figures(summary: dict) -> tuple[float, float, float | None]:
    cpu = summary.get("server", {}).get("engine_cpu_seconds")
    return summary["request_goodput"], summary["ttft"]["median"], cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="bench compare --json files of the same command")
    args = ap.parse_args()
    if len(args.runs) < 2:
        ap.error("give at least two runs")
    tables = [rows(p) for p in args.runs]
    keys = [k for k in tables[0] if all(k in t for t in tables[1:])]
    if not keys:
        raise SystemExit("the runs share no deployment and load: not the same command")
    print("| deployment | load | run | goodput, req/s | vs first | p50 TTFT, ms | vs first "
          "| engine CPU, s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for key in keys:
        g0, t0, _ = figures(tables[0][key])
        for i, table in enumerate(tables, 1):
            g, t, cpu = figures(table[key])
            cpu_s = "" if cpu is None else f"{cpu:.1f}"
            print(
                f"| {key[0]} | {key[1]} | {i} | {g:.3f} | {g / g0:.2f} | {t:.0f} | {t / t0:.2f} "
                f"| {cpu_s} |"
            )


if __name__ == "__main__":
    main()
