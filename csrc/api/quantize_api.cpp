// C ABI of the blockwise-FP8 quantizing producers (dispatch_rows_fp8, quantize_tokens_fp8): argument checks, then
// the CUDA kernel or the host loop. Nothing is launched or written on a bad argument.
#include <cstdint>

#include "api/prime_kernels_api.h"
#include "api/errors.hpp"
#include "common/combine.hpp"
#include "common/quantize_fp8.hpp"

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

}  // extern "C"
