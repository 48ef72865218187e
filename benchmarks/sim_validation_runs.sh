#!/usr/bin/env bash
# The real runs behind docs/simulator.md's validation, in one go: a calibration of this
# machine, the serving CPU figures, the four-worker agentic compare, a collocated vs
# disaggregated compare, and a second calibration. Quiet machine only (nothing else running):
# the simulator is compared with these runs, and a busy machine moves them by 20-30%.
#
#   benchmarks/sim_validation_runs.sh benchmarks/out/validate      # ~20 minutes (make bench-sim-validate)
#   benchmarks/sim_validation_runs.sh benchmarks/out/validate 0.2  # the agentic rate (default 0.35)
#
# The agentic rate should keep the four workers below saturation: on a slower machine 0.35
# sessions/s overloads them, and overloaded runs do not repeat (docs/journal/2026-12-02.md, "A
# slower machine").
#
# Every worker of both compares logs its engine steps under OUT/steps/{agentic,random}/; at the
# end the runs' own steps are fitted too (`sim calibrate --from-steps`, the peaks and serving
# figures of cal-before.json): cal-steps-random.json from the random compare's workers (a
# calibration the agentic runs played no part in), cal-steps-agentic-collocated-rr.json from the
# agentic round-robin run's, cal-steps-agentic.json from all three agentic runs'.
#
# then, for each compare and each calibration (see docs/simulator.md):
#   .venv/bin/python benchmarks/sim_validate.py --calibration OUT/cal-before.json \
#       --bench-json OUT/agentic-w4.json $AGENTIC --host-cores 2 --jitter 2 [--speed-from-run]
set -euo pipefail
OUT=${1:?usage: benchmarks/sim_validation_runs.sh OUTDIR [AGENTIC_RATE]}
RATE=${2:-0.35}
mkdir -p "$OUT"
SS=.venv/bin/splitserve
PY=.venv/bin/python
# The agentic workload and SLOs of the validation (as $AG in docs/simulator.md).
AGENTIC=(--workload agentic --agent-types 4 --system-tokens 256 --task-tokens 32
  --tool-calls 3,5 --tool-call-tokens 8 --answer-tokens 16 --tool-result-tokens 64,0.5
  --tool-pause 3.0,0.5 --slo ttft:1000,tpot:250 --session-slo jct:40000 --seed 0)

stamp() { echo "== $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg): $*"; }

stamp calibrate
$SS sim calibrate --repeats 5 --out "$OUT/cal-before.json"
stamp serving CPU
$PY benchmarks/serving_cpu.py --calibration "$OUT/cal-before.json"
stamp agentic compare, four one-thread workers on two cores
$SS bench compare --deployments collocated-rr,collocated-session-tiers,collocated-session-tiers-peer \
  --cores 4 --threads-per-worker 1 "${AGENTIC[@]}" --rate "$RATE" --duration 120 --drain 60 \
  --serve-arg=--kv-cache-gb --serve-arg=0.06 --serve-arg=--load-floor --serve-arg=3 \
  --step-logs "$OUT/steps/agentic" --json "$OUT/agentic-w4.json"
stamp collocated vs disaggregated compare
$SS bench compare --workload random --input-len 128 --output-len 16 --rate 0.5 \
  --duration 60 --drain 120 --deployments collocated-rr,disagg-session \
  --slo ttft:1000,tpot:100 --step-logs "$OUT/steps/random" --json "$OUT/random-pd.json"
stamp calibrate again
$SS sim calibrate --repeats 5 --out "$OUT/cal-after.json"
# The serving figures were measured once, before: the second calibration carries them too.
$PY - "$OUT/cal-before.json" "$OUT/cal-after.json" <<'EOF'
import json, sys

before, after = (json.load(open(p)) for p in sys.argv[1:])
keys = ("serving_cpu_per_request_s", "serving_cpu_per_token_s", "kv_copy_cpu_per_block_s")
after["fit"].update({k: before["fit"][k] for k in keys if k in before["fit"]})
json.dump(after, open(sys.argv[2], "w"), indent=1)
EOF
stamp fits of the runs own steps
for name in random agentic agentic/collocated-rr; do
  $SS sim calibrate --from-steps "$OUT/steps/$name" --base "$OUT/cal-before.json" \
    --out "$OUT/cal-steps-${name//\//-}.json" | tail -12
done
stamp done
