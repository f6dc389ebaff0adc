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
# against): the wheel must import and run its CPU ops there too. Upstream DeepGEMM is installed into it
# first, then prime-kernels-core (not the drop-in), as a user who needs both does: the side-by-side test
# runs there. Skipped where no such torch exists. (torch is not under ci/constraints.txt: that environment
# exists to hold another torch.)
if [ "${PRIME_KERNELS_SKIP_CPU_TORCH:-0}" != 1 ]; then
  rm -rf .venv-cpu-torch && python3 -m venv .venv-cpu-torch
  if .venv-cpu-torch/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0" 2>/dev/null \
      && .venv-cpu-torch/bin/python -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)"; then
    PYTHON=.venv-cpu-torch/bin/python bash ci/install_upstream_deep_gemm.sh
    .venv-cpu-torch/bin/pip install --quiet --disable-pip-version-check --no-deps wheelhouse/prime_kernels_core-*.whl
    export PRIME_KERNELS_CPU_TORCH_PYTHON="$(pwd)/.venv-cpu-torch/bin/python"
    export PRIME_KERNELS_UPSTREAM_PYTHON="$PRIME_KERNELS_CPU_TORCH_PYTHON"
  else
    echo "note: no CPU-only torch 2.13.0 available here; the CPU-only-torch test will skip"
  fi
fi
# Run from tests/ so `import prime_kernels` and `import deep_gemm` resolve to the installed wheels, not the
# source tree.
cd tests
set +e
"../$VENV/bin/python" -m pytest -q -ra "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "error: pytest collected no tests"; exit 1; fi
exit "$rc"
