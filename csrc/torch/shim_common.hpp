// What the shim's translation units share (csrc/torch/shim.cpp, quantize_ops.cpp): the stable-ABI types, the
// core's error as a Python RuntimeError, the current CUDA stream, and output allocation.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cstdint>
#include <vector>

namespace prime_kernels::torch_shim {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// Raises the core's message as a Python RuntimeError unless rc is PK_OK.
void check_core(int rc, const char* op);
// The current CUDA stream of the device, from libtorch_cuda (looked up when a CUDA op first runs, so that a
// CPU-only torch can load the shim).
void* current_cuda_stream(int32_t device_index);
// An uninitialised tensor on like's device.
Tensor new_tensor(const Tensor& like, std::vector<int64_t> sizes, ScalarType dtype);

}  // namespace prime_kernels::torch_shim
