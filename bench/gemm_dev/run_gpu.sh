#!/usr/bin/env bash
# One device call: correctness with the spin-bounded debug build, then timings with the release build.
# Expects .devbuild/ (release) and .devbuild/dbg/ (debug) built here by build.sh and carried.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/pk_out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 bench/gemm_dev/check_and_bench.py --check --lib .devbuild/dbg/libpk_gemm_dev.so --out "$OUT" 2>&1 | tee "$OUT/check.log"
echo "check rc=${PIPESTATUS[0]}"
timeout 240 python3 bench/gemm_dev/check_and_bench.py --bench ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/bench.log"
echo "bench rc=${PIPESTATUS[0]}"
if [ -n "${NCU:-}" ] && command -v ncu >/dev/null; then
  timeout 150 ncu --clock-control none --kernel-name-base demangled -k 'regex:m_grouped|cutlass|Gemm|gemm' \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    python3 bench/gemm_dev/ncu_probe.py > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?"
  grep -E "^  [a-zA-Z_].*\(|Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Executed Ipc|SM Busy|Issue Slots Busy|Max Bandwidth|L1/TEX Hit|L2 Hit" "$OUT/ncu.txt" | cut -c1-150
fi
