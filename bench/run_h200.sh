#!/usr/bin/env bash
# The official runs in one call on a GPU machine that already has torch (e.g. the lent H200): install a
# wheel built elsewhere into /tmp/site, then run the chosen steps. Results and logs go to $OUT.
#
# usage: bash bench/run_h200.sh [tests|fp8_tests|fused_bwd|bwd_lags|gemm|layer|fp8|floor|parity|staged|quantize|ep|multi|
#                                torch_gemms|peer|train_step|shared]...
#        (default: tests gemm layer floor)
# environment:
#   WHEEL_DIR    where prime_kernels_core-*.whl and the prime_kernels-*.whl drop-in are (default wheelhouse)
#   OUT          results folder (default /tmp/pk_out)
#   PYTEST_ARGS  extra pytest arguments for "tests"
#   LAYER_ARGS   bench_layer.py arguments (default: the official run, --sustained-seconds 2 --inference)
#   PARITY_ARGS  extra examples/train_parity.py arguments
#   TRAIN_STEP_CKPT, TRAIN_STEP_VARIANTS  train_step's checkpointing settings (default "on off") and variants
# .whl/ (ci/device_wheels.sh, carried) holds the integration tests' packages; without it those tests skip.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/pk_out}"; mkdir -p "$OUT"
WHEEL_DIR="${WHEEL_DIR:-wheelhouse}"
python3 -m pip install -q --no-deps --no-index --target /tmp/site "$WHEEL_DIR"/prime_kernels_core-*.whl \
  "$WHEEL_DIR"/prime_kernels-*.whl \
  $(ls .whl/*.whl 2>/dev/null) || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PRIME_KERNELS_TEST_PYPI_NVCC=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw --format=csv,noheader
steps="${*:-tests gemm layer floor}"
for step in $steps; do
  case "$step" in
    tests)  (cd tests && timeout 400 python3 -m pytest -q -ra -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 \
               | tee "$OUT/tests.log" | tail -25) ;;
    fp8_tests) (cd tests && timeout 400 python3 -m pytest -q -ra -p no:cacheprovider test_mega_fused_fp8.py \
               test_fp8_matrix.py test_fp8_fwd_pipeline.py test_fp8_bwd_pipeline.py test_fp8_reference.py \
               test_integration_prime_rl_fp8.py test_swiglu_fwd_fp8.py test_swiglu_bwd_fp8.py test_quantize_fp8.py \
               test_grouped_gemm_fp8.py test_grouped_gemm_fp8_k.py 2>&1 | tee "$OUT/tests_fp8.log" | tail -25) ;;
    fused_bwd) OUT="$OUT/verify_fused_bwd" PK_VERIFY_BUDGET_S=${PK_VERIFY_BUDGET_S:-540} \
               bash ci/verify_fused_bwd.sh "$WHEEL_DIR" 2>&1 | tail -20 ;;
    bwd_lags) timeout 300 python3 bench/bench_bwd_dgrad.py --lags 1,2,3,4,6,8 --out "$OUT/bwd_lags.json" 2>&1 \
               | tee "$OUT/bench_bwd_lags.log" | tail -12 ;;
    gemm)   timeout 300 python3 bench/bench_gemm.py --out "$OUT" 2>&1 | tee "$OUT/bench_gemm.log" | grep -v "^$" ;;
    layer)  timeout 500 python3 bench/bench_layer.py --out "$OUT/layer.json" ${LAYER_ARGS:---sustained-seconds 2 --inference} \
               2>&1 | tee "$OUT/bench_layer.log" | tail -40 ;;
    fp8)    for prec in fp8 bf16; do  # the FP8 layer beside torch's BF16 one and the FP8 pipeline; our BF16 layer
              b=torch,deep_gemm,deep_gemm_grouped; [ "$prec" = bf16 ] && b=deep_gemm
              timeout 300 python3 bench/bench_layer.py --precision $prec --backends $b --no-plot \
                --out "$OUT/layer_$prec.json" 2>&1 | tee "$OUT/bench_layer_$prec.log" | tail -30
            done ;;
    floor)  timeout 300 python3 bench/floor_fwd.py --tokens 16384 --out "$OUT/floor_fwd.json" 2>&1 \
               | tee "$OUT/floor_fwd.log" | tail -15 ;;
    parity) timeout 500 python3 examples/train_parity.py --out "$OUT/train_parity.json" ${PARITY_ARGS:-} 2>&1 \
               | tee "$OUT/train_parity.log" | tail -30 ;;
    staged) timeout 300 python3 bench/bench_staged_fp8.py --out "$OUT/staged_fp8.json" 2>&1 \
               | tee "$OUT/bench_staged_fp8.log" | tail -12 ;;
    ep)     (cd tests && timeout 240 python3 -m pytest -q -ra -p no:cacheprovider test_mega_loopback.py \
               test_mega_ep_grouped.py test_mega_ep.py 2>&1 | tee "$OUT/tests_ep.log" | tail -8)
            timeout 150 python3 bench/bench_ep_loopback.py --shapes qwen3-30b-a3b --tokens 16384 --ranks 2 \
               --chunks 1,2,4 --link-gbps 0,100 --warmup 2 --iters 5 --max-minutes 2 --trace "$OUT/ep_traces" \
               --out "$OUT/ep_loopback_30b_t16k_r2.json" 2>&1 | tee "$OUT/bench_ep_loopback_30b_t16k.log" | grep -v "^$"
            timeout 150 python3 bench/bench_ep_loopback.py --shapes qwen3-30b-a3b --tokens 4096 --ranks 8 \
               --chunks 1,2 --warmup 2 --iters 4 --max-minutes 1.5 --trace "$OUT/ep_traces" \
               --out "$OUT/ep_loopback_30b_r8.json" 2>&1 | tee "$OUT/bench_ep_loopback_30b_r8.log" | grep -v "^$"
            timeout 100 python3 bench/bench_ep_loopback.py --shapes qwen3-235b-a22b --tokens 4096 --ranks 4 \
               --chunks 1 --warmup 2 --iters 4 --max-minutes 1 --out "$OUT/ep_loopback_235b_r4.json" 2>&1 \
               | tee "$OUT/bench_ep_loopback_235b.log" | grep -v "^$"
            tar czf "$OUT/ep_traces.tgz" -C "$OUT" ep_traces && rm -rf "$OUT/ep_traces" ;;
    multi)  # a machine with several GPUs: EP over NCCL, one GPU per rank, multicast off in every process
            export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
            ngpu=$(nvidia-smi -L | wc -l)
            (cd tests && timeout 100 python3 -m pytest -q -ra -p no:cacheprovider test_mega_ep_grouped.py \
               test_mega_ep.py -k "nccl or ep2_equals_ep1" 2>&1 | tee "$OUT/tests_multi_gpu.log" | tail -8)
            for prec in bf16 fp8; do
              timeout 240 python3 -m torch.distributed.run --nproc-per-node "$ngpu" bench/bench_layer.py \
                 --shapes qwen3-30b-a3b,qwen3-235b-a22b --tokens 16384 --routings uniform,zipf --precision "$prec" \
                 --rounds 1 \
                 --backends torch,deep_gemm --no-plot --out "$OUT/layer_ep${ngpu}_${prec}.json" 2>&1 \
                 | tee "$OUT/bench_layer_ep${ngpu}_${prec}.log" | grep -v "^$" | tail -40
            done
            (cd tests && timeout 200 python3 -m pytest -q -ra -p no:cacheprovider test_mega_peer_ep.py -k nvlink 2>&1 \
               | tee "$OUT/tests_peer_multi_gpu.log" | tail -6)
            timeout 240 python3 -m torch.distributed.run --nproc-per-node "$ngpu" bench/bench_peer_ep.py \
               --shapes qwen3-30b-a3b,qwen3-235b-a22b --tokens 16384 --routings uniform,zipf \
               --out "$OUT/peer_ep${ngpu}.json" 2>&1 | tee "$OUT/bench_peer_ep${ngpu}.log" | grep "peer_ep" | tail -12 ;;
    torch_gemms)  # the grouped pipeline on torch's grouped GEMM (the path for GPUs without our sm90 kernels), forced
            (cd tests && timeout 300 python3 -m pytest -q -ra -p no:cacheprovider test_grouped_torch_gemms.py \
               test_mega_bwd_matrix.py -k "torch_gemms" 2>&1 | tee "$OUT/tests_torch_gemms.log" | tail -8)
            timeout 280 python3 bench/bench_layer.py --shapes qwen3-30b-a3b,qwen3-235b-a22b --tokens 4096,16384 \
               --routings uniform --backends torch,deep_gemm_grouped,deep_gemm_torch_gemms --rounds 1 --no-plot \
               --out "$OUT/layer_torch_gemms.json" 2>&1 | tee "$OUT/bench_layer_torch_gemms.log" | grep -v "^$" \
               | tail -30
            timeout 300 python3 examples/train_parity.py --backend grouped --torch-gemms \
               --out "$OUT/train_parity_torch_gemms.json" 2>&1 | tee "$OUT/train_parity_torch_gemms.log" | tail -12 ;;
    peer)   # expert parallelism over peer memory, on the one-GPU emulator: its tests, then its cost against EP = 1
            (cd tests && timeout 300 python3 -m pytest -q -ra -p no:cacheprovider test_mega_peer_ep.py 2>&1 \
               | tee "$OUT/tests_peer_ep.log" | tail -8)
            timeout 280 python3 bench/bench_peer_ep.py --shapes qwen3-30b-a3b,qwen3-235b-a22b --tokens 4096 \
               --ranks 2,4,8 --out "$OUT/peer_ep.json" 2>&1 | tee "$OUT/bench_peer_ep.log" | tail -12 ;;
    train_step)  # whole training steps, as many Qwen3-30B-A3B layers as this card holds with every variant (the FP8
            # ones hold the weights' FP8 copies too): 18 / 12 layers with / without checkpointing on a 141 GB H200,
            # 6 / 4 on an 80 GB H100 (8 with checkpointing did not fit there). One process per family and setting,
            # so a timeout costs one file; both settings take more than one 10-minute device call at 18 layers:
            # TRAIN_STEP_CKPT="on", then "off".
            mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
            l_on=6; l_off=4; [ "$mem" -gt 120000 ] && { l_on=18; l_off=12; }
            variants=grouped_mm,prime_mega_moe,prime_mega_moe_fp8,prime_mega_moe_fp8_bwd,sonicmoe,torchtitan_grouped_mm
            for ck in ${TRAIN_STEP_CKPT:-on off}; do
              layers=$l_on; [ "$ck" = off ] && layers=$l_off
              for fam in torchtitan transformers; do
                name="train_step_l${layers}_ckpt_${ck}_${fam}"
                timeout 280 python3 bench/train_step.py --model "$fam" --layers "$layers" --checkpointing "$ck" \
                   --variants "${TRAIN_STEP_VARIANTS:-$variants}" \
                   --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | grep -v "^$" | tail -10
              done
            done ;;
    shared) timeout 300 python3 bench/bench_shared.py --out "$OUT/shared.json" 2>&1 | tee "$OUT/bench_shared.log" \
               | grep -v "^$" | tail -16 ;;
    quantize) timeout 120 python3 bench/bench_quantize_fp8.py --tokens 16384 --out "$OUT/quantize_fp8.json" 2>&1 \
               | tee "$OUT/bench_quantize_fp8.log" | tail -12 ;;
    *) echo "unknown step $step: choose from tests fp8_tests fused_bwd bwd_lags gemm layer fp8 floor parity staged" \
            "quantize ep multi torch_gemms peer train_step shared"; exit 2 ;;
  esac
done
ls "$OUT"
