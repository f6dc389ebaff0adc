// What the shim's translation units share (csrc/torch/shim.cpp and the *_ops.cpp files): the stable-ABI types, the
// core's error as a Python RuntimeError, the current CUDA stream, output allocation and the grouped ops' checks.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cstdint>
#include <optional>
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

// The grouped ops' operand checks (shim.cpp): a bf16 CUDA tensor of `dim` dims with unit stride in its last dim; the
// groups' int32 offsets on like's device (returns num_groups); num_sms (0 = every SM).
void check_bf16_cuda(const Tensor& t, const char* op, const char* name, int64_t dim);
int32_t check_offsets(const Tensor& offsets, const Tensor& like, const char* op);
int check_num_sms(int64_t num_sms, const char* op);

// The L2 dgrad's operands, checked (m_grouped_bf16_gemm_swiglu_bwd and mega_moe_bwd_fused), and its outputs
// allocated: dh [M, 2I], aw = w * s [M, I], dt_part [M, ceil(I/128)] (M = dy_pool's rows) with dt_part zeroed: the
// kernels write the rows of the groups only, and the rows after the last group must be zeros, so that a sum over
// every row (the grouped backward's d topk_weights) reads nothing uninitialised.
struct SwigluBwdOperands {
  int32_t num_groups;
  int64_t m_total, hidden, inter, n_blocks;
  Tensor dh, aw, dt_part;
};
SwigluBwdOperands swiglu_bwd_operands(const Tensor& dy_pool, const Tensor& w2, const Tensor& group_offsets,
                                      const Tensor& h, const Tensor& pool_src_route, const Tensor& topk_weights,
                                      const char* op);

// The rows an L1 with the SwiGLU epilogue reads: a_row_index's (checked: contiguous CUDA int32 [>= m_total]) or,
// without one, a's first m_total rows. Returns the index pointer (null without one).
inline const int32_t* gather_index(const std::optional<Tensor>& a_row_index, const Tensor& a, int64_t m_total,
                                   const char* op) {
  if (!a_row_index.has_value()) {
    STD_TORCH_CHECK(m_total <= a.size(0), "prime_kernels.", op, ": m_total exceeds a's rows");
    return nullptr;
  }
  const Tensor& t = *a_row_index;
  STD_TORCH_CHECK(t.scalar_type() == ScalarType::Int && t.dim() == 1 && t.is_contiguous() && t.size(0) >= m_total &&
                      t.is_cuda(),
                  "prime_kernels.", op, ": a_row_index must be a contiguous CUDA int32 [>= m_total] tensor");
  return static_cast<const int32_t*>(t.data_ptr());
}

// The shim's FP8 operand checks (quantize_ops.cpp, swiglu_bwd_fp8_ops.cpp, swiglu_fwd_fp8_ops.cpp).
inline void check_same_device(const Tensor& t, const Tensor& like, const char* op, const char* name) {
  STD_TORCH_CHECK(t.is_cuda() == like.is_cuda() && t.get_device_index() == like.get_device_index(), "prime_kernels.",
                  op, ": ", name, " must be on the input's device");
}

// A contiguous int32 vector on like's device (a plan's per-row or per-group indices).
inline void check_int32_vector(const Tensor& t, const Tensor& like, const char* op, const char* name) {
  STD_TORCH_CHECK(t.scalar_type() == ScalarType::Int && t.dim() == 1 && t.is_contiguous(), "prime_kernels.", op, ": ",
                  name, " must be a contiguous int32 vector");
  check_same_device(t, like, op, name);
}

// A scale tensor [outer, blocks] laid out K-block major (stride(0) == 1, stride(1) the core's ld): its ld. With one
// block the stride between blocks is never used (torch may report any value for it).
inline int64_t block_major_ld(const Tensor& s, int64_t outer, int64_t blocks, const char* op, const char* name,
                              const char* shape) {
  STD_TORCH_CHECK(s.scalar_type() == ScalarType::Float && s.dim() == 2 && s.size(0) == outer && s.size(1) == blocks,
                  "prime_kernels.", op, ": ", name, " must be a float32 tensor ", shape, " = [", outer, ", ", blocks,
                  "]");
  STD_TORCH_CHECK(outer <= 1 || blocks == 0 || s.stride(0) == 1, "prime_kernels.", op, ": ", name,
                  " must be K-block major (stride(0) == 1, e.g. the transpose of a contiguous [blocks, R] tensor "
                  "with R a multiple of 4), got strides (", s.stride(0), ", ", s.stride(1), ")");
  return blocks <= 1 ? (outer + 3) / 4 * 4 : s.stride(1);
}

// An e4m3 [rows, cols] operand with unit column stride, on like's device.
inline void check_e4m3(const Tensor& t, const Tensor& like, const char* op, const char* name, int64_t rows,
                       int64_t cols) {
  STD_TORCH_CHECK(t.scalar_type() == ScalarType::Float8_e4m3fn && t.dim() == 2 && t.size(0) == rows &&
                      t.size(1) == cols && (t.stride(1) == 1 || cols <= 1),
                  "prime_kernels.", op, ": ", name, " must be a float8_e4m3fn [", rows, ", ", cols,
                  "] tensor with unit column stride");
  check_same_device(t, like, op, name);
}

// q's row stride: with one row, or empty rows, it is never used (any value torch reports is replaced by the
// smallest valid one).
inline int64_t row_stride_bytes(const Tensor& q, int64_t row_bytes) {
  return q.size(0) <= 1 || row_bytes == 0 ? (row_bytes + 15) / 16 * 16 : q.stride(0);
}

}  // namespace prime_kernels::torch_shim
