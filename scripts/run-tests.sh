#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite (GPU tests skip without CUDA), one
# process per core (pytest-xdist); the tests that start Ray share one of them
# (tests/conftest.py). Arguments go to pytest: `-n 0` runs in this process alone.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-env.sh
exec .venv/bin/python -m pytest -q -n auto --dist loadgroup "$@"
