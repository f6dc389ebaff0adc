#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored through .git/info/exclude), the wheels the GPU machine lacks for
# the integration tests (it has no network): the same pins as ci/test.sh, for CPython 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
  "transformers==5.24.0" "spmd_types==0.2.3" "tyro==1.0.17" "torchtitan==0.3.0" docstring-parser typeguard \
  "torchao==0.17.0"  # TorchTitan's own FP8 experts in bench/train_step.py (the release beside the machine's torch 2.11)
ls -l .whl
