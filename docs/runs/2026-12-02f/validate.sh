#!/bin/bash
# Run from the repository root; the output is validate.txt next to this file.
R=docs/runs/2026-12-02f
RND="--input-len 128 --output-len 16 --slo ttft:1000,tpot:100"
for cal in $R/cal-before $R/cal-after $R/cal-bracket-refit $R/cal-steps docs/runs/2026-12-02e/cal-steps-agentic; do
  echo "=== random sweep $cal"
  .venv/bin/python benchmarks/sim_validate.py --calibration $cal.json --bench-json $R/random-sweep.json $RND --host-cores 2 --jitter 2 2>&1 | tail -8
done
