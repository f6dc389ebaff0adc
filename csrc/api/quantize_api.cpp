// C ABI of the blockwise-FP8 quantizing producers (dispatch_rows_fp8, quantize_tokens_fp8, quantize_weight_fp8 and its
// transposed copy, transpose_tiles_fp8) and of the MXFP8 quantization: argument checks, then the CUDA kernel or the
// host loop. Nothing is launched or written on a bad argument.
#include <cstdint>

#include "api/prime_kernels_api.h"
#include "api/errors.hpp"
#include "common/combine.hpp"
#include "common/quantize_fp8.hpp"
#include "common/quantize_mxfp8.hpp"

namespace {

using prime_kernels::common::DispatchRowsFp8Args;
using prime_kernels::common::QuantizeTokensFp8Args;
namespace qh = prime_kernels::common::quantize_host;

// One of quantize_fp8_args.hpp's checks as this ABI's status and last error.
template <typename Args>
int check_args(int (*check)(const Args&, bool, char*, size_t), const Args& a, bool on_device) {
  char message[512] = {0};
  if (check(a, on_device, message, sizeof(message)) == 0) return PK_OK;
  return prime_kernels::api::fail(PK_ERR_INVALID_ARGUMENT, "%s", message);
}

// The CUDA entry points' sequence: what an earlier kernel found invalid (reported once, before anything is
// launched), the arguments, the device, then the launch.
template <typename Args>
int run_on_device(const char* op, int (*check)(const Args&, bool, char*, size_t),
                  cudaError_t (*launch)(const Args&, cudaStream_t), const Args& a, void* cuda_stream) {
  if (const int rc = prime_kernels::api::check_device_findings(op); rc != PK_OK) return rc;
  if (const int rc = check_args(check, a, true); rc != PK_OK) return rc;
  if (const int rc = prime_kernels::api::check_current_device(prime_kernels::api::ArchFamily::kAny); rc != PK_OK)
    return rc;
  const cudaError_t err = launch(a, static_cast<cudaStream_t>(cuda_stream));
  if (err != cudaSuccess) return prime_kernels::api::fail_cuda(err, op);
  return prime_kernels::api::ok();
}

namespace mx = prime_kernels::common;

// Every host-side rule of pk_quantize_mxfp8_*: the kernel's own checks, then the sizes and strides its indexing
// assumes (nothing it writes may fall outside what the caller described).
int check_mxfp8(const mx::QuantizeMxfp8Args& a, int x_fp32, int scale_layout, int group_axis, int32_t* starts) {
  PK_CHECK_ARG(x_fp32 == 0 || x_fp32 == 1, "quantize_mxfp8: x_fp32 must be 0 or 1, got %d", x_fp32);
  PK_CHECK_ARG(scale_layout == 0 || scale_layout == 1, "quantize_mxfp8: scale_layout must be 0 (plain) or 1 "
               "(blocked), got %d", scale_layout);
  PK_CHECK_ARG(group_axis >= 0 && group_axis <= 2, "quantize_mxfp8: group_axis must be 0 (none), 1 (rows) or 2 "
               "(columns), got %d", group_axis);
  if (const char* why = mx::check_quantize_mxfp8_args(a)) return prime_kernels::api::fail(PK_ERR_INVALID_ARGUMENT,
                                                                                           "quantize_mxfp8: %s", why);
  if (a.rows == 0 || a.cols == 0) return PK_OK;
  PK_CHECK_ARG(a.x_stride_row >= 0 && a.x_stride_col >= 0 && a.q_stride_row >= 0 && a.q_stride_col >= 0,
               "quantize_mxfp8: strides must be non-negative");
  const int64_t per_row = a.cols / mx::kMxfp8Block;
  PK_CHECK_ARG(a.scale_bytes > 0, "quantize_mxfp8: scale_bytes must be positive, got %lld",
               static_cast<long long>(a.scale_bytes));
  if (a.scale_layout == mx::Mxfp8ScaleLayout::kPlain) {
    const int64_t need = (a.rows - 1) * a.scale_ld + per_row;
    PK_CHECK_ARG(need <= a.scale_bytes, "quantize_mxfp8: plain scales [%lld, %lld] with scale_ld %lld need %lld "
                 "bytes, the buffer has %lld", static_cast<long long>(a.rows), static_cast<long long>(per_row),
                 static_cast<long long>(a.scale_ld), static_cast<long long>(need),
                 static_cast<long long>(a.scale_bytes));
  } else if (a.group_axis == mx::Mxfp8GroupAxis::kNone) {
    const int64_t need = (a.rows + 127) / 128 * 128 * ((per_row + 3) / 4 * 4);
    PK_CHECK_ARG(need <= a.scale_bytes, "quantize_mxfp8: blocked scales of [%lld, %lld] need %lld bytes, the buffer "
                 "has %lld", static_cast<long long>(a.rows), static_cast<long long>(per_row),
                 static_cast<long long>(need), static_cast<long long>(a.scale_bytes));
  } else {
    PK_CHECK_ARG(starts != nullptr, "quantize_mxfp8: groups need a group_starts workspace");
    PK_CHECK_ARG(a.rows <= INT32_MAX - 128 * static_cast<int64_t>(a.num_groups) && a.cols <= INT32_MAX,
                 "quantize_mxfp8: grouped rows and cols must stay within int32 (the group ends' type)");
  }
  return PK_OK;
}

mx::QuantizeMxfp8Args mxfp8_args(const void* x, int x_fp32, int64_t rows, int64_t cols, int64_t x_stride_row,
                                 int64_t x_stride_col, void* q, int64_t q_stride_row, int64_t q_stride_col,
                                 void* scale, int64_t scale_bytes, int scale_layout, int64_t scale_ld, int group_axis,
                                 const int32_t* group_ends, int32_t* group_starts, int32_t num_groups, int rceil) {
  mx::QuantizeMxfp8Args a;
  a.x = x;
  a.x_type = x_fp32 ? mx::Mxfp8InputType::kFp32 : mx::Mxfp8InputType::kBf16;
  a.rows = rows;
  a.cols = cols;
  a.x_stride_row = x_stride_row;
  a.x_stride_col = x_stride_col;
  a.q = static_cast<uint8_t*>(q);
  a.q_stride_row = q_stride_row;
  a.q_stride_col = q_stride_col;
  a.scale = static_cast<uint8_t*>(scale);
  a.scale_bytes = scale_bytes;
  a.scale_layout = static_cast<mx::Mxfp8ScaleLayout>(scale_layout);
  a.scale_ld = scale_ld;
  a.group_axis = static_cast<mx::Mxfp8GroupAxis>(group_axis);
  a.group_ends = group_ends;
  a.group_starts = group_starts;
  a.num_groups = num_groups;
  a.rceil = rceil != 0;
  return a;
}

}  // namespace

