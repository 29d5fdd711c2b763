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
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0" "triton==3.7.1"
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
