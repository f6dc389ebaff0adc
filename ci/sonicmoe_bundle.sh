#!/usr/bin/env bash
# Packs SonicMoE (PyPI sonic-moe, the open fused MoE training kernels bench_layer.py times as a peer) and the
# dependencies that torch does not bring, for a machine without network (the lent GPU machine): downloads the
# pinned CPython 3.12 wheels, unpacks them into one tree, and writes it as one xz tarball, small enough for one
# device call's working tree (the cutlass-dsl libs wheel alone is over that limit unpacked-or-not).
# On the GPU machine: mkdir -p /tmp/sonic && tar xJf OUT -C /tmp/sonic, then put /tmp/sonic and
# /tmp/sonic/nvidia_cutlass_dsl/python_packages (where the cutlass-dsl wheel's .pth file points, which an unpacked
# tree does not process) on PYTHONPATH after the build under test. The versions are the newest set that resolves together: sonic-moe 0.1.2.post1 pins
# nvidia-cutlass-dsl 4.4.2, which quack-kernels newer than 0.3.11 do not accept. sonic-moe declares
# torch <= 2.9.1; it is installed without dependencies, so whether it runs under the machine's torch is
# what the benchmark finds out (bench_layer.py reports an import or call failure as skipped rows).
# usage: ci/sonicmoe_bundle.sh [OUT]   (default .whl/sonicmoe_tree.tar.xz)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.whl/sonicmoe_tree.tar.xz}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$work/wheels" \
  "sonic-moe==0.1.2.post1" "quack-kernels==0.3.11" "nvidia-cutlass-dsl==4.4.2" \
  "nvidia-cutlass-dsl-libs-base==4.4.2" "apache-tvm-ffi==0.1.15.post2" "torch-c-dlpack-ext==0.1.5"
mkdir -p "$work/tree"
for w in "$work"/wheels/*.whl; do python3 -m zipfile -e "$w" "$work/tree"; done
mkdir -p "$(dirname "$out")"
tar -C "$work/tree" -cJf "$out" .
ls -l "$out"
