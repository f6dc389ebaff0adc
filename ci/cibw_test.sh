#!/usr/bin/env bash
# cibuildwheel's test-command. It runs in a fresh virtualenv that holds only the repaired
# prime-kernels-core wheel (with its torch dependency) and test-requires, in a copy of test-sources
# ([tool.cibuildwheel] in pyproject.toml). Adds the prime-kernels drop-in (the wheel ci/release_build.sh
# built into dropin-dist/, else one built here from dropin/), then runs the CPU test suite; GPU tests skip
# with their reason.
set -euo pipefail
if ls dropin-dist/prime_kernels-*.whl >/dev/null 2>&1; then
  python -m pip install --quiet --no-deps dropin-dist/prime_kernels-*.whl
else
  PIP_CONSTRAINT="$(pwd)/ci/constraints.txt" python -m pip install --quiet --no-deps ./dropin
fi
python -c "import prime_kernels, deep_gemm; print('testing', prime_kernels.__file__, prime_kernels.build_info())"
cd tests
# The build tests that download the CUDA compiler are the sdist's and .ci/run's job, not this one's.
PRIME_KERNELS_TEST_PYPI_NVCC=0 python -m pytest -q -ra -p no:cacheprovider
