#!/usr/bin/env bash
# Fill .whl/ with the wheels a GPU machine without a package registry lacks: archspec's
# own needs that such an image seldom has (pydantic, optuna, moocore), and the peer the
# benchmarks compare against (flash-linear-attention 0.6.0; never a dependency). Run from
# the repository root on a machine that reaches PyPI; extra package names are fetched too.
# On the GPU machine, with .whl/ copied there, install them and archspec:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
#   python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PYTHON_VERSION=${PYTHON_VERSION:-3.12}  # the GPU image's Python
packages=(pydantic pydantic-core annotated-types typing-inspection typing-extensions
          optuna sqlalchemy alembic colorlog mako moocore cffi pycparser platformdirs
          fla-core==0.6.0 flash-linear-attention==0.6.0 "$@")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${packages[@]}"
ls .whl
