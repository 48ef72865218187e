"""``serve --ray --autoscale``: the prefill:decode split chosen from what the workers serve.

Every interval the planner reads the decode workers' ``/metrics`` (every request ends on a
decode worker): requests finished, prompt tokens and how many of them were cached, generated
tokens. Over the interval that is a request rate and a mix (new prompt tokens and output
tokens per request). The calibrated simulator then plays that mix at that rate on every
split of the same number of workers (``sim.plan.candidates``: the collocated one is the
split with no prefill worker) and scores each by SLO attainment, then goodput.

Hysteresis: a split replaces the current one only when it is better by ``margin`` of
attainment (or, at equal attainment, of goodput per worker) on ``patience`` intervals in a
row; an interval with fewer than ``min_requests`` requests decides nothing. Every interval's
decision is kept with its reason.
"""

from __future__ import annotations

import ssl
import time
from dataclasses import asdict, dataclass

import httpx

from splitserve.workload.metrics import SLO

_COUNTERS = {
    "requests": "splitserve:request_success_total",
    "prompt": "splitserve:prompt_tokens_total",
    "cached": "splitserve:cached_prompt_tokens_total",
    "generated": "splitserve:generation_tokens_total",
}


@dataclass(frozen=True, slots=True)
class Mix:
    """What the workers served over one interval."""

    seconds: float
    requests: int
    new_prompt_tokens: float  # per request: prompt tokens not found cached
    output_tokens: float  # per request

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    at: float  # unix time
    mix: Mix
    current: tuple[int, int]  # (prefill, decode)
    best: tuple[int, int]
    scores: dict[str, tuple[float, float]]  # "P:D" -> (attainment, goodput per worker)
    action: str  # "scale", "keep" or "wait"
    reason: str

    def as_dict(self) -> dict:
        out = asdict(self)
        out["mix"]["rate"] = self.mix.rate
        return out


