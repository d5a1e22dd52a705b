#!/usr/bin/env bash
# Wheels of the Python packages scripts/gpu_check.sh needs and a lent GPU machine lacks, for
# carrying there (nothing can be downloaded on that machine): CPython 3.12, manylinux x86-64.
#
#   bash scripts/fetch_wheels.sh          # into .whl/ (git-ignored), here, where pip reaches PyPI
#
# gpu_check.sh installs whatever is in .whl/ into /tmp/site before anything else when a
# package it needs does not import. The versions are those of this project's environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0)
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
ls -1 .whl
