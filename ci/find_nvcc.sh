#!/usr/bin/env bash
# Prints the path of a CUDA >= 12.9 nvcc: $CUDACXX, PATH, /usr/local/cuda, or a PyPI install made by
# ci/install_cuda_from_pypi.sh (done here when nothing else is found).
set -euo pipefail
ok() { "$1" --version 2>/dev/null | grep -Eq 'release (1[3-9]\.|12\.9)'; }
# PRIME_KERNELS_PYPI_NVCC=1 skips any installed toolkit (to test the fresh-machine path).
[ "${PRIME_KERNELS_PYPI_NVCC:-0}" = 1 ] && { bash "$(dirname "$0")/install_cuda_from_pypi.sh" "$(pwd)/.toolchain/cuda"; exit; }
for c in "${CUDACXX:-}" "$(command -v nvcc || true)" /usr/local/cuda/bin/nvcc /usr/local/cuda-13.0/bin/nvcc \
         "$(pwd)/.toolchain/cuda/bin/nvcc"; do
  if [ -n "$c" ] && [ -x "$c" ] && ok "$c"; then echo "$c"; exit 0; fi
done
echo "ci/find_nvcc.sh: no CUDA >= 12.9 nvcc found; installing CUDA 13.0 from PyPI into .toolchain/cuda" >&2
if ! "${PYTHON:-python3}" -m pip --version >/dev/null 2>&1; then
  echo "error: no nvcc and no pip to fetch one: install the CUDA 13.0 toolkit or python3-pip, then retry" >&2
  exit 1
fi
bash "$(dirname "$0")/install_cuda_from_pypi.sh" "$(pwd)/.toolchain/cuda"
