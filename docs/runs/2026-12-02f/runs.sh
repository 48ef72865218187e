#!/usr/bin/env bash
# The fourth sitting's second half (2026-12-02f): the random workload at loads where the SLOs
# start to bind (1 and 2 requests/s), collocated and disaggregated, between two calibrations.
# Run from the repository root on a quiet machine.
set -euo pipefail
OUT=docs/runs/2026-12-02f
SS=.venv/bin/splitserve
stamp() { echo "== $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg): $*"; }
stamp calibrate
$SS sim calibrate --repeats 5 --out "$OUT/cal-before.json"
stamp random compare at 1 and 2 requests/s
$SS bench compare --workload random --input-len 128 --output-len 16 --sweep 1.0,2.0 \
  --duration 60 --drain 120 --deployments collocated-rr,disagg-session,disagg \
  --slo ttft:1000,tpot:100 --step-logs "$OUT/steps" --json "$OUT/random-sweep.json" --no-progress
stamp calibrate again
$SS sim calibrate --repeats 5 --out "$OUT/cal-after.json"
# The serving figures (benchmarks/serving_cpu.py) of the sitting before, 2026-12-02e.
.venv/bin/python - "$OUT/cal-before.json" "$OUT/cal-after.json" <<'PY'
import json, sys

src = json.load(open("docs/runs/2026-12-02e/cal-before.json"))["fit"]
keys = ("serving_cpu_per_request_s", "serving_cpu_per_token_s", "kv_copy_cpu_per_block_s")
for path in sys.argv[1:]:
    data = json.load(open(path))
    data["fit"].update({k: src[k] for k in keys})
    json.dump(data, open(path, "w"), indent=1)
PY
$SS sim calibrate --refit "$OUT/cal-before.json" "$OUT/cal-after.json" --out "$OUT/cal-bracket-refit.json" | tail -3
$SS sim calibrate --from-steps "$OUT/steps" --base "$OUT/cal-before.json" --out "$OUT/cal-steps.json" | tail -3
stamp done
