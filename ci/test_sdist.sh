#!/usr/bin/env bash
# Rebuilds prime-kernels-core from its sdist (dist-sdist/, made by ci/build_sdist.sh) as a user would:
#   PRIME_KERNELS_CUDA_ARCHS=90a pip install prime_kernels_core-X.tar.gz
# in a fresh virtual environment, with build isolation on (pip's default), no CUDA toolkit (CUDACXX unset,
# PRIME_KERNELS_PYPI_NVCC=1: nvcc comes from PyPI's CUDA compiler wheels) and no torch visible to the build
# (the isolated build fetches the pinned, hash-checked torch wheel for its headers). The log must show both
# fetches. Then the drop-in from its sdist, and the CPU tests on what was installed.
# The environment's torch is the oldest the wheel claims (pyproject.toml: torch>=2.10, so 2.10.0); ci/test.sh
# runs the newest. PRIME_KERNELS_SDIST_VENV names the environment (default .venv-sdist).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
VERSION=$(bash ci/check_versions.sh)
ARCHS="${PRIME_KERNELS_SDIST_ARCHS:-90a}"
OLDEST_TORCH=$(sed -nE 's/^dependencies = \["torch>=([0-9]+\.[0-9]+)"\]$/\1.0/p' pyproject.toml)
[ -n "$OLDEST_TORCH" ] || { echo "error: no torch>=X.Y dependency in pyproject.toml" >&2; exit 1; }
REPO="$(pwd)"
VENV="${PRIME_KERNELS_SDIST_VENV:-.venv-sdist}"
rm -rf "$VENV"
python3 -m venv "$VENV"
VENV="$(cd "$VENV" && pwd)"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==$OLDEST_TORCH" pytest numpy
echo "torch $OLDEST_TORCH installed after $(( $(date +%s) - start )) s"
log="$(mktemp)"
if ! (cd / && env -u CUDACXX PRIME_KERNELS_CUDA_ARCHS="$ARCHS" PRIME_KERNELS_PYPI_NVCC=1 \
      "$VENV/bin/pip" install -v --disable-pip-version-check "$REPO/dist-sdist/prime_kernels_core-$VERSION.tar.gz") \
      > "$log" 2>&1; then
  tail -60 "$log"; echo "error: pip install of the sdist failed (log: $log)"; exit 1
fi
echo "sdist built and installed after $(( $(date +%s) - start )) s"
grep -q "(as listed in third_party/PROVENANCE.md)" "$log" \
  || { echo "error: the isolated build did not fetch torch's headers through ci/fetch_torch_headers.py"; exit 1; }
grep -q "/.toolchain/cuda/bin/nvcc (ci/find_nvcc.sh)" "$log" \
  || { echo "error: the isolated build did not take nvcc from PyPI's CUDA compiler wheels"; exit 1; }
grep -E "prime-kernels: (nvcc|torch-|torch headers)" "$log" | sed 's/^ */  /'
PIP_CONSTRAINT="$(pwd)/ci/constraints.txt" "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps \
  "dist-sdist/prime_kernels-$VERSION.tar.gz"
source ci/cuda_archs.sh
want=$(arch_tag "$ARCHS"); want="${want//_/,}"
"$VENV/bin/python" - "$want" <<'EOF'
import sys
import prime_kernels
got = ",".join(prime_kernels.build_info()["cuda_archs"])
assert got == sys.argv[1], (got, sys.argv[1])
print("installed from the sdist:", prime_kernels.__file__, prime_kernels.build_info())
EOF
cd tests
set +e
"$VENV/bin/python" -m pytest -q -ra -p no:cacheprovider
rc=$?
set -e
echo "sdist test finished after $(( $(date +%s) - start )) s"
exit "$rc"
