#!/usr/bin/env bash
# One device call: correctness with the spin-bounded debug build, then timings with the release build.
# Expects .devbuild/ (release) and .devbuild/dbg/ (debug) built here by build.sh and carried.
# Env: CHECK_S / BENCH_S (timeouts, s), SKIP_CHECK=1, BENCH_ARGS, NCU=1 (ncu probe after the bench).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/pk_out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
if [ -z "${SKIP_CHECK:-}" ]; then
  t0=$(date +%s)
  timeout "${CHECK_S:-240}" python3 bench/gemm_dev/check_and_bench.py --check --lib .devbuild/dbg/libpk_gemm_dev.so --out "$OUT" > "$OUT/check.log" 2>&1
  echo "check rc=$? ($(( $(date +%s) - t0 )) s)"
  grep -E "FAIL|EXC|CHECKS|validation|Error|error" "$OUT/check.log" | head -40
fi
t0=$(date +%s)
timeout "${BENCH_S:-240}" python3 bench/gemm_dev/check_and_bench.py --bench ${BENCH_ARGS:-} --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$? ($(( $(date +%s) - t0 )) s)"
grep -vE "^  (30B|235B) .* cfg=" "$OUT/bench.log" | tail -60
if [ -n "${NCU:-}" ] && command -v ncu >/dev/null; then
  timeout 150 ncu --clock-control none --kernel-name-base demangled -k 'regex:m_grouped|cutlass|Gemm|gemm' \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    python3 bench/gemm_dev/ncu_probe.py > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?"
  grep -E "^  [a-zA-Z_].*\(|Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Executed Ipc|SM Busy|Issue Slots Busy|Max Bandwidth|L1/TEX Hit|L2 Hit" "$OUT/ncu.txt" | cut -c1-150
fi
