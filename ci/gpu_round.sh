#!/usr/bin/env bash
# One call on the lent GPU machine (600 s a command): what decides the state of the build, each step under a
# timeout cut from one budget, going on after a failure, then a table.
#   1. bench/bench_bwd_dgrad.py: the fused dgrad kernel against the pipeline's two steps (ms, bitwise flags)
#   2. the test suite through ci/gpu_tests.sh (tests/test_sanitizer.py runs ci/sanitize.sh's four tools,
#      tests/test_fault_matrix.py every fault case), or the test files and pytest arguments given after WHEEL_DIR:
#      the whole suite takes ~470 s on an H200, so give the files that matter most to this call and the rest to
#      ci/gpu_tests.sh in a second one
# Files in $OUT (default /tmp/out): gpu_round.txt (the table), bench_bwd_dgrad.txt / .json, tests.log, junit.xml.
# usage: ci/gpu_round.sh WHEEL_DIR [pytest args]      environment: OUT, PK_ROUND_BUDGET_S (default 570)
set -uo pipefail
cd "$(dirname "$0")/.."
wheel_dir="${1:?usage: ci/gpu_round.sh WHEEL_DIR [pytest args]}"
shift
OUT="${OUT:-/tmp/out}"
BUDGET="${PK_ROUND_BUDGET_S:-570}"
START=$(date +%s)
mkdir -p "$OUT"
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
TABLE="$OUT/gpu_round.txt"
: > "$TABLE"
row() { printf '%-16s %-10s %s\n' "$1" "$2" "$3" | tee -a "$TABLE"; }

# the build under test, and the integration tests' wheels (ci/device_wheels.sh puts them in .whl/) when carried
python3 -m pip install -q --upgrade --no-deps --no-index --target /tmp/site "$wheel_dir"/prime_kernels_core-*.whl \
  "$wheel_dir"/prime_kernels-*.whl || { row install fail "pip install of $wheel_dir"; exit 1; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1

timeout --kill-after=10 90 python3 bench/bench_bwd_dgrad.py --out "$OUT/bench_bwd_dgrad.json" --max-seconds 60 \
  > "$OUT/bench_bwd_dgrad.txt" 2>&1
rc=$?
row bench_bwd_dgrad "rc=$rc" "$(grep -cE '^\[bench\] qwen3' "$OUT/bench_bwd_dgrad.txt") configurations, \
$(grep -cE 'bitwise False' "$OUT/bench_bwd_dgrad.txt") not bitwise"

t=$(( $(left) - 5 ))
if [ "$t" -gt 60 ]; then
  PK_TEST_TIMEOUT=$(( t - 15 )) timeout --kill-after=10 "$t" bash ci/gpu_tests.sh "$wheel_dir" -p no:cacheprovider \
    --junitxml="$OUT/junit.xml" "$@" > "$OUT/tests.log" 2>&1
  rc=$?
  row test_suite "rc=$rc" "$(grep -E '[0-9]+ (passed|failed|errors?)' "$OUT/tests.log" | tail -n 1)"
else
  row test_suite skipped "only $t s left"
fi
echo "gpu_round: $(( $(date +%s) - START )) s" | tee -a "$TABLE"
