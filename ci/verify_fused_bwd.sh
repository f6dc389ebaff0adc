#!/usr/bin/env bash
# Verifies and measures the fused backward kernel (prime_kernels.mega._fused_bwd.dgrad, and dgrad_wgrad with its
# weight-gradient tiles) in one GPU call, on
# a machine that already has torch and compute-sanitizer (e.g. the lent H200): installs the wheels of WHEEL_DIR into
# /tmp/site (as ci/gpu_tests.sh does), then runs, each under a timeout and whatever the earlier ones gave:
#   1. pytest tests/test_mega_bwd_fused.py
#   2. the fault matrix's dgrad cases (tests/fault_cases_dgrad.py, names dgrad_*, dgrad_wgrad_*)
#   3. compute-sanitizer memcheck, racecheck, synccheck on the kernel alone (ci/sanitize.sh, part dgrad)
#   4. bench/bench_bwd_dgrad.py (fused against the pipeline's two steps, and with the weight gradients against the
#      pipeline's four; 30B and 235B shapes)
# and prints a final table step -> pass / fail. What must come back is written to $OUT (default /tmp/out), seven
# files: summary.txt (environment, each step's command and result, the table), pytest_bwd_fused.txt,
# fault_matrix.txt, fault_matrix.json, sanitize.txt (the tools' lines and the tails of their reports),
# bench_bwd_dgrad.txt, bench_bwd_dgrad.json.
#
# usage: ci/verify_fused_bwd.sh WHEEL_DIR
# environment: OUT; PK_VERIFY_BUDGET_S (default 560, under the lent machine's 600 s a command): the whole run's
# wall-clock bound. Each step's timeout is its
# cap, cut so that the steps after it keep their minimum share of what is left; a step with under 20 s is skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
wheel_dir="${1:?usage: ci/verify_fused_bwd.sh WHEEL_DIR}"
case "$wheel_dir" in /*) ;; *) wheel_dir="$REPO/$wheel_dir" ;; esac
OUT="${OUT:-/tmp/out}"
BUDGET="${PK_VERIFY_BUDGET_S:-560}"
WORK=/tmp/pk_verify
START=$(date +%s)
mkdir -p "$OUT"
# an earlier run's files would pass for this run's where a step is skipped
rm -f "$OUT"/{summary,pytest_bwd_fused,fault_matrix,sanitize,bench_bwd_dgrad}.txt "$OUT"/{fault_matrix,bench_bwd_dgrad}.json
rm -rf "$WORK" && mkdir -p "$WORK"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1

say() { echo "$*" | tee -a "$SUMMARY"; }
elapsed() { echo $(( $(date +%s) - START )); }

# limit CAP RESERVE: CAP seconds, or less so that RESERVE seconds stay for the later steps
limit() {
  local left=$(( BUDGET - $(elapsed) - $2 ))
  echo $(( $1 < left ? $1 : left ))
}

NAMES=()
RESULTS=()
DETAILS=()
# step NAME TIMEOUT LOG CMD...: runs CMD (stdout and stderr to LOG) under TIMEOUT seconds; records pass / fail
step() {
  local name=$1 t=$2 log=$3 rc s0 res
  shift 3
  NAMES+=("$name")
  if [ "$t" -lt 20 ]; then
    RESULTS+=("skip")
    DETAILS+=("not run: under 20 s of the ${BUDGET} s budget left for it")
    say "== $name: skipped (${t} s left)"
    return
  fi
  say "== $name [timeout ${t} s, at $(elapsed) s]: $*"
  s0=$(date +%s)
  timeout --kill-after=10 "$t" "$@" > "$log" 2>&1
  rc=$?
  if [ "$rc" -eq 0 ]; then res=pass
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then res="fail (timed out)"
  else res="fail (exit $rc)"; fi
  RESULTS+=("$res [$(( $(date +%s) - s0 )) s]")
  DETAILS+=("")
  say "   $res in $(( $(date +%s) - s0 )) s; log: $log"
}
# detail TEXT: the last step's detail column (kept as "not run" for a skipped step)
detail() { [ "${RESULTS[${#RESULTS[@]}-1]}" = skip ] || DETAILS[${#DETAILS[@]}-1]="$1"; }
# the command after it, run in tests/ (as the suite runs: the installed wheels, not the source tree, are imported)
IN_TESTS=(bash -c 'cd tests && exec "$@"' in_tests)

say "verify_fused_bwd: wheels from $wheel_dir, results in $OUT, budget ${BUDGET} s"
step install "$(limit 120 300)" "$WORK/install.txt" python3 -m pip install -q --upgrade --no-deps --no-index \
  --target /tmp/site "$wheel_dir"/prime_kernels_core-*.whl "$wheel_dir"/prime_kernels-*.whl
tail -n 5 "$WORK/install.txt" >> "$SUMMARY"
{
  timeout 30 nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader 2>&1
  (cd tests && timeout 120 python3 -c "
import torch, prime_kernels
from prime_kernels import _status
from prime_kernels.mega import _fused_bwd
k = _fused_bwd.STATUS_KEY
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'from', prime_kernels.__file__)
print('build', prime_kernels.build_info())
print(k, 'status:', prime_kernels.status()[k], '| runnable:', _status.runnable(k))" 2>&1)
} | tee -a "$SUMMARY"

step pytest_bwd_fused "$(limit 180 240)" "$OUT/pytest_bwd_fused.txt" \
  "${IN_TESTS[@]}" python3 -m pytest -q -ra -p no:cacheprovider test_mega_bwd_fused.py
detail "$(grep -E '[0-9]+ (passed|failed|skipped|errors?)' "$OUT/pytest_bwd_fused.txt" | tail -n 1)"

# the direct runner: one line per case as it ends (a step cut off by its timeout still shows the cases before)
mapfile -t CASES < <(cd tests && timeout 120 python3 -c "
import fault_cases
print('\n'.join(n for n in fault_cases.CASES if n.startswith('dgrad_')))" 2>/dev/null)
# none found (an import failed): a name the runner refuses, never the empty list (which runs every case)
[ ${#CASES[@]} -gt 0 ] || CASES=(no_dgrad_cases_found)
step fault_matrix_dgrad "$(limit 240 180)" "$OUT/fault_matrix.txt" \
  "${IN_TESTS[@]}" env PK_FAULT_MATRIX_REPORT="$OUT/fault_matrix.json" python3 test_fault_matrix.py "${CASES[@]}"
detail "${#CASES[@]} cases: $(grep -E '^fault matrix:' "$OUT/fault_matrix.txt" | tail -n 1)"

# ci/sanitize.sh runs the tools one after another, each under PK_SANITIZE_TIMEOUT
t=$(limit 330 100)
step sanitize_dgrad "$t" "$OUT/sanitize.txt" env PK_SANITIZE_PART=dgrad PK_SANITIZE_LOG_DIR="$WORK/sanitize" \
  PK_SANITIZE_TIMEOUT=$(( t > 50 ? (t - 20) / 3 : 10 )) bash ci/sanitize.sh memcheck racecheck synccheck
detail "$(grep -E '^(memcheck|racecheck|synccheck)' "$OUT/sanitize.txt" | tr '\n' ';')"
for f in "$WORK"/sanitize/*; do
  [ -f "$f" ] || continue
  { echo; echo "----- $(basename "$f") (last 60 lines)"; tail -n 60 "$f"; } >> "$OUT/sanitize.txt"
done

t=$(limit 240 0)
step bench_bwd_dgrad "$t" "$OUT/bench_bwd_dgrad.txt" python3 bench/bench_bwd_dgrad.py \
  --out "$OUT/bench_bwd_dgrad.json" --max-seconds $(( t > 90 ? t - 75 : 15 ))
detail "$(grep -cE '^\[bench\] qwen3' "$OUT/bench_bwd_dgrad.txt") configurations; $(grep -cE 'bitwise False' \
  "$OUT/bench_bwd_dgrad.txt") not bitwise"

say ""
say "verify_fused_bwd: $(elapsed) s"
{
  printf '%-20s  %-24s  %s\n' step result detail
  printf '%-20s  %-24s  %s\n' "--------------------" "------------------------" "------"
  for i in "${!NAMES[@]}"; do
    printf '%-20s  %-24s  %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${DETAILS[$i]}"
  done
} | tee -a "$SUMMARY"
fails=0
for r in "${RESULTS[@]}"; do
  case "$r" in pass*) ;; *) fails=$(( fails + 1 )) ;; esac
done
exit $(( fails > 0 ))
