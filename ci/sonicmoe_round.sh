#!/usr/bin/env bash
# SonicMoE's rows of bench_layer on the lent GPU machine, in two device calls (600 s each, a fresh machine each):
#   tune:  SonicMoE's first forward + backward at every bench_layer configuration, so that quack's GEMM autotuner
#          (which compiles every candidate configuration in worker processes: more than 270 s for one backward)
#          writes its choices and compiled kernels to a disk cache; the cache comes back as $OUT/quack_cache.tar
#   bench: bench_layer with the sonicmoe backend beside torch and ours, reading that cache (carry it in), so the
#          timed calls compile only the configurations already chosen
# The SonicMoE tree is ci/sonicmoe_bundle.sh's tarball. The build under test: WHEEL_DIR's wheels.
# usage: ci/sonicmoe_round.sh tune|bench WHEEL_DIR SONIC_TARBALL [CACHE_TAR]     environment: OUT (default /tmp/out)
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:?usage: ci/sonicmoe_round.sh tune|bench WHEEL_DIR SONIC_TARBALL [CACHE_TAR]}"
wheel_dir="${2:?wheel dir}"
tarball="${3:?SonicMoE tarball}"
cache_tar="${4:-}"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT" /tmp/sonic /tmp/quack_cache
start=$(date +%s)
python3 -m pip install -q --no-deps --no-index --target /tmp/site "$wheel_dir"/prime_kernels_core-*.whl \
  "$wheel_dir"/prime_kernels-*.whl || exit 1
tar xJf "$tarball" -C /tmp/sonic || exit 1
[ -n "$cache_tar" ] && tar xf "$cache_tar" -C /tmp/quack_cache
# the cutlass-dsl wheel's .pth file names nvidia_cutlass_dsl/python_packages, which an unpacked tree does not process
export PYTHONPATH=/tmp/site:/tmp/sonic:/tmp/sonic/nvidia_cutlass_dsl/python_packages PYTHONUNBUFFERED=1
export QUACK_CACHE_DIR=/tmp/quack_cache QUACK_CACHE_AUTOTUNING=1 QUACK_COMPILE_WORKERS="$(nproc)"
case "$mode" in
  tune)
    # one configuration after another, each under what is left of 560 s; what finished is in the cache
    for shape in qwen3-30b-a3b qwen3-235b-a22b; do
      for tokens in 4096 16384; do
        left=$(( 560 - ($(date +%s) - start) ))
        [ "$left" -gt 30 ] || { echo "sonicmoe_round: out of time before $shape T=$tokens"; break 2; }
        timeout "$left" python3 - "$shape" "$tokens" <<'PY'
import sys, time
sys.path.insert(0, "bench")
import torch
import bench_common as bc
import peer_sonicmoe
E, H, I, K = bc.SHAPES[sys.argv[1]]
T = int(sys.argv[2])
w13, w2 = bc.make_weights(E, H, I, 0, "cuda", 0, 1)
for routing in ("uniform", "zipf"):
    x, idx, w, dy = bc.make_tokens(T, E, H, K, routing, T, "cuda", 0)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
    t0 = time.time()
    torch.autograd.grad(peer_sonicmoe.sonicmoe_layer(*leaves[:1], idx, *leaves[1:]), leaves, dy)
    torch.cuda.synchronize()
    print(f"sonicmoe_round: {sys.argv[1]} T={T} {routing}: first forward + backward {time.time() - t0:.1f} s",
          flush=True)
PY
      done
    done
    tar cf "$OUT/quack_cache.tar" -C /tmp/quack_cache .
    ls -l "$OUT/quack_cache.tar"
    ;;
  bench)
    left=$(( 570 - ($(date +%s) - start) ))
    timeout "$left" python3 bench/bench_layer.py --backends torch,deep_gemm,sonicmoe --max-minutes $(( left / 60 - 1 )) \
      --out "$OUT/layer_sonicmoe.json" --no-plot
    ;;
  *) echo "usage: ci/sonicmoe_round.sh tune|bench WHEEL_DIR SONIC_TARBALL [CACHE_TAR]" >&2; exit 2 ;;
esac
echo "sonicmoe_round $mode: $(( $(date +%s) - start )) s"
