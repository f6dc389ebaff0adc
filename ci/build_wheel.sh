#!/usr/bin/env bash
# Builds the two wheels of a release into wheelhouse/: prime-kernels-core (the kernels, import package
# prime_kernels) for PRIME_KERNELS_CUDA_ARCHS (default "90a;100a"), and prime-kernels (the pure-Python
# deep_gemm drop-in, pinned to that core version).
# Needs only python3 >= 3.10 with pip/venv: nvcc, CMake and torch's headers are fetched if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# The arch list is checked first, before anything is looked for or downloaded (ci/cuda_archs.sh).
source ci/cuda_archs.sh
export PRIME_KERNELS_CUDA_ARCHS="${PRIME_KERNELS_CUDA_ARCHS-90a;100a}"
check_archs "$PRIME_KERNELS_CUDA_ARCHS"
BUILD_TAG=$(arch_tag "$PRIME_KERNELS_CUDA_ARCHS")
# Two builds of one commit give the same bytes: every timestamp (zip entries, build_info()'s build_date)
# is SOURCE_DATE_EPOCH, by default the commit's time.
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 315532800)}"
# Where the wheels go and where CMake builds (ci/check_reproducible.sh builds a second time elsewhere).
WHEELHOUSE="${PRIME_KERNELS_WHEELHOUSE:-wheelhouse}"
DIST="${PRIME_KERNELS_DIST:-dist}"
BUILD_DIR="${PRIME_KERNELS_BUILD_DIR:-build/${PRIME_KERNELS_CUDA_ARCHS//;/_}}"
# The old wheel goes first: a build that fails at any later step must not leave it looking current.
rm -rf "$DIST" && rm -f "$WHEELHOUSE"/prime_kernels_core-*.whl "$WHEELHOUSE"/prime_kernels-*.whl
VERSION=$(bash ci/check_versions.sh)
NVCC="$(bash ci/find_nvcc.sh)"
export CUDACXX="$NVCC"
export PATH="$(dirname "$NVCC"):$PATH"
VENV="${PRIME_KERNELS_BUILD_VENV:-.venv-build}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
VENV="$(cd "$VENV" && pwd)"
PYTHON="$VENV/bin/python" bash ci/install_build_deps.sh
export PATH="$VENV/bin:$PATH"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
mkdir -p "$DIST" "$WHEELHOUSE"
echo "building prime-kernels-core $VERSION for PRIME_KERNELS_CUDA_ARCHS=$PRIME_KERNELS_CUDA_ARCHS (build tag $BUILD_TAG) with $NVCC"
"$VENV/bin/python" -m pip wheel . --no-build-isolation --no-deps -w "$DIST" -v -C wheel.build-tag="$BUILD_TAG" \
  -C build-dir="$BUILD_DIR" > "$DIST/build.log" 2>&1 \
  || { tail -60 "$DIST/build.log"; echo "wheel build failed (full log: $DIST/build.log)"; exit 1; }
grep -E "registers|spill|stack frame" "$DIST/build.log" | sort | uniq -c | sort -rn | head -20 || true
# C7520: ptxas serialized a kernel's wgmma (e.g. a wgmma under a divergent branch): tensor-core throughput
# halves with no other symptom, so it fails the build.
if grep -q "C7520" "$DIST/build.log"; then grep "C7520" "$DIST/build.log"; echo "ptxas serialized wgmma (C7520)"; exit 1; fi
whl=$(ls "$DIST"/prime_kernels_core-*.whl)
# Repair: tag it manylinux where the host allows, keeping torch and the driver out of the wheel.
"$VENV/bin/auditwheel" repair --exclude 'libtorch*.so' --exclude 'libc10*.so' --exclude 'libcuda.so*' \
  -w "$WHEELHOUSE" "$whl" >/dev/null
# The drop-in: pure Python, so it is not repaired.
"$VENV/bin/python" -m pip wheel ./dropin --no-build-isolation --no-deps -w "$DIST" >> "$DIST/build.log" 2>&1 \
  || { tail -30 "$DIST/build.log"; echo "drop-in wheel build failed (full log: $DIST/build.log)"; exit 1; }
cp "$DIST"/prime_kernels-"$VERSION"-py3-none-any.whl "$WHEELHOUSE"/
"$VENV/bin/twine" check --strict "$WHEELHOUSE"/prime_kernels_core-*.whl "$WHEELHOUSE"/prime_kernels-*.whl
ls -l "$WHEELHOUSE"/prime_kernels_core-*.whl "$WHEELHOUSE"/prime_kernels-*.whl
echo "wheel build time: $(( $(date +%s) - start )) s"
