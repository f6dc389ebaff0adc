#!/usr/bin/env bash
# Builds the dev shared library for check_and_bench.py into /work/main/.devbuild (git-ignored).
# Usage: bench/gemm_dev/build.sh [extra nvcc flags, e.g. -DPK_DEBUG_SPIN_BOUND=200000000]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUTDIR="${OUTDIR:-$ROOT/.devbuild}"
mkdir -p "$OUTDIR"
NVCC="${NVCC:-nvcc}"
FLAGS=(-gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -Xptxas -v --compress-mode=size
       -cudart static -Xcompiler -fPIC -Xcompiler -fvisibility=hidden --expt-relaxed-constexpr "$@")
"$NVCC" "${FLAGS[@]}" -c "$ROOT/csrc/sm90/grouped_gemm.cu" -o "$OUTDIR/grouped_gemm.o" 2> "$OUTDIR/ptxas.log" || { cat "$OUTDIR/ptxas.log"; exit 1; }
"$NVCC" "${FLAGS[@]}" -Xcompiler -fvisibility=default -c "$ROOT/bench/gemm_dev/dev_capi.cu" -o "$OUTDIR/dev_capi.o"
"$NVCC" -gencode arch=compute_90a,code=sm_90a -cudart static -shared "$OUTDIR/grouped_gemm.o" "$OUTDIR/dev_capi.o" -o "$OUTDIR/libpk_gemm_dev.so"
grep -E "Compiling entry|registers|stack|spill" "$OUTDIR/ptxas.log" | sed 's/ptxas info    ://' || true
echo "built $OUTDIR/libpk_gemm_dev.so"
