#!/usr/bin/env bash
# Run the GPU-marked tests on a CUDA machine, each test function in a process of its own,
# several at once, and print one line per function (passed / failed, where, the error).
#
# One illegal memory access poisons its process's CUDA context: every later test in that
# process fails with the same error, hiding which kernel made it. Here each function runs
# alone (its parametrized cases in order, stopping at the first failure) with
# CUDA_LAUNCH_BLOCKING=1, so the error is raised at the launch that made it. Full logs go
# to $LOGS (default $OUT when set, else /tmp/gpu-tests), the lines so far to $LOGS/summary.txt.
#
#   bash scripts/gpu-tests.sh [pytest selection, default: tests]    # e.g. tests/kernels
#
# Environment: PYTHON (default python3), JOBS (processes at once, default 8), PER_TEST_S (each function's limit in
# seconds, default 300).
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${LOGS:-${OUT:-/tmp/gpu-tests}}
mkdir -p "$LOGS"
export PYTHON=${PYTHON:-python3} CUDA_LAUNCH_BLOCKING=1 LOGS PER_TEST_S=${PER_TEST_S:-300}
"$PYTHON" -m pytest -q -p no:cacheprovider -m gpu --collect-only "${@:-tests}" 2>/dev/null \
  | grep '::' | sed 's/\[.*//' | sort -u > "$LOGS/functions.txt"
one() {
  local id=$1 name=${1##*::}
  timeout "$PER_TEST_S" "$PYTHON" -m pytest -x -q -p no:cacheprovider -m gpu --tb=long "$id" > "$LOGS/$name.log" 2>&1
  local rc=$? summary where error
  summary=$(tail -1 "$LOGS/$name.log")
  [ $rc -eq 124 ] && summary="timed out after ${PER_TEST_S}s"
  where=$(grep -E '^(kernels|blocks|archspec|search|tests)/[A-Za-z0-9_/]+\.py:[0-9]+' "$LOGS/$name.log" | tail -2 | tr '\n' ' ')
  error=$(grep -E '^E  ' "$LOGS/$name.log" | head -1 | cut -c1-160)
  echo "$name | $summary | $where| $error"
}
export -f one
# Each line also goes to $LOGS/summary.txt as it finishes: a run killed by an outer time
# limit keeps the functions it finished (the sorted table is printed only at the end).
: > "$LOGS/summary.txt"
xargs -P "${JOBS:-8}" -I{} bash -c 'one "$@"' _ {} < "$LOGS/functions.txt" | tee -a "$LOGS/summary.txt" | sort
