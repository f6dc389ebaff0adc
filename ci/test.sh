#!/usr/bin/env bash
# Installs the wheel from wheelhouse/ into a fresh virtual environment and runs the test suite.
# GPU tests skip with a visible reason on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PRIME_KERNELS_TEST_VENV:-.venv-test}"
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==${PRIME_KERNELS_TEST_TORCH:-2.14.1}" \
  pytest numpy matplotlib "cibuildwheel==4.3.5" "cmake>=3.31" ninja
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps wheelhouse/prime_kernels-*.whl
# Run from tests/ so `import deep_gemm` resolves to the installed wheel, not the source tree.
cd tests
set +e
"../$VENV/bin/python" -m pytest -q -ra "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "error: pytest collected no tests"; exit 1; fi
exit "$rc"
