#!/usr/bin/env bash
# Create (once) the virtual environment .venv with everything archspec needs, on a fresh
# machine with nothing but Python 3.10+. Idempotent: a second run only checks.
# torch is pinned to 2.13.0 (a CPU build lies on local disk; an unpinned torch pulls a
# multi-GB CUDA build) and triton to 3.7.1 (the version torch 2.13 pins).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.archspec-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # The environment takes about 2.4 GB (torch alone 1.9); pip's own "No space left on
  # device" comes after minutes and names no size, so say it first.
  need_kb=$((3 * 1024 * 1024))
  free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
  if [ "${free_kb:-0}" -lt "$need_kb" ]; then
    echo "setup-env.sh: $(pwd) has $((free_kb / 1024)) MB free; .venv needs about 3 GB (torch, triton, ray)." >&2
    echo "Free some disk (old clones and their .venv folders are 2.4 GB each) and run it again." >&2
    exit 1
  fi
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0" "triton==3.7.1"
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
