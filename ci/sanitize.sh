#!/usr/bin/env bash
# Runs compute-sanitizer's memcheck, racecheck, synccheck and initcheck on tests/sanitize_case.py (a small fused
# forward + backward and every grouped-GEMM / combine / dispatch op on ragged groups) and prints one line per tool:
#   memcheck: 0 errors
#   racecheck: 0 errors (0 warnings)
# Exits nonzero when any tool reports an error, times out, or the case did not run to its end.
#
# usage: ci/sanitize.sh [TOOL ...]                 (default: memcheck racecheck synccheck initcheck)
#        ci/sanitize.sh --count TOOL LOGFILE       (print the error count a saved log holds: checks the parser)
# environment:
#   PYTHON                 the interpreter that has torch and prime_kernels (default python3)
#   COMPUTE_SANITIZER      the tool (default: PATH, then /usr/local/cuda/bin, then the newest /usr/local/cuda-*)
#   PK_SANITIZE_TIMEOUT    seconds per tool (default 900)
#   PK_SANITIZE_PART       all | layer | ops: which part of the case (default all)
#   PK_SANITIZE_LOG_DIR    where the full reports go (default /tmp/pk_sanitize)
#   PK_SANITIZE_ARGS       extra compute-sanitizer arguments for every tool
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

# count_errors TOOL LOG: the errors the log reports, or "none" when it holds no summary (the tool did not finish).
# memcheck, synccheck, initcheck end with "ERROR SUMMARY: N error(s)"; racecheck's analysis report ends with
# "RACECHECK SUMMARY: H hazard(s) displayed (E error(s), W warning(s))". Numbers may carry thousands separators.
count_errors() {
  local tool=$1 log=$2 line n=none
  if [ "$tool" = racecheck ]; then
    line=$(grep -E 'RACECHECK SUMMARY:' "$log" 2>/dev/null | tail -n 1)
    if [ -n "$line" ]; then
      n=$(sed -nE 's/.*[(]([0-9,]+) errors?.*/\1/p' <<<"$line" | tr -d ,)
      [ -n "$n" ] || n=none
    fi
  fi
  line=$(grep -E 'ERROR SUMMARY: [0-9,]+ errors?' "$log" 2>/dev/null | tail -n 1)
  if [ -n "$line" ]; then
    local m
    m=$(sed -nE 's/.*ERROR SUMMARY: ([0-9,]+) errors?.*/\1/p' <<<"$line" | tr -d ,)
    if [ "$n" = none ] || { [ -n "$m" ] && [ "$m" -gt "$n" ]; }; then n=$m; fi
  fi
  echo "$n"
}

# count_warnings LOG: racecheck's warnings (0 when the summary has none).
count_warnings() {
  local line
  line=$(grep -E 'RACECHECK SUMMARY:' "$1" 2>/dev/null | tail -n 1)
  sed -nE 's/.*[ ,(]([0-9,]+) warnings?[)].*/\1/p' <<<"$line" | tr -d , | grep . || echo 0
}

if [ "${1:-}" = --count ]; then
  [ $# -eq 3 ] || { echo "usage: ci/sanitize.sh --count TOOL LOGFILE" >&2; exit 2; }
  count_errors "$2" "$3"
  exit 0
fi

find_sanitizer() {
  if [ -n "${COMPUTE_SANITIZER:-}" ]; then echo "$COMPUTE_SANITIZER"; return; fi
  if command -v compute-sanitizer >/dev/null 2>&1; then command -v compute-sanitizer; return; fi
  local c
  for c in /usr/local/cuda/bin/compute-sanitizer $(ls -d /usr/local/cuda-*/bin/compute-sanitizer 2>/dev/null | sort -V -r); do
    if [ -x "$c" ]; then echo "$c"; return; fi
  done
}

SAN=$(find_sanitizer)
if [ -z "$SAN" ]; then
  echo "error: compute-sanitizer not found (set COMPUTE_SANITIZER, or put it on PATH)" >&2
  exit 2
fi
PY=${PYTHON:-python3}
TIMEOUT=${PK_SANITIZE_TIMEOUT:-900}
PART=${PK_SANITIZE_PART:-all}
LOG_DIR=${PK_SANITIZE_LOG_DIR:-/tmp/pk_sanitize}
mkdir -p "$LOG_DIR"
TOOLS=("$@")
[ ${#TOOLS[@]} -gt 0 ] || TOOLS=(memcheck racecheck synccheck initcheck)
echo "compute-sanitizer: $SAN ($("$SAN" --version 2>/dev/null | tail -n 1))"
echo "case: $PY tests/sanitize_case.py --part $PART; logs in $LOG_DIR"

status=0
for tool in "${TOOLS[@]}"; do
  case "$tool" in
    memcheck|synccheck|initcheck) extra=() ;;
    racecheck) extra=(--racecheck-report analysis) ;;
    *) echo "$tool: unknown tool (memcheck, racecheck, synccheck, initcheck)"; status=1; continue ;;
  esac
  log="$LOG_DIR/$tool.log"
  out="$LOG_DIR/$tool.out"
  rm -f "$log" "$out"
  start=$(date +%s)
  # The caching allocator hands out blocks that earlier kernels wrote, which would hide uninitialised reads from
  # initcheck and out-of-bounds accesses that stay inside a cached block from memcheck: every tool runs without it.
  # shellcheck disable=SC2086
  (cd tests && PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONUNBUFFERED=1 timeout --kill-after=30 "$TIMEOUT" \
      "$SAN" --tool "$tool" ${extra[@]+"${extra[@]}"} --log-file "$log" --print-limit 200 --launch-timeout 300 \
      --target-processes all ${PK_SANITIZE_ARGS:-} "$PY" sanitize_case.py --part "$PART") >"$out" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  [ -s "$log" ] || cp "$out" "$log"  # an old tool without --log-file support, or one that failed at start
  n=$(count_errors "$tool" "$log")
  finished=no
  grep -q '^sanitize_case: done' "$out" && finished=yes
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "$tool: FAILED: timed out after ${TIMEOUT} s (errors so far: $n; log $log)"
    status=1
  elif [ "$n" = none ]; then
    echo "$tool: FAILED: no summary in the report (exit $rc; log $log, output $out)"
    status=1
  elif [ "$finished" != yes ]; then
    echo "$tool: FAILED: the case did not finish (exit $rc, $n errors before): $(tail -n 3 "$out" | tr '\n' ' ')"
    status=1
  else
    suffix=""
    [ "$tool" = racecheck ] && suffix=" ($(count_warnings "$log") warnings)"
    echo "$tool: $n errors$suffix [${secs} s]"
    if [ "$n" -ne 0 ]; then
      status=1
      grep -E -m 5 -A 3 '^========= (Invalid|Uninitialized|Error|Race|Barrier|Warning)' "$log" | sed 's/^/    /'
    fi
  fi
done
exit "$status"
