#!/usr/bin/env bash
# Set up .venv if needed, then run the main job: a small architecture search on CPU
# (specs/search/demo.yaml: recurrences on S3 state tracking, quality against FLOPs;
# a few minutes on 2 cores). Prints the Pareto front and plots it. Extra arguments go to
# `archspec search` (e.g. --trials 4); DEMO_OUT chooses the run directory.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-env.sh
out="${DEMO_OUT:-runs/demo-$(date +%Y%m%d-%H%M%S)}"
.venv/bin/archspec search specs/search/demo.yaml --out "$out" "$@"
.venv/bin/archspec pareto "$out" --plot "$out/front.png" > /dev/null
echo "plot: $out/front.png   (compare runs: .venv/bin/archspec pareto $out OTHER_RUN)"
