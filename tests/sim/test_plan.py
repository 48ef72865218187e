"""The planner on a case small enough to work out by hand."""

from __future__ import annotations

from splitserve.sim.cost_model import StepShape
from splitserve.sim.deployment import Deployment, SimConfig
from splitserve.sim.hardware import get_hardware
from splitserve.sim.models import get_model
from splitserve.sim.plan import candidates, plan
from splitserve.workload.metrics import SLO
from splitserve.workload.sessions import RandomConfig


def test_candidates_cover_collocated_and_every_split():
    got = [d.describe() for d in candidates(4, [1, 2])]
    assert got == [
        "4 collocated at TP1 (4 GPUs)",
        "1P:3D at TP1 (4 GPUs)",
        "2P:2D at TP1 (4 GPUs)",
        "3P:1D at TP1 (4 GPUs)",
        "2 collocated at TP2 (4 GPUs)",
        "1P:1D at TP2 (4 GPUs)",
    ]


def test_prefill_bound_traffic_wants_most_gpus_prefilling():
    # 4000-token prompts, 2-token replies: a request is one ~0.1 s prefill and two cheap
    # decode steps. By hand, a P:D split serves about P / t_prefill requests/s (decode is
    # nearly free), so on 4 GPUs 3P:1D > 2P:2D > 1P:3D, and 4 collocated workers (each
    # prefilling too) beat every split. The SLO (TTFT <= 4 prefills) binds only near
    # saturation (in 3 s of arrivals), so each split's max rate lands near its capacity.
    cfg = SimConfig(get_model("llama3-8b"), get_hardware("h100"), block_size=64)
    cost = cfg.cost_model(1)
    t_prefill = cost.step_time(StepShape(4000, 1, 4000 * 4001 / 2, 4000, 1))
    assert 0.09 < t_prefill < 0.13  # 2 * 7e9 * 4000 FLOPs at ~593 TFLOP/s, plus attention
    slo = SLO(ttft_ms=4000 * t_prefill)
    workload = RandomConfig(input_len=4000, output_len=2)
    rows = plan(cfg, workload, candidates(4, [1]), slo, 3.0, (1.0, 60.0), 0.9, iters=6)
    by_name = {r.deployment.describe(): r for r in rows}
    split = {p: by_name[f"{p}P:{4 - p}D at TP1 (4 GPUs)"].max_rate for p in (1, 2, 3)}
    assert split[3] > split[2] > split[1]
    for p, rate in split.items():
        assert 0.6 * p / t_prefill <= rate <= 1.1 * p / t_prefill, p
    assert rows[0].deployment == Deployment(collocated=4)
    assert rows[0].max_rate > split[3]
