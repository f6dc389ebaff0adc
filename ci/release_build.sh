#!/usr/bin/env bash
# Release build (needs a container engine: CI runners). cibuildwheel reads [tool.cibuildwheel] in
# pyproject.toml: manylinux_2_28 image, CUDA from PyPI in before-all, auditwheel with excludes. The
# pure-Python drop-in (dropin/) is built beside it, at the same version (ci/check_versions.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/check_versions.sh
python -m pip install --quiet -c ci/constraints.txt cibuildwheel twine
python -m cibuildwheel --platform linux --output-dir wheelhouse .
# PIP_CONSTRAINT reaches pip's isolated build environment, so the drop-in's backend is the pinned one.
PIP_CONSTRAINT="$(pwd)/ci/constraints.txt" python -m pip wheel ./dropin --no-deps -w wheelhouse
python -m twine check --strict wheelhouse/*.whl
