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
#
# --ray: instead, Ray Tune 2.60 for Python 3.12 and what `ray.tune` imports that the GPU
# image lacks (click, filelock, jsonschema with attrs, referencing, rpds-py and
# jsonschema-specifications, msgpack, protobuf, pyarrow, fsspec, pandas with
# python-dateutil and six, requests with its four; tensorboardX is left out: Tune runs
# without it). These weigh about 140 MB, more than one transfer to a lent GPU machine carries (64 MiB), so
# they are packed into one tar cut into parts of RAY_PART_MB (default 44) MB, one folder
# per call: .whl-ray/part1, part2, ... Carry each folder in its own call, the calls one
# right after the other (the machine keeps /tmp only while it stays warm); the last one
# joins and installs. With three parts (Ray 2.60's bundle makes four; the script prints the lines for its own count):
#
#   carry [".whl-ray/part1"]:  mkdir -p /tmp/ray-parts && cp .whl-ray/part1/* /tmp/ray-parts/
#   carry [".whl-ray/part2"]:  mkdir -p /tmp/ray-parts && cp .whl-ray/part2/* /tmp/ray-parts/
#   carry [".whl-ray/part3"]:  mkdir -p /tmp/ray-parts /tmp/ray-whl && cp .whl-ray/part3/* /tmp/ray-parts/ &&
#     cat /tmp/ray-parts/ray-wheels.tar.* | tar -x -C /tmp/ray-whl &&
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/ray-whl/*.whl &&
#     PYTHONPATH=/tmp/site python3 -c "from ray import tune; print('ray', __import__('ray').__version__)"
#
# Then, in the calls that search, carry [".whl"] and begin with the install lines above
# (`--upgrade` is not needed: the Ray wheels and these do not overlap). The script prints
# the lines for the number of parts it made.
#
# --triton: Triton 3.7.1 the same way (.whl-triton/, /tmp/site-triton first on PYTHONPATH),
# the Triton that fixes Hopper's tl.trans miscompile, under which fla's gated backward runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_VERSION=${PYTHON_VERSION:-3.12}  # the GPU image's Python
download() {  # download DIR PACKAGE...
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" "$@"
}
bundle() {  # bundle NAME TARGET CHECK PACKAGE...: the wheels as one tar cut into .whl-NAME/partN, and the
  # device lines that join the parts and install them into TARGET
  local name=$1 target=$2 check=$3; shift 3
  # 44 MB, not 60: a call carries the working tree (about 4 MB) and .whl/ (about 11 MB) beside the part.
  local part_mb=${PART_MB:-${RAY_PART_MB:-44}} n piece
  work=$(mktemp -d)  # global: the EXIT trap reads it
  trap 'rm -rf "$work"' EXIT
  download "$work/wheels" "$@"
  tar -C "$work/wheels" -cf "$work/$name-wheels.tar" .
  split -b "${part_mb}M" -d -a 2 "$work/$name-wheels.tar" "$work/$name-wheels.tar."
  rm -rf ".whl-$name"
  n=0
  for piece in "$work/$name-wheels.tar."[0-9][0-9]; do
    n=$((n + 1))
    mkdir -p ".whl-$name/part$n"
    mv "$piece" ".whl-$name/part$n/"
  done
  ls "$work/wheels"
  du -sh ".whl-$name"/part*
  echo "On the device, one call per part, one right after the other:"
  for i in $(seq 1 "$n"); do
    if [ "$i" -lt "$n" ]; then
      echo "  carry [\".whl-$name/part$i\"]:  mkdir -p /tmp/$name-parts && cp .whl-$name/part$i/* /tmp/$name-parts/"
    else
      echo "  carry [\".whl-$name/part$i\"]:  mkdir -p /tmp/$name-parts /tmp/$name-whl && cp .whl-$name/part$i/* /tmp/$name-parts/ && cat /tmp/$name-parts/$name-wheels.tar.* | tar -x -C /tmp/$name-whl && python3 -m pip install -q --no-index --no-deps --no-compile --target $target /tmp/$name-whl/*.whl && PYTHONPATH=$target:/tmp/site python3 -c \"$check\""
    fi
  done
  [ "$target" = /tmp/site ] || echo "Then put $target first on PYTHONPATH (PYTHONPATH=$target:/tmp/site)."
}
case "${1:-}" in
  --ray)
    shift
    bundle ray /tmp/site "from ray import tune; print('ray', __import__('ray').__version__)" "ray==2.60.*" click filelock \
      jsonschema jsonschema-specifications referencing rpds-py attrs msgpack protobuf pyarrow fsspec pandas \
      python-dateutil six requests urllib3 idna charset-normalizer certifi "$@"
    exit 0 ;;
  --triton)
    # Triton 3.7.1 beside the image's 3.6 (198 MB: five parts), for what 3.6 gets wrong on
    # Hopper: fla's gated backward refuses to run below 3.7.1 (fla issue 640, a tl.trans of
    # a tl.dot result fed to another tl.dot). Ours is not hit: on the H200 its outputs and
    # gradients (gate sums, the autocast model test) agreed to every digit printed under 3.6
    # and 3.7.1.
    shift
    bundle triton /tmp/site-triton "import triton; print('triton', triton.__version__)" "triton==3.7.1" "$@"
    exit 0 ;;
esac
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
packages=(pydantic pydantic-core annotated-types typing-inspection typing-extensions
          optuna sqlalchemy alembic colorlog mako moocore cffi pycparser platformdirs
          fla-core==0.6.0 flash-linear-attention==0.6.0 "$@")
download .whl "${packages[@]}"
ls .whl
