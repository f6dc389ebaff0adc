#!/usr/bin/env bash
# Builds bench/tile_proto/bench (round 2; --equal768: round 1) and bench_debug (the proto kernels' mbarrier waits
# bounded, trap on timeout; the baseline with PK_DEBUG_SPIN_BOUND). sm_90a only. Logs with ptxas -v in build_*.log.
# No -lcuda: cuTensorMapEncodeTiled is fetched through cudaGetDriverEntryPointByVersion (host_utils.hpp), and NVML
# is dlopen'ed, so the binary needs only the driver at run time (this build machine has no libcuda to link).
set -euo pipefail
cd "$(dirname "$0")"
export PATH=/usr/local/cuda/bin:$PATH
REPO="$(cd ../.. && pwd)"  # the repository root (this directory is bench/tile_proto)
FLAGS=(-std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Xptxas=-warn-spills -Xptxas=-v
       -I"$REPO/csrc" -I"$REPO/build" -I.)
nvcc "${FLAGS[@]}" -c "$REPO/csrc/sm90/grouped_gemm.cu" -o grouped_gemm.o > build_grouped_gemm.log 2>&1 &
p1=$!
nvcc "${FLAGS[@]}" -c bench.cu -o bench.o > build_bench.log 2>&1 &
p2=$!
wait $p1 || { cat build_grouped_gemm.log; exit 1; }
wait $p2 || { cat build_bench.log; exit 1; }
nvcc -gencode arch=compute_90a,code=sm_90a bench.o grouped_gemm.o -o bench -ldl -lpthread
# host-only check of the VT tile walk (no GPU needed)
nvcc -std=c++17 -O2 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I"$REPO/csrc" -I. \
  vt_host_test.cu -o vt_host_test
./vt_host_test
if [[ "${NO_DEBUG:-0}" != 1 ]]; then
  nvcc "${FLAGS[@]}" -DPK_DEBUG_SPIN_BOUND=20000000 -c "$REPO/csrc/sm90/grouped_gemm.cu" -o grouped_gemm_debug.o \
    > build_grouped_gemm_debug.log 2>&1 &
  p1=$!
  nvcc "${FLAGS[@]}" -DPROTO_DEBUG -c bench.cu -o bench_debug.o > build_bench_debug.log 2>&1 &
  p2=$!
  wait $p1 || { cat build_grouped_gemm_debug.log; exit 1; }
  wait $p2 || { cat build_bench_debug.log; exit 1; }
  nvcc -gencode arch=compute_90a,code=sm_90a bench_debug.o grouped_gemm_debug.o -o bench_debug -ldl -lpthread
fi
# ptxas summary of the prototype kernels
for f in build_bench.log build_bench_debug.log; do
  [[ -f $f ]] || continue
  echo "== $f"
  grep -A3 "Compiling entry function '_ZN8proto192" $f | grep -E "entry|stack|Used" | sed -E 's/.*proto192[0-9]+([a-z_]+_gemm_kernel)INS_[0-9]+(BigTileCfgI[^P]*E)EEEv.*/\1<\2>/' || true
done
grep -E "warning|C75" build_bench.log build_grouped_gemm.log build_bench_debug.log 2>/dev/null || echo "no ptxas warnings"
echo "built: $(pwd)/bench$( [[ "${NO_DEBUG:-0}" != 1 ]] && echo " and bench_debug")"
