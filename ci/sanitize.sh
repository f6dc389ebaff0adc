#!/usr/bin/env bash
# Runs compute-sanitizer's memcheck, racecheck, synccheck and initcheck on tests/sanitize_case.py (a small fused
# forward + backward, every grouped-GEMM / combine / dispatch op on ragged groups, and the fused backward's dgrad
# kernel) and prints one line per tool:
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
#   PK_SANITIZE_PART       all | layer | ops | dgrad | dgrad_fp8: which part of the case (default all; ops includes
#                          dgrad and dgrad_fp8, each alone fails where its kernel cannot run)
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

# initcheck cannot see stores made by TMA (cp.async.bulk.tensor): it reports every later generic-proxy read of such
# rows as uninitialised. In the layer part the combine (combine_bf16_kernel) reads the L2 output rows and the dX
# slots, which the fused forward and the grouped GEMMs write only through TMA stores. Reported on the H200
# (compute-sanitizer 2025.3.1) for that part, once the case stopped reading outputs back:
#   ========= Uninitialized __global__ memory read of size 16 bytes
#   =========     at deep_gemm::common::combine_bf16_kernel(const __nv_bfloat16 *, long, long, const int *, ...)+0x1790
# (about 35,000 reports per run, more than the tool's record buffer holds: it kept 512, all the combine's, and
# dropped the rest unread.) So initcheck
# runs each part separately and the layer part leaves the combine kernel unchecked (--kernel-name-exclude), and
# nothing else; the ops part, whose combine reads rows a torch kernel wrote, checks the combine too. The case runs
# with --no-readback under initcheck: its own copies of TMA-stored outputs would be reported as well; the other
# tools' runs compare. Every report is printed (no backtraces, for speed) and counted by reading kernel; a log that
# holds fewer reports than its summary, or says the tool dropped some, fails.
INITCHECK_TMA_READERS="combine_bf16_kernel"

# reports_by_kernel LOG: "count kernel" per reading kernel of the log's initcheck reports.
reports_by_kernel() {
  awk '/^========= Host API memory access error/ {n["host-API-access"]++; next}
       /^========= Uninitialized/ {want = 1; next}
       want && /^=========     at / {k = $0; sub(/^=========     at (void )?/, "", k); sub(/[(<].*/, "", k);
                                      sub(/.*::/, "", k); n[k]++; want = 0}
       END {for (k in n) print n[k], k}' "$1"
}

RUNS=()
for tool in "${TOOLS[@]}"; do
  if [ "$tool" = initcheck ] && [ "$PART" = all ]; then RUNS+=("initcheck:layer" "initcheck:ops")
  else RUNS+=("$tool:$PART"); fi
done

status=0
for run in "${RUNS[@]}"; do
  tool=${run%%:*}
  part=${run#*:}
  limit=200
  case_args=()
  case "$tool" in
    memcheck|synccheck) extra=() ;;
    initcheck) extra=(--show-backtrace no); limit=100000000; case_args=(--no-readback)
               [ "$part" = layer ] && extra+=(--kernel-name-exclude "kns=$INITCHECK_TMA_READERS") ;;
    racecheck) extra=(--racecheck-report analysis) ;;
    *) echo "$tool: unknown tool (memcheck, racecheck, synccheck, initcheck)"; status=1; continue ;;
  esac
  label=$tool
  [ "$part" = all ] || label="$tool ($part)"
  log="$LOG_DIR/$tool-$part.log"
  out="$LOG_DIR/$tool-$part.out"
  rm -f "$log" "$out"
  start=$(date +%s)
  # The caching allocator hands out blocks that earlier kernels wrote, which would hide uninitialised reads from
  # initcheck and out-of-bounds accesses that stay inside a cached block from memcheck: every tool runs without it.
  # shellcheck disable=SC2086
  (cd tests && PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONUNBUFFERED=1 timeout --kill-after=30 "$TIMEOUT" \
      "$SAN" --tool "$tool" ${extra[@]+"${extra[@]}"} --log-file "$log" --print-limit "$limit" --launch-timeout 300 \
      --target-processes all ${PK_SANITIZE_ARGS:-} "$PY" sanitize_case.py --part "$part" ${case_args[@]+"${case_args[@]}"}) >"$out" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  [ -s "$log" ] || cp "$out" "$log"  # an old tool without --log-file support, or one that failed at start
  n=$(count_errors "$tool" "$log")
  finished=no
  grep -q '^sanitize_case: done' "$out" && finished=yes
  note=""
  if [ "$tool" = initcheck ] && [ "$n" != none ]; then
    # The tool keeps a bounded buffer of records per launch and drops the rest ("N errors were skipped (error
    # buffer overflow)"): dropped records cannot be classified, so the run fails rather than count them as excluded.
    dropped=$(sed -nE 's/^========= ([0-9,]+) errors were skipped.*/\1/p' "$log" | tr -d , | awk '{s += $1} END {print s + 0}')
    if [ "$dropped" -gt 0 ]; then
      echo "$label: FAILED: the tool dropped $dropped reports (error buffer overflow), which cannot be classified;" \
           "by reading kernel, the $(reports_by_kernel "$log" | awk '{s += $1} END {print s + 0}') kept:" \
           "$(reports_by_kernel "$log" | sort -rn | tr '\n' ' ')(log $log)"
      status=1
      continue
    fi
    listed=$(reports_by_kernel "$log" | awk '{s += $1} END {print s + 0}')
    if [ "$listed" -ne "$n" ]; then
      echo "$label: FAILED: the log holds $listed of the $n reports its summary counts (log $log)"
      status=1
      continue
    fi
    [ "$part" = layer ] && note=" ($INITCHECK_TMA_READERS not checked: its reads of TMA-stored rows)"
  fi
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "$label: FAILED: timed out after ${TIMEOUT} s (errors so far: $n; log $log)"
    status=1
  elif [ "$n" = none ]; then
    echo "$label: FAILED: no summary in the report (exit $rc; log $log, output $out)"
    status=1
  elif [ "$finished" != yes ]; then
    echo "$label: FAILED: the case did not finish (exit $rc, $n errors before): $(tail -n 3 "$out" | tr '\n' ' ')"
    status=1
  else
    suffix=""
    [ "$tool" = racecheck ] && suffix=" ($(count_warnings "$log") warnings)"
    echo "$label: $n errors$suffix$note [${secs} s]"
    if [ "$n" -ne 0 ]; then
      status=1
      if [ "$tool" = initcheck ]; then
        reports_by_kernel "$log" | sort -rn | head -n 8 | sed 's/^/    reports in: /'
      else
        grep -E -m 5 -A 3 '^========= (Invalid|Uninitialized|Error|Race|Barrier|Warning)' "$log" | sed 's/^/    /'
      fi
    fi
  fi
done
exit "$status"
