#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-env.sh
exec .venv/bin/python -m pytest -q "$@"
