#!/usr/bin/env bash
# Run experiments of specs/experiments/ on a CUDA GPU and print their results tables.
#
#   bash specs/experiments/run-gpu.sh [EXPERIMENT ...]     (default: the S4 and A5 DeltaProduct runs)
#
# Results go to $OUT/<experiment>/ (results.md, results.json, one metrics.json per run);
# OUT defaults to runs/experiments. On a GPU machine without a registry, which lacks
# pydantic, first fill .whl/ with scripts/gpu-wheels.sh, copy it there, and begin with the
# install lines that script's header gives, e.g.
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site &&
#   python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . &&
#   bash specs/experiments/run-gpu.sh deltaproduct-s4-gpu
#
# Without matplotlib on the machine the runs skip their PNGs; the numbers are unaffected.
# An experiment already finished in $OUT is not retrained (delete its folder to redo it).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-runs/experiments}"
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this script is for a GPU')"
experiments=("$@")
[ ${#experiments[@]} -gt 0 ] || experiments=(deltaproduct-s4-gpu deltaproduct-a5-gpu)
mkdir -p "$OUT"
for name in "${experiments[@]}"; do
  python3 -m archspec.search.cli experiment "specs/experiments/$name.yaml" --out "$OUT/$name" --device cuda --quiet \
    > "$OUT/$name.log" 2>&1 || { tail -20 "$OUT/$name.log"; exit 1; }
done
for name in "${experiments[@]}"; do
  cat "$OUT/$name/results.md"
  echo
done
