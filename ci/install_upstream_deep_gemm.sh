#!/usr/bin/env bash
# Installs upstream DeepGEMM as PyPI has it (deep-gemm==1.0.0, an sdist of pure Python plus a JIT that
# compiles on first use) into the environment of PYTHON (default python3), for the test that runs it
# beside prime_kernels. The sdist's sha256 is checked against third_party/PROVENANCE.md.
# The published sdist does not build as it is: its setup.py copies third-party/cutlass/include/{cute,cutlass}
# into the package, and the sdist lacks that folder. Those headers are read only by upstream's JIT when
# it compiles a kernel on a GPU, so empty folders stand in for them; nothing else is changed.
set -euo pipefail
CI="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: -c "$CI/constraints.txt" \
  -d "$work" deep-gemm
sdist=$(ls "$work"/deep_gemm-*.tar.gz)
bash "$CI/check_provenance.sh" "$sdist" >/dev/null
tar -xzf "$sdist" -C "$work"
src=$(ls -d "$work"/deep_gemm-*/)
mkdir -p "$src/third-party/cutlass/include/cute" "$src/third-party/cutlass/include/cutlass"
"$PY" -m pip install --quiet --disable-pip-version-check -c "$CI/constraints.txt" setuptools
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation "$src"
