#!/usr/bin/env bash
# Regenerate the experiment results under specs/experiments/results/ that README.md and
# docs/tasks.md quote, with the commands next to them.
#
#   scripts/regenerate-results.sh           retrain the CPU experiments (deltaproduct-s3,
#                                           osdn-mqar-twice, osdn-mqar-twice-128) into
#                                           runs/experiments/<name>/ and copy their tables,
#                                           records and quoted plots here; then --costs
#   scripts/regenerate-results.sh --costs   only the cost columns (params, flops_per_token,
#                                           state_bytes, also @32768) of every results file, recomputed
#                                           from the code: seconds, no training. What a
#                                           change to the cost model needs
#                                           (tests/search/test_committed_results.py fails
#                                           until it is run).
#
# Retraining takes hours on a shared 2-core machine (36 runs); it uses one torch thread
# per run. The GPU experiments (deltaproduct-{s4,a5}-gpu*) train on a CUDA machine
# (specs/experiments/run-gpu.sh); here only their cost columns are refreshed. After
# retraining, update the numbers README.md and docs/tasks.md quote from the new tables.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-env.sh
results=specs/experiments/results
archspec=.venv/bin/archspec

if [ "${1:-}" != "--costs" ]; then
  export OMP_NUM_THREADS=1
  for name in deltaproduct-s3 osdn-mqar-twice osdn-mqar-twice-128; do
    "$archspec" experiment "specs/experiments/$name.yaml" --out "runs/experiments/$name" --fresh --quiet
    cp "runs/experiments/$name/results.json" "$results/$name.json"
    cp "runs/experiments/$name/results.md" "$results/$name.md"
  done
  # The plots the docs show: accuracy by position of the two n_h settings, and OSDN's diagnostics.
  cp runs/experiments/deltaproduct-s3/n_h-2-beta-in-0-2/s0/accuracy.png "$results/deltaproduct-s3-nh2-beta02-s0.png"
  cp runs/experiments/deltaproduct-s3/n_h-1-beta-in-0-2/s0/accuracy.png "$results/deltaproduct-s3-nh1-beta02-s0.png"
  cp runs/experiments/osdn-mqar-twice-128/osdn/s0/diagnostics.png "$results/osdn-mqar-twice-128-osdn-s0-diagnostics.png"
fi

for file in "$results"/*.json; do
  # The experiment file named in the record: deltaproduct-s4-gpu-180s.json ran deltaproduct-s4-gpu.yaml.
  name=$(.venv/bin/python -c 'import json, sys; print(json.load(open(sys.argv[1]))["experiment"]["name"])' "$file")
  "$archspec" experiment "specs/experiments/$name.yaml" --costs-of "$file"
done
