#!/usr/bin/env bash
# Installs the two wheels from wheelhouse/ (prime-kernels-core and the prime-kernels drop-in) into a fresh
# virtual environment and runs the test suite.
# GPU tests skip with a visible reason on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PRIME_KERNELS_TEST_VENV:-.venv-test}"
rm -rf "$VENV"
python3 -m venv "$VENV"
# The build tools (cibuildwheel, CMake, ninja) and torch come at the versions of ci/constraints.txt; a
# PRIME_KERNELS_TEST_TORCH override drops the torch pin from it so the two do not conflict.
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
if [ -n "${PRIME_KERNELS_TEST_TORCH:-}" ]; then
  grep -v '^torch==' ci/constraints.txt > "$CONSTRAINTS"; torch_req="torch==$PRIME_KERNELS_TEST_TORCH"
else
  cp ci/constraints.txt "$CONSTRAINTS"; torch_req=torch
fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check -c "$CONSTRAINTS" "$torch_req" \
  pytest numpy matplotlib cibuildwheel cmake ninja
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps wheelhouse/prime_kernels_core-*.whl \
  wheelhouse/prime_kernels-*.whl
# The integrations' tests run against the versions they were written for. torchtitan's declared
# dependencies (datasets, wandb, ...) are not used by the parts we adapt, hence --no-deps.
"$VENV/bin/pip" install --quiet --disable-pip-version-check "transformers==5.24.0" "huggingface-hub==1.33.0" \
  "spmd_types==0.2.3" "tyro==1.0.17"
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps "torchtitan==0.3.0"
# A second environment with the CPU-only torch 2.13 (older than the 2.14 headers the shim was built
# against): the wheel must import and run its CPU ops there too. Only a CPU build ("2.13.0+cpu") is asked
# for, so where none is offered (PyPI has none) nothing is downloaded and the test skips. (torch is not under
# ci/constraints.txt: that environment exists to hold another torch.)
CPU_VENV=.venv-cpu-torch
rm -rf "$CPU_VENV"
probe="$(mktemp -d)"
CPU_TORCH_WHEEL=""
if [ "${PRIME_KERNELS_SKIP_CPU_TORCH:-0}" != 1 ]; then
  python3 -m pip download --quiet --disable-pip-version-check --no-deps "torch==2.13.0+cpu" -d "$probe" \
    >/dev/null 2>&1 || true
  CPU_TORCH_WHEEL="$(ls "$probe"/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n 1)"
  if [ -n "$CPU_TORCH_WHEEL" ]; then
    python3 -m venv "$CPU_VENV"
    "$CPU_VENV/bin/pip" install --quiet --disable-pip-version-check "$CPU_TORCH_WHEEL"
    "$CPU_VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps wheelhouse/prime_kernels_core-*.whl
    export PRIME_KERNELS_CPU_TORCH_PYTHON="$(pwd)/$CPU_VENV/bin/python"
  else
    echo "note: no CPU-only torch 2.13.0 available here; the CPU-only-torch test will skip"
  fi
fi
# The same two wheels under the oldest torch they claim (pyproject.toml: torch>=2.10, so 2.10.0): one wheel
# serves every torch from there to the newest (the pin above, the newest release these machines offer), and
# both ends run the CPU tests. PRIME_KERNELS_SKIP_OLDEST_TORCH=1 skips it.
OLDEST_TORCH=$(sed -nE 's/^dependencies = \["torch>=([0-9]+\.[0-9]+)"\]$/\1.0/p' pyproject.toml)
[ -n "$OLDEST_TORCH" ] || { echo "error: no torch>=X.Y dependency in pyproject.toml" >&2; exit 1; }
OLD_VENV=.venv-oldest-torch
rm -rf "$OLD_VENV"
if [ "${PRIME_KERNELS_SKIP_OLDEST_TORCH:-0}" != 1 ]; then
  python3 -m venv "$OLD_VENV"
  "$OLD_VENV/bin/pip" install --quiet --disable-pip-version-check "torch==$OLDEST_TORCH" pytest numpy
  "$OLD_VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps wheelhouse/prime_kernels_core-*.whl \
    wheelhouse/prime_kernels-*.whl
fi
# Upstream DeepGEMM beside prime-kernels-core, as a user who needs both installs them: upstream first, then
# prime-kernels-core (not the drop-in), in a fresh environment with a torch already fetched above (the
# CPU-only one, else the oldest): the side-by-side test (tests/test_beside_upstream.py) runs in it.
UP_VENV=.venv-upstream
rm -rf "$UP_VENV"
up_torch=""
if [ -n "$CPU_TORCH_WHEEL" ]; then up_torch="$CPU_TORCH_WHEEL"
elif [ -x "$OLD_VENV/bin/python" ]; then up_torch="torch==$OLDEST_TORCH"; fi
if [ -n "$up_torch" ] && [ "${PRIME_KERNELS_SKIP_UPSTREAM:-0}" != 1 ]; then
  python3 -m venv "$UP_VENV"
  "$UP_VENV/bin/pip" install --quiet --disable-pip-version-check "$up_torch"
  PYTHON="$UP_VENV/bin/python" bash ci/install_upstream_deep_gemm.sh
  "$UP_VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps wheelhouse/prime_kernels_core-*.whl
  export PRIME_KERNELS_UPSTREAM_PYTHON="$(pwd)/$UP_VENV/bin/python"
else
  echo "note: no environment for upstream DeepGEMM beside prime-kernels-core; the side-by-side test will skip"
fi
rm -rf "$probe"
# Run from tests/ so `import prime_kernels` and `import deep_gemm` resolve to the installed wheels, not the
# source tree.
cd tests
run_suite() {  # run_suite PYTHON [pytest args]: pytest's status, 1 when it collected nothing
  local py=$1 rc; shift
  echo "== CPU tests under torch $("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null) ($py)"
  set +e
  "$py" -m pytest -q -ra -p no:cacheprovider "$@"
  rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then echo "error: pytest collected no tests"; rc=1; fi
  return "$rc"
}
status=0
run_suite "../$VENV/bin/python" "$@" || status=$?
if [ "${PRIME_KERNELS_SKIP_OLDEST_TORCH:-0}" != 1 ]; then
  run_suite "../$OLD_VENV/bin/python" "$@" || status=$?
fi
exit "$status"
