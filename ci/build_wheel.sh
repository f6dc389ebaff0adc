#!/usr/bin/env bash
# Builds the two wheels of a release into wheelhouse/: prime-kernels-core (the kernels, import package
# prime_kernels) for PRIME_KERNELS_CUDA_ARCHS (default "90a;100a"), and prime-kernels (the pure-Python
# deep_gemm drop-in, pinned to that core version).
# Needs only python3 >= 3.10 with pip/venv: nvcc, CMake and torch's headers are fetched if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# The arch list is checked first, before anything is looked for or downloaded: unset means the default,
# but an empty, unknown or malformed value is an error (CMakeLists.txt applies the same rule).
ACCEPTED_ARCHS="90a 100a 103a 100f"
check_archs() {
  local value=$1 a bad="" stripped
  stripped="${value//[[:space:]]/}"
  if [ -z "$stripped" ]; then bad="it is empty"; fi
  if [ -z "$bad" ]; then
    local IFS=';'
    # A trailing ';' would be dropped by read: append a sentinel so that "90a;" counts as malformed.
    local -a parts
    read -r -a parts <<<"${stripped};x"
    unset 'parts[${#parts[@]}-1]'
    [ "${#parts[@]}" -gt 0 ] || bad="it is empty"
    for a in "${parts[@]}"; do
      case " $ACCEPTED_ARCHS " in
        *" ${a%-real} "*) [ -n "$a" ] || { bad="it has an empty entry"; break; } ;;
        *) bad="'$a' cannot be built"; [ -n "$a" ] || bad="it has an empty entry"; break ;;
      esac
    done
  fi
  if [ -n "$bad" ]; then
    echo "error: PRIME_KERNELS_CUDA_ARCHS='$value': $bad. Accepted values: ${ACCEPTED_ARCHS// /, }" \
         "(';'-separated, e.g. PRIME_KERNELS_CUDA_ARCHS=\"90a;100a\")" >&2
    exit 2
  fi
}
export PRIME_KERNELS_CUDA_ARCHS="${PRIME_KERNELS_CUDA_ARCHS-90a;100a}"
check_archs "$PRIME_KERNELS_CUDA_ARCHS"
# The old wheel goes first: a build that fails at any later step must not leave it looking current.
rm -rf dist && rm -f wheelhouse/prime_kernels_core-*.whl wheelhouse/prime_kernels-*.whl
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
mkdir -p dist wheelhouse
echo "building prime-kernels-core $VERSION for PRIME_KERNELS_CUDA_ARCHS=$PRIME_KERNELS_CUDA_ARCHS with $NVCC"
"$VENV/bin/python" -m pip wheel . --no-build-isolation --no-deps -w dist -v \
  -C build-dir=build/"${PRIME_KERNELS_CUDA_ARCHS//;/_}" > dist/build.log 2>&1 \
  || { tail -60 dist/build.log; echo "wheel build failed (full log: dist/build.log)"; exit 1; }
grep -E "registers|spill|stack frame" dist/build.log | sort | uniq -c | sort -rn | head -20 || true
# C7520: ptxas serialized a kernel's wgmma (e.g. a wgmma under a divergent branch): tensor-core throughput
# halves with no other symptom, so it fails the build.
if grep -q "C7520" dist/build.log; then grep "C7520" dist/build.log; echo "ptxas serialized wgmma (C7520)"; exit 1; fi
whl=$(ls dist/prime_kernels_core-*.whl)
# Repair: tag it manylinux where the host allows, keeping torch and the driver out of the wheel.
"$VENV/bin/auditwheel" repair --exclude 'libtorch*.so' --exclude 'libc10*.so' --exclude 'libcuda.so*' \
  -w wheelhouse "$whl" >/dev/null
# The drop-in: pure Python, so it is not repaired.
"$VENV/bin/python" -m pip wheel ./dropin --no-build-isolation --no-deps -w dist >> dist/build.log 2>&1 \
  || { tail -30 dist/build.log; echo "drop-in wheel build failed (full log: dist/build.log)"; exit 1; }
cp dist/prime_kernels-"$VERSION"-py3-none-any.whl wheelhouse/
"$VENV/bin/twine" check --strict wheelhouse/prime_kernels_core-*.whl wheelhouse/prime_kernels-*.whl
ls -l wheelhouse/prime_kernels_core-*.whl wheelhouse/prime_kernels-*.whl
echo "wheel build time: $(( $(date +%s) - start )) s"
