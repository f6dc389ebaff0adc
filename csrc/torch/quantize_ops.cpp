// torch.ops.prime_kernels.dispatch_rows_fp8_, quantize_tokens_fp8_, quantize_tokens_gathered_fp8_ (the same qT,
// reading each pool row from its token row) and quantize_tokens_e4m3_fp8_ (the same qT of e4m3 pool rows with their
// 1 x 128 scales, read as their bf16 dequantization), the blockwise-FP8 recipe's quantizing producers, and
// quantize_mxfp8_ (e4m3 values with one e8m0 scale per 32 along a row), quantize_weight_fp8_ (a layer's weights
// in 128 x 128 tiles) and transpose_tiles_fp8_ (their transposed copy); CPU: the core's host loops, the same bits as
// the kernels. All write into the tensors they are given; the core checks sizes, strides, alignment and, on the CPU,
// the values it reads.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <cstdint>

#include "api/prime_kernels_api.h"
#include "torch/shim_common.hpp"

namespace {

using namespace prime_kernels::torch_shim;

struct DispatchFp8Input {
  int64_t num_tokens, top_k, hidden, num_rows, ld_sa;
};

DispatchFp8Input check_dispatch_fp8_input(const Tensor& src, const Tensor& route_to_pool, const Tensor& q,
                                          const Tensor& sa) {
  const char* op = "dispatch_rows_fp8_";
  STD_TORCH_CHECK(src.scalar_type() == ScalarType::BFloat16 && src.dim() == 2 && src.stride(1) == 1, "prime_kernels.",
                  op, ": src must be a bfloat16 [T, H] tensor with unit column stride");
  const int64_t hidden = src.size(1);
  STD_TORCH_CHECK(hidden % 64 == 0, "prime_kernels.", op, ": H (src's columns, ", hidden,
                  ") must be a multiple of 64 (one fp32 scale per 1 x 128 block, the last block 64 wide when H is 64 "
                  "mod 128)");
  STD_TORCH_CHECK(route_to_pool.scalar_type() == ScalarType::Int && route_to_pool.dim() == 2 &&
                      route_to_pool.is_contiguous() && route_to_pool.size(0) == src.size(0),
                  "prime_kernels.", op, ": route_to_pool must be a contiguous int32 [T, K] tensor with src's T rows");
  STD_TORCH_CHECK(q.scalar_type() == ScalarType::Float8_e4m3fn && q.dim() == 2 && q.size(1) == hidden &&
                      (q.stride(1) == 1 || hidden <= 1),
                  "prime_kernels.", op, ": q must be a float8_e4m3fn [rows, H] tensor with unit column stride");
  check_same_device(route_to_pool, src, op, "route_to_pool");
  check_same_device(q, src, op, "q");
  check_same_device(sa, src, op, "sa");
  const int64_t rows = q.size(0);
  const int64_t ld_sa = block_major_ld(sa, rows, (hidden + 127) / 128, op, "sa", "[rows, ceil(H / 128)]");
  return DispatchFp8Input{src.size(0), route_to_pool.size(1), hidden, rows, ld_sa};
}

void dispatch_rows_fp8_cpu(Tensor src, Tensor route_to_pool, Tensor q, Tensor sa, bool pow2_scales) {
  const DispatchFp8Input in = check_dispatch_fp8_input(src, route_to_pool, q, sa);
  check_core(pk_dispatch_rows_fp8_cpu(src.data_ptr(), src.stride(0),
                                      static_cast<const int32_t*>(route_to_pool.data_ptr()), in.num_tokens, in.top_k,
                                      in.hidden, q.data_ptr(), row_stride_bytes(q, in.hidden),
                                      static_cast<float*>(sa.data_ptr()), in.ld_sa, in.num_rows, pow2_scales ? 1 : 0),
             "dispatch_rows_fp8_");
}

void dispatch_rows_fp8_cuda(Tensor src, Tensor route_to_pool, Tensor q, Tensor sa, bool pow2_scales) {
  const DispatchFp8Input in = check_dispatch_fp8_input(src, route_to_pool, q, sa);
  torch::stable::accelerator::DeviceGuard guard(src.get_device_index());
  check_core(pk_dispatch_rows_fp8_cuda(src.data_ptr(), src.stride(0),
                                       static_cast<const int32_t*>(route_to_pool.data_ptr()), in.num_tokens,
                                       in.top_k, in.hidden, q.data_ptr(), row_stride_bytes(q, in.hidden),
                                       static_cast<float*>(sa.data_ptr()), in.ld_sa, in.num_rows,
                                       pow2_scales ? 1 : 0, current_cuda_stream(src.get_device_index())),
             "dispatch_rows_fp8_");
}

struct TokensFp8Input {
  int64_t rows, cols, ld_q, ld_scale;
  int32_t num_experts;
};

// rows: the pool's rows (v's, or pool_src_route's when gathering from token rows v).
TokensFp8Input check_tokens_fp8_input(const char* op, const Tensor& v, bool v_e4m3, int64_t rows,
                                      const Tensor& offsets, const Tensor& counts, const Tensor& q,
                                      const Tensor& scale) {
  STD_TORCH_CHECK(v.scalar_type() == (v_e4m3 ? ScalarType::Float8_e4m3fn : ScalarType::BFloat16) && v.dim() == 2 &&
                      (v.stride(1) == 1 || v.size(1) <= 1),
                  "prime_kernels.", op, ": v must be a ", v_e4m3 ? "float8_e4m3fn" : "bfloat16",
                  " 2-D tensor with unit column stride");
  const int64_t cols = v.size(1);
  STD_TORCH_CHECK(offsets.scalar_type() == ScalarType::Int && offsets.dim() == 1 && offsets.is_contiguous() &&
                      offsets.size(0) >= 2,
                  "prime_kernels.", op, ": expert_offsets must be a contiguous 1-D int32 tensor [E + 1], E >= 1");
  const int64_t experts = offsets.size(0) - 1;
  STD_TORCH_CHECK(counts.scalar_type() == ScalarType::Int && counts.dim() == 1 && counts.is_contiguous() &&
                      counts.size(0) == experts,
                  "prime_kernels.", op, ": expert_counts must be a contiguous 1-D int32 tensor [E] (E = ", experts,
                  ")");
  STD_TORCH_CHECK(experts <= 1024, "prime_kernels.", op, ": at most 1024 experts, got ", experts);
  STD_TORCH_CHECK(q.scalar_type() == ScalarType::Float8_e4m3fn && q.dim() == 2 && q.size(0) == cols &&
                      q.size(1) == rows && (q.stride(1) == 1 || rows <= 1),
                  "prime_kernels.", op, ": q must be a float8_e4m3fn [C, P] = [", cols, ", ", rows,
                  "] tensor with unit stride along P");
  check_same_device(offsets, v, op, "expert_offsets");
  check_same_device(counts, v, op, "expert_counts");
  check_same_device(q, v, op, "q");
  check_same_device(scale, v, op, "scale");
  const int64_t ld_scale = block_major_ld(scale, cols, (rows + 127) / 128, op, "scale", "[C, ceil(P / 128)]");
  return TokensFp8Input{rows, cols, row_stride_bytes(q, rows), ld_scale, static_cast<int32_t>(experts)};
}

// The scale of v's row r and block j at v_scale[r * row + j * block] (null: v is bf16).
struct RowScales {
  const float* data = nullptr;
  int64_t row = 0, block = 0;
};

// One entry for every op and device: src_route null (v is the pool) or the gathering op's pool_src_route; v_scale
// for e4m3 rows.
void run_quantize_tokens_fp8(bool on_cuda, const char* op, const Tensor& v, const int32_t* src_route, int64_t rows,
                             int64_t top_k, const Tensor& expert_offsets, const Tensor& expert_counts, const Tensor& q,
                             const Tensor& scale, bool pow2_scales, RowScales v_scale = {}) {
  const TokensFp8Input in = check_tokens_fp8_input(op, v, v_scale.data != nullptr, rows, expert_offsets,
                                                   expert_counts, q, scale);
  const auto* offs = static_cast<const int32_t*>(expert_offsets.data_ptr());
  const auto* cnts = static_cast<const int32_t*>(expert_counts.data_ptr());
  const int64_t num_tokens = src_route != nullptr ? v.size(0) : 0;
  if (!on_cuda) {
    check_core(pk_quantize_tokens_fp8_cpu(v.data_ptr(), v.stride(0), in.rows, in.cols, offs, cnts, in.num_experts,
                                          q.data_ptr(), in.ld_q, static_cast<float*>(scale.data_ptr()), in.ld_scale,
                                          pow2_scales ? 1 : 0, src_route, num_tokens, top_k, v_scale.data,
                                          v_scale.row, v_scale.block),
               op);
    return;
  }
  torch::stable::accelerator::DeviceGuard guard(v.get_device_index());
  check_core(pk_quantize_tokens_fp8_cuda(v.data_ptr(), v.stride(0), in.rows, in.cols, offs, cnts, in.num_experts,
                                         q.data_ptr(), in.ld_q, static_cast<float*>(scale.data_ptr()), in.ld_scale,
                                         pow2_scales ? 1 : 0, src_route, num_tokens, top_k, v_scale.data,
                                         v_scale.row, v_scale.block, current_cuda_stream(v.get_device_index())),
             op);
}

template <bool kOnCuda>
void quantize_tokens_fp8_op(Tensor v, Tensor expert_offsets, Tensor expert_counts, Tensor q, Tensor scale,
                            bool pow2_scales) {
  run_quantize_tokens_fp8(kOnCuda, "quantize_tokens_fp8_", v, nullptr, v.size(0), 1, expert_offsets, expert_counts, q,
                          scale, pow2_scales);
}

template <bool kOnCuda>
void quantize_tokens_gathered_fp8_op(Tensor src, Tensor pool_src_route, int64_t top_k, Tensor expert_offsets,
                                     Tensor expert_counts, Tensor q, Tensor scale, bool pow2_scales) {
  const char* op = "quantize_tokens_gathered_fp8_";
  STD_TORCH_CHECK(pool_src_route.scalar_type() == ScalarType::Int && pool_src_route.dim() == 1 &&
                      pool_src_route.is_contiguous(),
                  "prime_kernels.", op, ": pool_src_route must be a contiguous 1-D int32 tensor [P]");
  STD_TORCH_CHECK(top_k >= 1, "prime_kernels.", op, ": top_k = ", top_k, ", must be >= 1");
  check_same_device(pool_src_route, src, op, "pool_src_route");
  run_quantize_tokens_fp8(kOnCuda, op, src, static_cast<const int32_t*>(pool_src_route.data_ptr()),
                          pool_src_route.size(0), top_k, expert_offsets, expert_counts, q, scale, pow2_scales);
}

template <bool kOnCuda>
void quantize_tokens_e4m3_fp8_op(Tensor v, Tensor v_scale, Tensor expert_offsets, Tensor expert_counts, Tensor q,
                                 Tensor scale, bool pow2_scales) {
  const char* op = "quantize_tokens_e4m3_fp8_";
  STD_TORCH_CHECK(v.dim() == 2 && v.size(1) % 128 == 0, "prime_kernels.", op,
                  ": v must be [P, C] with C a multiple of 128 (its 1 x 128 scale blocks)");
  STD_TORCH_CHECK(v_scale.scalar_type() == ScalarType::Float && v_scale.dim() == 2 && v_scale.size(0) == v.size(0) &&
                      v_scale.size(1) == v.size(1) / 128,
                  "prime_kernels.", op, ": v_scale must be a float32 [P, C / 128] tensor");
  check_same_device(v_scale, v, op, "v_scale");
  run_quantize_tokens_fp8(kOnCuda, op, v, nullptr, v.size(0), 1, expert_offsets, expert_counts, q, scale, pow2_scales,
                          RowScales{static_cast<const float*>(v_scale.data_ptr()), v_scale.stride(0),
                                    v_scale.stride(1)});
}

// x [rows, cols] bf16 or fp32, any strides, blocked along cols; q e4m3 of x's shape, any strides; scale the bytes of
// the e8m0 scales, contiguous: [rows, cols / 32] when plain, any shape holding enough bytes when blocked. group_axis 1 or 2:
// group_ends int32 [G] (the groups' ends) and group_starts int32 [G] (a workspace the call fills), both contiguous on
// x's device; group_axis 0 ignores them.
template <bool kOnCuda>
void quantize_mxfp8_op(Tensor x, Tensor q, Tensor scale, Tensor group_ends, Tensor group_starts, int64_t group_axis,
                       bool blocked, bool rceil) {
  const char* op = "quantize_mxfp8_";
  STD_TORCH_CHECK((x.scalar_type() == ScalarType::BFloat16 || x.scalar_type() == ScalarType::Float) && x.dim() == 2,
                  "prime_kernels.", op, ": x must be a bfloat16 or float32 2-D tensor (blocked along its dim 1)");
  const int64_t rows = x.size(0), cols = x.size(1);
  STD_TORCH_CHECK(cols % 32 == 0, "prime_kernels.", op, ": x.size(1) = ", cols,
                  " must be a multiple of 32 (one scale per 32 elements)");
  STD_TORCH_CHECK(q.scalar_type() == ScalarType::Float8_e4m3fn && q.dim() == 2 && q.size(0) == rows &&
                      q.size(1) == cols,
                  "prime_kernels.", op, ": q must be a float8_e4m3fn tensor of x's shape [", rows, ", ", cols, "]");
  // uint8: the stable ABI of torch 2.10 does not carry float8_e8m0fnu tensors (the Python side passes a byte view)
  STD_TORCH_CHECK(scale.scalar_type() == ScalarType::Byte && scale.is_contiguous(), "prime_kernels.", op,
                  ": scale must be a contiguous uint8 tensor (the bytes of float8_e8m0fnu scales)");
  if (!blocked)
    STD_TORCH_CHECK(scale.dim() == 2 && scale.size(0) == rows && scale.size(1) == cols / 32, "prime_kernels.", op,
                    ": plain scales must be [rows, cols / 32] = [", rows, ", ", cols / 32, "]");
  STD_TORCH_CHECK(group_axis >= 0 && group_axis <= 2, "prime_kernels.", op,
                  ": group_axis must be 0 (none), 1 (row groups) or 2 (column groups), got ", group_axis);
  STD_TORCH_CHECK(group_axis == 0 || blocked, "prime_kernels.", op, ": groups need the blocked scale layout");
  check_same_device(q, x, op, "q");
  check_same_device(scale, x, op, "scale");
  int64_t num_groups = 0;
  const int32_t* ends = nullptr;
  int32_t* starts = nullptr;
  if (group_axis != 0) {
    check_int32_vector(group_ends, x, op, "group_ends");
    check_int32_vector(group_starts, x, op, "group_starts");
    num_groups = group_ends.size(0);
    STD_TORCH_CHECK(num_groups >= 1 && num_groups <= INT32_MAX && group_starts.size(0) == num_groups,
                    "prime_kernels.", op, ": group_ends must hold at least one group and group_starts as many "
                    "entries, got ", num_groups, " and ", group_starts.size(0));
    ends = static_cast<const int32_t*>(group_ends.data_ptr());
    starts = static_cast<int32_t*>(group_starts.data_ptr());
  }
  const int64_t scale_bytes = scale.numel();
  const int64_t scale_ld = blocked ? 0 : (rows <= 1 ? cols / 32 : scale.stride(0));
  const int x_fp32 = x.scalar_type() == ScalarType::Float ? 1 : 0;
  if (!kOnCuda) {
    check_core(pk_quantize_mxfp8_cpu(x.data_ptr(), x_fp32, rows, cols, x.stride(0), x.stride(1), q.data_ptr(),
                                     q.stride(0), q.stride(1), scale.data_ptr(), scale_bytes, blocked ? 1 : 0, scale_ld,
                                     static_cast<int>(group_axis), ends, starts, static_cast<int32_t>(num_groups),
                                     rceil ? 1 : 0),
               op);
    return;
  }
  torch::stable::accelerator::DeviceGuard guard(x.get_device_index());
  check_core(pk_quantize_mxfp8_cuda(x.data_ptr(), x_fp32, rows, cols, x.stride(0), x.stride(1), q.data_ptr(),
                                    q.stride(0), q.stride(1), scale.data_ptr(), scale_bytes, blocked ? 1 : 0, scale_ld,
                                    static_cast<int>(group_axis), ends, starts, static_cast<int32_t>(num_groups),
                                    rceil ? 1 : 0, current_cuda_stream(x.get_device_index())),
             op);
}

// A layer's weights in 128 x 128 tiles: w bf16 [L, R, C] -> q e4m3 [L, R, C], scale fp32 [L, R/128, C/128]; every
// tensor contiguous, on w's device.
template <bool kCuda>
void quantize_weight_fp8_op(Tensor w, Tensor q, Tensor scale, bool pow2_scales) {
  const char* op = "quantize_weight_fp8_";
  STD_TORCH_CHECK(w.scalar_type() == ScalarType::BFloat16 && w.dim() == 3 && w.is_contiguous(), "prime_kernels.", op,
                  ": w must be a contiguous bfloat16 [L, R, C] tensor");
  const int64_t L = w.size(0), R = w.size(1), C = w.size(2);
  STD_TORCH_CHECK(q.scalar_type() == ScalarType::Float8_e4m3fn && q.dim() == 3 && q.is_contiguous() &&
                      q.size(0) == L && q.size(1) == R && q.size(2) == C,
                  "prime_kernels.", op, ": q must be a contiguous float8_e4m3fn tensor shaped as w");
  STD_TORCH_CHECK(scale.scalar_type() == ScalarType::Float && scale.dim() == 3 && scale.is_contiguous() &&
                      scale.size(0) == L && scale.size(1) == R / 128 && scale.size(2) == C / 128,
                  "prime_kernels.", op, ": scale must be a contiguous float32 [L, R / 128, C / 128] tensor");
  check_same_device(q, w, op, "q");
  check_same_device(scale, w, op, "scale");
  if constexpr (kCuda) {
    torch::stable::accelerator::DeviceGuard guard(w.get_device_index());
    check_core(pk_quantize_weight_fp8_cuda(w.data_ptr(), L, R, C, q.data_ptr(), static_cast<float*>(scale.data_ptr()),
                                           pow2_scales ? 1 : 0,
                                           current_cuda_stream(w.get_device_index())),
               op);
  } else {
    check_core(pk_quantize_weight_fp8_cpu(w.data_ptr(), L, R, C, q.data_ptr(), static_cast<float*>(scale.data_ptr()),
                                          pow2_scales ? 1 : 0),
               op);
  }
}

// The transposed copy of a weight's e4m3 tiles: q [L, R, C] -> qt [L, C, R], both contiguous, on q's device.
template <bool kCuda>
void transpose_tiles_fp8_op(Tensor q, Tensor qt) {
  const char* op = "transpose_tiles_fp8_";
  STD_TORCH_CHECK(q.scalar_type() == ScalarType::Float8_e4m3fn && q.dim() == 3 && q.is_contiguous(), "prime_kernels.",
                  op, ": q must be a contiguous float8_e4m3fn [L, R, C] tensor");
  const int64_t L = q.size(0), R = q.size(1), C = q.size(2);
  STD_TORCH_CHECK(qt.scalar_type() == ScalarType::Float8_e4m3fn && qt.dim() == 3 && qt.is_contiguous() &&
                      qt.size(0) == L && qt.size(1) == C && qt.size(2) == R,
                  "prime_kernels.", op, ": qt must be a contiguous float8_e4m3fn [L, C, R] tensor");
  check_same_device(qt, q, op, "qt");
  if constexpr (kCuda) {
    torch::stable::accelerator::DeviceGuard guard(q.get_device_index());
    check_core(pk_transpose_tiles_fp8_cuda(q.data_ptr(), L, R, C, qt.data_ptr(), current_cuda_stream(q.get_device_index())),
               op);
  } else {
    check_core(pk_transpose_tiles_fp8_cpu(q.data_ptr(), L, R, C, qt.data_ptr()), op);
  }
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(prime_kernels, m) {
  m.def("dispatch_rows_fp8_(Tensor src, Tensor route_to_pool, Tensor(a!) q, Tensor(b!) sa, bool pow2_scales=False) -> ()");
  m.def("quantize_tokens_fp8_(Tensor v, Tensor expert_offsets, Tensor expert_counts, Tensor(a!) q, Tensor(b!) scale, "
        "bool pow2_scales=False) -> ()");
  m.def("quantize_tokens_gathered_fp8_(Tensor src, Tensor pool_src_route, int top_k, Tensor expert_offsets, "
        "Tensor expert_counts, Tensor(a!) q, Tensor(b!) scale, bool pow2_scales=False) -> ()");
  m.def("quantize_tokens_e4m3_fp8_(Tensor v, Tensor v_scale, Tensor expert_offsets, Tensor expert_counts, "
        "Tensor(a!) q, Tensor(b!) scale, bool pow2_scales=False) -> ()");
  m.def("quantize_mxfp8_(Tensor x, Tensor(a!) q, Tensor(b!) scale, Tensor group_ends, Tensor(c!) group_starts, "
        "int group_axis=0, bool blocked=True, bool rceil=True) -> ()");
  m.def("quantize_weight_fp8_(Tensor w, Tensor(a!) q, Tensor(b!) scale, bool pow2_scales=False) -> ()");
  m.def("transpose_tiles_fp8_(Tensor q, Tensor(a!) qt) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(prime_kernels, CPU, m) {
  m.impl("dispatch_rows_fp8_", TORCH_BOX(&dispatch_rows_fp8_cpu));
  m.impl("quantize_tokens_fp8_", TORCH_BOX(&quantize_tokens_fp8_op<false>));
  m.impl("quantize_tokens_gathered_fp8_", TORCH_BOX(&quantize_tokens_gathered_fp8_op<false>));
  m.impl("quantize_tokens_e4m3_fp8_", TORCH_BOX(&quantize_tokens_e4m3_fp8_op<false>));
  m.impl("quantize_mxfp8_", TORCH_BOX(&quantize_mxfp8_op<false>));
  m.impl("quantize_weight_fp8_", TORCH_BOX(&quantize_weight_fp8_op<false>));
  m.impl("transpose_tiles_fp8_", TORCH_BOX(&transpose_tiles_fp8_op<false>));
}

STABLE_TORCH_LIBRARY_IMPL(prime_kernels, CUDA, m) {
  m.impl("dispatch_rows_fp8_", TORCH_BOX(&dispatch_rows_fp8_cuda));
  m.impl("quantize_tokens_fp8_", TORCH_BOX(&quantize_tokens_fp8_op<true>));
  m.impl("quantize_tokens_gathered_fp8_", TORCH_BOX(&quantize_tokens_gathered_fp8_op<true>));
  m.impl("quantize_tokens_e4m3_fp8_", TORCH_BOX(&quantize_tokens_e4m3_fp8_op<true>));
  m.impl("quantize_mxfp8_", TORCH_BOX(&quantize_mxfp8_op<true>));
  m.impl("quantize_weight_fp8_", TORCH_BOX(&quantize_weight_fp8_op<true>));
  m.impl("transpose_tiles_fp8_", TORCH_BOX(&transpose_tiles_fp8_op<true>));
}