extern "C" {

int pk_dispatch_rows_fp8_cuda(const void* src, int64_t ld_src, const int32_t* route_to_pool, int64_t num_tokens,
                              int64_t top_k, int64_t hidden, void* q, int64_t ld_q, float* sa, int64_t ld_sa,
                              int64_t num_rows, int pow2_scales, void* cuda_stream) {
  const DispatchRowsFp8Args a{src, ld_src, route_to_pool, num_tokens, top_k, hidden, q, ld_q, sa, ld_sa, num_rows,
                              pow2_scales != 0};
  return run_on_device("dispatch_rows_fp8", qh::check_dispatch_rows_fp8_args,
                       prime_kernels::common::launch_dispatch_rows_fp8, a, cuda_stream);
}

int pk_dispatch_rows_fp8_cpu(const void* src, int64_t ld_src, const int32_t* route_to_pool, int64_t num_tokens,
                             int64_t top_k, int64_t hidden, void* q, int64_t ld_q, float* sa, int64_t ld_sa,
                             int64_t num_rows, int pow2_scales) {
  const DispatchRowsFp8Args a{src, ld_src, route_to_pool, num_tokens, top_k, hidden, q, ld_q, sa, ld_sa, num_rows,
                              pow2_scales != 0};
  if (const int rc = check_args(qh::check_dispatch_rows_fp8_args, a, false); rc != PK_OK) return rc;
  if (a.num_tokens == 0 || a.hidden == 0) return prime_kernels::api::ok();
  // the host loop runs on valid routes only (the kernel skips and notes an invalid one)
  const int64_t bad = prime_kernels::common::invalid_route(route_to_pool, num_tokens * top_k, num_rows);
  PK_CHECK_ARG(bad < 0, "dispatch_rows_fp8: route_to_pool[%lld] = %d is outside [-1, %lld) (q rows)",
               static_cast<long long>(bad), bad < 0 ? 0 : route_to_pool[bad], static_cast<long long>(num_rows));
  prime_kernels::common::dispatch_rows_fp8_host(a);
  return prime_kernels::api::ok();
}

int pk_quantize_weight_fp8_cuda(const void* w, int64_t num_mats, int64_t rows, int64_t cols, void* q, float* scale,
                                int pow2_scales, void* cuda_stream) {
  const prime_kernels::common::QuantizeWeightFp8Args a{w, num_mats, rows, cols, q, scale, pow2_scales != 0};
  return run_on_device("quantize_weight_fp8", qh::check_quantize_weight_fp8_args,
                       prime_kernels::common::launch_quantize_weight_fp8, a, cuda_stream);
}

int pk_quantize_weight_fp8_cpu(const void* w, int64_t num_mats, int64_t rows, int64_t cols, void* q, float* scale,
                               int pow2_scales) {
  const prime_kernels::common::QuantizeWeightFp8Args a{w, num_mats, rows, cols, q, scale, pow2_scales != 0};
  if (const int rc = check_args(qh::check_quantize_weight_fp8_args, a, false); rc != PK_OK) return rc;
  prime_kernels::common::quantize_weight_fp8_host(a);
  return prime_kernels::api::ok();
}

int pk_transpose_tiles_fp8_cuda(const void* q, int64_t num_mats, int64_t rows, int64_t cols, void* qt,
                                void* cuda_stream) {
  const prime_kernels::common::TransposeTilesFp8Args a{q, num_mats, rows, cols, qt};
  return run_on_device("transpose_tiles_fp8", qh::check_transpose_tiles_fp8_args,
                       prime_kernels::common::launch_transpose_tiles_fp8, a, cuda_stream);
}

int pk_transpose_tiles_fp8_cpu(const void* q, int64_t num_mats, int64_t rows, int64_t cols, void* qt) {
  const prime_kernels::common::TransposeTilesFp8Args a{q, num_mats, rows, cols, qt};
  if (const int rc = check_args(qh::check_transpose_tiles_fp8_args, a, false); rc != PK_OK) return rc;
  prime_kernels::common::transpose_tiles_fp8_host(a);
  return prime_kernels::api::ok();
}

int pk_quantize_tokens_fp8_cuda(const void* v, int64_t ld_v, int64_t rows, int64_t cols,
                                const int32_t* expert_offsets, const int32_t* expert_counts, int num_experts, void* q,
                                int64_t ld_q, float* scale, int64_t ld_scale, int pow2_scales,
                                const int32_t* src_route, int64_t num_tokens, int64_t top_k, const float* v_scale,
                                int64_t v_scale_row_stride, int64_t v_scale_block_stride, void* cuda_stream) {
  const QuantizeTokensFp8Args a{v,         ld_v,       rows,    cols,               expert_offsets,
                                expert_counts, num_experts, q,  ld_q,               scale,
                                ld_scale,  pow2_scales != 0, src_route, num_tokens, top_k,
                                v_scale,   v_scale_row_stride, v_scale_block_stride};
  return run_on_device("quantize_tokens_fp8", qh::check_quantize_tokens_fp8_args,
                       prime_kernels::common::launch_quantize_tokens_fp8, a, cuda_stream);
}

int pk_quantize_tokens_fp8_cpu(const void* v, int64_t ld_v, int64_t rows, int64_t cols,
                               const int32_t* expert_offsets, const int32_t* expert_counts, int num_experts, void* q,
                               int64_t ld_q, float* scale, int64_t ld_scale, int pow2_scales,
                               const int32_t* src_route, int64_t num_tokens, int64_t top_k, const float* v_scale,
                               int64_t v_scale_row_stride, int64_t v_scale_block_stride) {
  const QuantizeTokensFp8Args a{v,         ld_v,       rows,    cols,               expert_offsets,
                                expert_counts, num_experts, q,  ld_q,               scale,
                                ld_scale,  pow2_scales != 0, src_route, num_tokens, top_k,
                                v_scale,   v_scale_row_stride, v_scale_block_stride};
  if (const int rc = check_args(qh::check_quantize_tokens_fp8_args, a, false); rc != PK_OK) return rc;
  if (a.rows == 0 || a.cols == 0) return prime_kernels::api::ok();
  char message[512] = {0};
  if (qh::check_pool_layout(expert_offsets, expert_counts, num_experts, rows, message, sizeof(message)) != 0)
    return prime_kernels::api::fail(PK_ERR_INVALID_ARGUMENT, "%s", message);
  if (src_route != nullptr && qh::check_pool_routes(src_route, expert_offsets, expert_counts, num_experts,
                                                    num_tokens * top_k, message, sizeof(message)) != 0)
    return prime_kernels::api::fail(PK_ERR_INVALID_ARGUMENT, "%s", message);
  prime_kernels::common::quantize_tokens_fp8_host(a);
  return prime_kernels::api::ok();
}

int pk_quantize_mxfp8_cuda(const void* x, int x_fp32, int64_t rows, int64_t cols, int64_t x_stride_row,
                           int64_t x_stride_col, void* q, int64_t q_stride_row, int64_t q_stride_col, void* scale,
                           int64_t scale_bytes, int scale_layout, int64_t scale_ld, int group_axis,
                           const int32_t* group_ends, int32_t* group_starts, int32_t num_groups, int rceil,
                           void* cuda_stream) {
  const mx::QuantizeMxfp8Args a = mxfp8_args(x, x_fp32, rows, cols, x_stride_row, x_stride_col, q, q_stride_row,
                                             q_stride_col, scale, scale_bytes, scale_layout, scale_ld, group_axis,
                                             group_ends, group_starts, num_groups, rceil);
  if (const int rc = prime_kernels::api::check_device_findings("quantize_mxfp8"); rc != PK_OK) return rc;
  if (const int rc = check_mxfp8(a, x_fp32, scale_layout, group_axis, group_starts); rc != PK_OK) return rc;
  if (a.rows == 0 || a.cols == 0) return prime_kernels::api::ok();
  if (const int rc = prime_kernels::api::check_current_device(prime_kernels::api::ArchFamily::kAny); rc != PK_OK)
    return rc;
  const auto stream = static_cast<cudaStream_t>(cuda_stream);
  cudaError_t err = mx::launch_mxfp8_blocked_group_starts(a, group_starts, mx::device_check_record(), stream);
  if (err == cudaSuccess) err = mx::launch_quantize_mxfp8(a, stream);
  if (err != cudaSuccess) return prime_kernels::api::fail_cuda(err, "quantize_mxfp8");
  return prime_kernels::api::ok();
}

int pk_quantize_mxfp8_cpu(const void* x, int x_fp32, int64_t rows, int64_t cols, int64_t x_stride_row,
                          int64_t x_stride_col, void* q, int64_t q_stride_row, int64_t q_stride_col, void* scale,
                          int64_t scale_bytes, int scale_layout, int64_t scale_ld, int group_axis,
                          const int32_t* group_ends, int32_t* group_starts, int32_t num_groups, int rceil) {
  const mx::QuantizeMxfp8Args a = mxfp8_args(x, x_fp32, rows, cols, x_stride_row, x_stride_col, q, q_stride_row,
                                             q_stride_col, scale, scale_bytes, scale_layout, scale_ld, group_axis,
                                             group_ends, group_starts, num_groups, rceil);
  if (const int rc = check_mxfp8(a, x_fp32, scale_layout, group_axis, group_starts); rc != PK_OK) return rc;
  if (a.rows == 0 || a.cols == 0) return prime_kernels::api::ok();
  if (const char* why = mx::check_mxfp8_group_ends_host(a))
    return prime_kernels::api::fail(PK_ERR_INVALID_ARGUMENT, "quantize_mxfp8: %s", why);
  if (a.group_axis != mx::Mxfp8GroupAxis::kNone)
    mx::mxfp8_blocked_group_starts_host(a.group_ends, a.num_groups, a.group_axis, group_starts);
  mx::quantize_mxfp8_host(a);
  return prime_kernels::api::ok();
}

}  // extern "C"
