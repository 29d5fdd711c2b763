#!/usr/bin/env bash
# Set up .venv if needed, then run the main job: for now, compile an example spec.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-env.sh
exec .venv/bin/archspec compile specs/models/gated-deltaproduct-2.yaml "$@"
