#!/bin/bash
# Run from the repository root; the output is validate*.txt next to this file.
R=docs/runs/2026-12-02e; D=docs/runs/2026-12-02d
AG="--workload agentic --agent-types 4 --system-tokens 256 --task-tokens 32 --tool-calls 3,5 --tool-call-tokens 8 --answer-tokens 16 --tool-result-tokens 64,0.5 --tool-pause 3.0,0.5 --slo ttft:1000,tpot:250 --session-slo jct:40000 --seed 0"
RND="--input-len 128 --output-len 16 --slo ttft:1000,tpot:100"
for cal in cal-before cal-steps-random; do
  echo "=== D agentic $cal"
  .venv/bin/python benchmarks/sim_validate.py --calibration $R/$cal.json --bench-json $D/agentic-w4.json $AG --host-cores 2 --jitter 2 2>&1 | tail -8
  echo "=== D random $cal"
  .venv/bin/python benchmarks/sim_validate.py --calibration $R/$cal.json --bench-json $D/random-pd.json $RND --host-cores 2 --jitter 2 2>&1 | tail -6
done
echo "=== D agentic cal-before speed-from-run"
.venv/bin/python benchmarks/sim_validate.py --calibration $R/cal-before.json --bench-json $D/agentic-w4.json $AG --host-cores 2 --jitter 2 --speed-from-run 2>&1 | tail -8
