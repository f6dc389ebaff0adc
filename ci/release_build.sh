#!/usr/bin/env bash
# Release build (needs a container engine: CI runners). cibuildwheel reads [tool.cibuildwheel] in
# pyproject.toml: manylinux_2_28 image, CUDA from PyPI in before-all, auditwheel with excludes.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -c ci/constraints.txt cibuildwheel twine
python -m cibuildwheel --platform linux --output-dir wheelhouse .
python -m twine check --strict wheelhouse/*.whl
