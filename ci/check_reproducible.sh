#!/usr/bin/env bash
# Two builds of one commit give the same bytes: builds both wheels again (a fresh CMake build directory,
# another output folder, PRIME_KERNELS_CUDA_ARCHS as for the first build) and both sdists again, and
# compares their sha256 with those of wheelhouse/ and dist-sdist/. Run after ci/build_wheel.sh and
# ci/build_sdist.sh; exits 1 naming every file that differs.
set -euo pipefail
cd "$(dirname "$0")/.."
second="$(mktemp -d)"
trap 'rm -rf "$second"' EXIT
PRIME_KERNELS_WHEELHOUSE="$second/wheelhouse" PRIME_KERNELS_DIST="$second/dist" \
  PRIME_KERNELS_BUILD_DIR="$second/build" bash ci/build_wheel.sh > "$second/build_wheel.log" 2>&1 \
  || { tail -30 "$second/build_wheel.log"; echo "error: the second wheel build failed"; exit 1; }
cp -r dist-sdist "$second/dist-sdist.first"
bash ci/build_sdist.sh > "$second/build_sdist.log" 2>&1 \
  || { tail -30 "$second/build_sdist.log"; echo "error: the second sdist build failed"; exit 1; }
status=0
compare() {  # compare FIRST_DIR SECOND_DIR GLOB...
  local first=$1 other=$2 f; shift 2
  for f in $(cd "$first" && for g in "$@"; do for m in $g; do [ -e "$m" ] && echo "$m"; done; done); do
    if [ ! -f "$other/$f" ]; then echo "error: $f: the second build has no such file"; status=1
    elif cmp -s "$first/$f" "$other/$f"; then echo "same bytes: $f $(sha256sum < "$first/$f" | cut -c1-16)"
    else echo "error: $f differs between two builds of one commit"; status=1; fi
  done
}
compare wheelhouse "$second/wheelhouse" 'prime_kernels_core-*.whl' 'prime_kernels-*.whl'
compare "$second/dist-sdist.first" dist-sdist '*.tar.gz'
exit "$status"
