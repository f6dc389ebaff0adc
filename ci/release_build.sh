#!/usr/bin/env bash
# Release build of the wheels (needs a container engine: CI runners). The pure-Python drop-in (dropin/)
# is built first, into dropin-dist/, at the version of the core (ci/check_versions.sh); cibuildwheel then
# reads [tool.cibuildwheel] in pyproject.toml (manylinux_2_28 image, CUDA from PyPI in before-all,
# auditwheel with excludes) and runs its test-command, ci/cibw_test.sh, on each wheel in a fresh
# virtualenv with that drop-in. Both wheels end in wheelhouse/, checked by twine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/check_versions.sh
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct)}"
python -m pip install --quiet -c ci/constraints.txt cibuildwheel twine
rm -rf dropin-dist && mkdir -p dropin-dist wheelhouse
# PIP_CONSTRAINT reaches pip's isolated build environment, so the drop-in's backend is the pinned one.
PIP_CONSTRAINT="$(pwd)/ci/constraints.txt" python -m pip wheel ./dropin --no-deps -w dropin-dist
python -m cibuildwheel --platform linux --output-dir wheelhouse .
cp dropin-dist/prime_kernels-*.whl wheelhouse/
python -m twine check --strict wheelhouse/*.whl
