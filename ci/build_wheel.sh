#!/usr/bin/env bash
# Builds the prime-kernels wheel for PRIME_KERNELS_CUDA_ARCHS (default "90a;100a") into wheelhouse/.
# Needs only python3 >= 3.10 with pip/venv: nvcc, CMake and torch's headers are fetched if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
NVCC="$(bash ci/find_nvcc.sh)"
export CUDACXX="$NVCC"
export PATH="$(dirname "$NVCC"):$PATH"
VENV="${PRIME_KERNELS_BUILD_VENV:-.venv-build}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
VENV="$(cd "$VENV" && pwd)"
PYTHON="$VENV/bin/python" bash ci/install_build_deps.sh
export PATH="$VENV/bin:$PATH"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
export PRIME_KERNELS_CUDA_ARCHS="${PRIME_KERNELS_CUDA_ARCHS:-90a;100a}"
rm -rf dist && mkdir -p dist wheelhouse
echo "building prime-kernels for PRIME_KERNELS_CUDA_ARCHS=$PRIME_KERNELS_CUDA_ARCHS with $NVCC"
"$VENV/bin/python" -m pip wheel . --no-build-isolation --no-deps -w dist -v \
  -C build-dir=build/"${PRIME_KERNELS_CUDA_ARCHS//;/_}" > dist/build.log 2>&1 \
  || { tail -60 dist/build.log; echo "wheel build failed (full log: dist/build.log)"; exit 1; }
grep -E "registers|spill|stack frame" dist/build.log | sort | uniq -c | sort -rn | head -20 || true
# C7520: ptxas serialized a kernel's wgmma (e.g. a wgmma under a divergent branch): tensor-core throughput
# halves with no other symptom, so it fails the build.
if grep -q "C7520" dist/build.log; then grep "C7520" dist/build.log; echo "ptxas serialized wgmma (C7520)"; exit 1; fi
whl=$(ls dist/prime_kernels-*.whl)
# Repair: tag it manylinux where the host allows, keeping torch and the driver out of the wheel.
rm -f wheelhouse/prime_kernels-*.whl
"$VENV/bin/auditwheel" repair --exclude 'libtorch*.so' --exclude 'libc10*.so' --exclude 'libcuda.so*' \
  -w wheelhouse "$whl" >/dev/null
"$VENV/bin/twine" check wheelhouse/prime_kernels-*.whl
ls -l wheelhouse/prime_kernels-*.whl
echo "wheel build time: $(( $(date +%s) - start )) s"
