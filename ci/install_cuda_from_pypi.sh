#!/usr/bin/env bash
# Installs the CUDA 13.0 compiler from PyPI wheels into PREFIX (default .toolchain/cuda) and prints
# the nvcc path. Used when a machine has no nvcc: a fresh build host, cibuildwheel's before-all.
set -euo pipefail
PREFIX="${1:-$(pwd)/.toolchain/cuda}"
PY="${PYTHON:-python3}"
mkdir -p "$PREFIX"
# Versions: ci/constraints.txt; each wheel in pip's hash-checking mode with the sha256 of
# third_party/PROVENANCE.md, so a wheel whose bytes differ fails the install.
CI="$(cd "$(dirname "$0")" && pwd)"
req="$(mktemp)"
trap 'rm -f "$req"' EXIT
for name in nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-cccl nvidia-cuda-crt nvidia-nvvm; do
  pin=$(grep -E "^${name}==" "$CI/constraints.txt") || { echo "error: ci/constraints.txt pins no $name" >&2; exit 1; }
  echo "$pin $(bash "$CI/check_provenance.sh" --hashes "${name//-/_}")" >> "$req"
done
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps --require-hashes --target "$PREFIX/site" \
  -r "$req" >&2
ROOT="$PREFIX/site/nvidia/cu13"
# nvcc.profile searches $(TOP)/lib64; the wheels ship lib/.
[ -e "$ROOT/lib64" ] || ln -s lib "$ROOT/lib64"
# CMake's FindCUDAToolkit wants the unversioned cudart name.
[ -e "$ROOT/lib/libcudart.so" ] || ln -s libcudart.so.13 "$ROOT/lib/libcudart.so"
ln -sfn "$ROOT/bin" "$PREFIX/bin"
ln -sfn "$ROOT/include" "$PREFIX/include"
ln -sfn "$ROOT/lib" "$PREFIX/lib64"
"$PREFIX/bin/nvcc" --version >&2
echo "$PREFIX/bin/nvcc"
