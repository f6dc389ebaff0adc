#!/usr/bin/env bash
# One device call on the lent H200: install the carried wheel, run the whole test suite (GPU tests
# included), then the GEMM-core and layer benchmarks. Results and logs go to $OUT.
# usage (device tool, carry .devbuild/wheels and .whl): bash bench/run_h200.sh [tests|gemm|layer|parity]...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/pk_out}"; mkdir -p "$OUT"
# .whl/ (ci/device_wheels.sh, carried) holds the integration tests' packages; without it they skip.
python3 -m pip install -q --no-deps --no-index --target /tmp/site .devbuild/wheels/prime_kernels-*.whl \
  $(ls .whl/*.whl 2>/dev/null) || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PRIME_KERNELS_TEST_PYPI_NVCC=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw --format=csv,noheader
steps="${*:-tests gemm layer}"
for step in $steps; do
  case "$step" in
    tests) (cd tests && timeout 360 python3 -m pytest -q -ra -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -25) ;;
    gemm)  timeout 300 python3 bench/bench_gemm.py --out "$OUT" 2>&1 | tee "$OUT/bench_gemm.log" | grep -v "^$" ;;
    layer) timeout 400 python3 bench/bench_layer.py --out "$OUT/layer.json" ${LAYER_ARGS:-} 2>&1 | tee "$OUT/bench_layer.log" | tail -40 ;;
    parity) timeout 500 python3 bench/train_parity.py --out "$OUT/train_parity.json" ${PARITY_ARGS:-} 2>&1 | tee "$OUT/train_parity.log" | tail -30 ;;
  esac
done
ls "$OUT"
