"""``splitserve sim plan``: which split of N GPUs serves the most traffic within the SLO.

For every candidate deployment (collocated, and every P:D split, at each TP) the planner
finds the highest session rate at which the SLO attainment stays at or above a target (the
DistServe definition of goodput), by bisection over the same seeded sessions arriving closer
together for a fixed duration; goodput per GPU is that rate's request goodput over the GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.run import simulate
from splitserve.workload.metrics import SLO
from splitserve.workload.sessions import Workload


@dataclass(frozen=True, slots=True)
class PlanRow:
    deployment: Deployment
    max_rate: float  # sessions/s at which attainment >= target (0: not even the lowest)
    goodput: float  # requests/s meeting the SLO at that rate
    attainment: float

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput / self.deployment.gpus


def candidates(gpus: int, tps: list[int], disagg: bool = True) -> list[Deployment]:
    out = []
    for tp in tps:
        workers = gpus // tp
        if workers < 1:
            continue
        out.append(Deployment(collocated=workers, tp=tp))
        if disagg:
            out += [Deployment(prefill=p, decode=workers - p, tp=tp) for p in range(1, workers)]
    return out


def max_rate(
    probe: Callable[[float], tuple[float, float]], lo: float, hi: float, target: float, iters: int
) -> tuple[float, float, float]:
    """Bisection for the highest rate in [lo, hi] whose attainment (``probe(rate)[0]``) is
    at least ``target``; returns (rate, goodput, attainment) there, rate 0 if none."""
    best = (0.0, 0.0, 0.0)
    att, good = probe(lo)
    if att < target:
        return best
    best = (lo, good, att)
    for _ in range(iters):
        mid = (lo + hi) / 2
        att, good = probe(mid)
        if att >= target:
            lo, best = mid, (mid, good, att)
        else:
            hi = mid
    return best


def plan(
    config: SimConfig,
    workload: Workload,
    deployments: list[Deployment],
    slo: SLO,
    duration_s: float,
    rate_range: tuple[float, float],
    target: float = 0.9,
    iters: int = 6,
) -> list[PlanRow]:
    """Every deployment's row, best goodput per GPU first."""
    rows = []
    for dep in deployments:

        def probe(rate: float, dep: Deployment = dep) -> tuple[float, float]:
            s = simulate(config, dep, workload, rate, duration_s, slo).summary
            return s.slo_attainment, s.request_goodput

        rate, good, att = max_rate(probe, *rate_range, target, iters)
        rows.append(PlanRow(dep, rate, good, att))
    rows.sort(key=lambda r: (-r.goodput_per_gpu, r.deployment.describe()))
    return rows


def format_plan(rows: list[PlanRow], slo: SLO, target: float) -> str:
    lines = [
        f"SLO {slo.describe()}, attainment >= {100 * target:g}%",
        f"{'deployment':<34}{'max rate (sess/s)':>18}{'goodput (req/s)':>17}{'per GPU':>10}",
    ]
    for r in rows:
        lines.append(
            f"{r.deployment.describe():<34}{r.max_rate:>18.3f}{r.goodput:>17.3f}"
            f"{r.goodput_per_gpu:>10.3f}"
        )
    return "\n".join(lines)