def scrape(
    url: str, headers: dict[str, str] | None = None, verify: ssl.SSLContext | bool = True
) -> dict[str, float]:
    """The planner's counters from one worker's ``/metrics``; ``verify``: what an https://
    worker is verified against."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=headers, timeout=5, verify=verify).text
    totals = dict.fromkeys(_COUNTERS, 0.0)
    wanted = {v: k for k, v in _COUNTERS.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                totals[wanted[sample.name]] += sample.value
    return totals


def mix_between(
    before: dict[str, dict], after: dict[str, dict], seconds: float, decode: set[str]
) -> Mix:
    """The mix of the requests finished between two scrapes of the same workers (a worker
    only in ``after``, or restarted, counts from zero). Requests and their output are counted
    where they end, on the ``decode`` workers; prompt tokens computed, on every worker (a
    decode worker counts the KV it pulled from a prefill worker as cached)."""
    d = dict.fromkeys(_COUNTERS, 0.0)
    for url, now in after.items():
        then = before.get(url)
        if then is None or now["requests"] < then["requests"]:
            then = dict.fromkeys(_COUNTERS, 0.0)
        for k in d:
            if k in ("prompt", "cached") or url in decode:
                d[k] += now[k] - then[k]
    n = int(d["requests"])
    if n == 0:
        return Mix(seconds, 0, 0.0, 0.0)
    return Mix(seconds, n, max(d["prompt"] - d["cached"], 0.0) / n, d["generated"] / n)


class Planner:
    """Scores splits of ``workers`` workers for a mix with the simulator."""

    def __init__(
        self,
        slo: SLO,
        hardware: str = "cpu-local",
        calibration: str | None = None,
        model: str = "smollm2-135m",
        host_cores: int | None = None,
        remote_prefill_threshold: int | None = None,
        margin: float = 0.05,
        patience: int = 2,
        min_requests: int = 4,
        sim_seconds: float = 60.0,
    ) -> None:
        from splitserve.sim.deployment import SimConfig
        from splitserve.sim.hardware import get_hardware, load_calibration
        from splitserve.sim.models import get_model

        hw = get_hardware(hardware)
        if calibration:
            hw = load_calibration(hw, calibration)
        dtype = "fp32" if "fp32" in hw.peak_flops else "bf16"
        extra = (
            {}
            if remote_prefill_threshold is None
            else {"remote_prefill_threshold": remote_prefill_threshold}
        )
        self.config = SimConfig(get_model(model), hw, dtype=dtype, host_cores=host_cores, **extra)
        self.slo, self.margin, self.patience = slo, margin, patience
        self.min_requests, self.sim_seconds = min_requests, sim_seconds
        self._streak: tuple[tuple[int, int], int] | None = None

    def scores(self, mix: Mix, workers: int) -> dict[tuple[int, int], tuple[float, float]]:
        """(prefill, decode) -> (SLO attainment, goodput per worker) of each split, as the
        simulator plays ``mix`` at its rate."""
        from splitserve.sim.deployment import Deployment
        from splitserve.sim.plan import candidates
        from splitserve.sim.run import simulate
        from splitserve.workload.sessions import RandomConfig

        workload = RandomConfig(
            input_len=max(1, round(mix.new_prompt_tokens)),
            output_len=max(1, round(mix.output_tokens)),
        )
        out = {}
        for dep in candidates(workers, [1]):
            split = (dep.prefill, dep.decode or dep.collocated)
            sim = Deployment(prefill=dep.prefill, decode=split[1]) if dep.prefill else dep
            s = simulate(self.config, sim, workload, mix.rate, self.sim_seconds, self.slo).summary
            out[split] = (s.slo_attainment, s.request_goodput / workers)
        return out

    def decide(self, mix: Mix, current: tuple[int, int]) -> Decision:
        """This interval's decision for a deployment now split ``current``."""
        workers = sum(current)
        if mix.requests < self.min_requests:
            self._streak = None
            reason = f"{mix.requests} requests in {mix.seconds:.0f}s: too few to judge"
            return Decision(time.time(), mix, current, current, {}, "keep", reason)
        scores = self.scores(mix, workers)
        best = max(scores, key=lambda s: (scores[s], s == current))
        here = scores.get(current, (0.0, 0.0))
        gain = scores[best][0] - here[0]
        better = gain >= self.margin or (
            gain > -1e-9 and scores[best][1] >= here[1] * (1 + self.margin) + 1e-9
        )
        table = {f"{p}:{d}": v for (p, d), v in scores.items()}
        seen = (
            f"{mix.rate:.2f} req/s, {mix.new_prompt_tokens:.0f} new prompt tokens and "
            f"{mix.output_tokens:.0f} output tokens per request"
        )
        if best == current or not better:
            self._streak = None
            reason = f"{seen}: {current[0]}:{current[1]} is best or within the margin"
            return Decision(time.time(), mix, current, current, table, "keep", reason)
        count = self._streak[1] + 1 if self._streak and self._streak[0] == best else 1
        self._streak = (best, count)
        reason = (
            f"{seen}: {best[0]}:{best[1]} attains {100 * scores[best][0]:.0f}% vs "
            f"{100 * here[0]:.0f}% for {current[0]}:{current[1]} ({count} of {self.patience})"
        )
        if count < self.patience:
            return Decision(time.time(), mix, current, best, table, "wait", reason)
        self._streak = None
        return Decision(time.time(), mix, current, best, table, "scale", reason)


class Autoscaler:
    """The controller's planning loop: one decision per ``interval`` seconds, from scrapes of
    the workers at both ends of it; an interval in which the pools were resizing is skipped."""

    def __init__(
        self,
        planner: Planner,
        interval: float,
        headers: dict[str, str],
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.planner, self.interval, self.headers = planner, interval, headers
        self.verify = verify
        self.decisions: list[Decision] = []
        self._last: tuple[float, dict[str, dict]] | None = None

    def step(
        self, workers: dict[str, str], sizes: tuple[int, int], settled: bool
    ) -> Decision | None:
        """``workers``: URL -> role of the ready workers; ``sizes``: (prefill, decode);
        ``settled``: no worker is starting or draining. A decision when one is due."""
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval:
            return None
        if not settled:
            self._last = None  # measure from when the pools are steady again
            return None
        scraped = {}
        for url in workers:
            try:
                scraped[url] = scrape(url, self.headers, self.verify)
            except (httpx.HTTPError, ValueError):
                pass
        last, self._last = self._last, (now, scraped)
        if last is None:
            return None
        decode = {u for u, role in workers.items() if role != "prefill"}
        mix = mix_between(last[1], scraped, now - last[0], decode)
        decision = self.planner.decide(mix, sizes)
        self.decisions = [*self.decisions[-99:], decision]
        return decision
