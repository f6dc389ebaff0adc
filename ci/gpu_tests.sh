#!/usr/bin/env bash
# On a GPU machine that already has torch (e.g. the lent H200): install a wheel built elsewhere into
# /tmp/site without touching the system packages, then run the given tests under a timeout.
# usage: ci/gpu_tests.sh WHEEL_DIR [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
wheel_dir="${1:?usage: ci/gpu_tests.sh WHEEL_DIR [pytest args]}"; shift
python3 -m pip install -q --no-deps --no-index --target /tmp/site "$wheel_dir"/prime_kernels_core-*.whl \
  "$wheel_dir"/prime_kernels-*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
cd tests
timeout "${PK_TEST_TIMEOUT:-400}" python3 -m pytest -q -ra "$@"
