// C ABI of the combine reduction: argument checks, then the CUDA kernel or the host loop.
#include <cstdint>

#include "api/deep_gemm_api.h"
#include "api/errors.hpp"
#include "common/combine.hpp"

namespace {

using deep_gemm::common::CombineArgs;
using deep_gemm::common::DispatchArgs;

int check_combine(const CombineArgs& a, bool on_device) {
  PK_CHECK_ARG(a.num_tokens >= 0 && a.top_k >= 1 && a.hidden >= 0,
               "combine: need num_tokens >= 0, top_k >= 1, hidden >= 0 (got %lld, %lld, %lld)",
               static_cast<long long>(a.num_tokens), static_cast<long long>(a.top_k),
               static_cast<long long>(a.hidden));
  PK_CHECK_ARG(a.hidden % 8 == 0 && a.ld_slots % 8 == 0 && a.ld_out % 8 == 0,
               "combine: hidden (%lld) and the row strides (%lld, %lld) must be multiples of 8",
               static_cast<long long>(a.hidden), static_cast<long long>(a.ld_slots),
               static_cast<long long>(a.ld_out));
  PK_CHECK_ARG(a.ld_slots >= a.hidden && a.ld_out >= a.hidden, "combine: a row stride is smaller than hidden");
  if (a.num_tokens == 0 || a.hidden == 0) return PK_OK;
  PK_CHECK_ARG(a.slots && a.route_to_pool && a.out, "combine: a pointer is null");
  if (on_device)
    PK_CHECK_ARG((reinterpret_cast<uintptr_t>(a.slots) | reinterpret_cast<uintptr_t>(a.out)) % 16 == 0,
                 "combine: slots and out must be 16-byte aligned");
  return PK_OK;
}

int check_dispatch(const DispatchArgs& a, bool on_device) {
  PK_CHECK_ARG(a.num_tokens >= 0 && a.top_k >= 1 && a.hidden >= 0 && a.num_rows >= 0,
               "dispatch_rows: need num_tokens >= 0, top_k >= 1, hidden >= 0, num_rows >= 0 (got %lld, %lld, %lld, "
               "%lld)",
               static_cast<long long>(a.num_tokens), static_cast<long long>(a.top_k),
               static_cast<long long>(a.hidden), static_cast<long long>(a.num_rows));
  PK_CHECK_ARG(a.hidden % 8 == 0 && a.ld_src % 8 == 0 && a.ld_out % 8 == 0,
               "dispatch_rows: hidden (%lld) and the row strides (%lld, %lld) must be multiples of 8",
               static_cast<long long>(a.hidden), static_cast<long long>(a.ld_src),
               static_cast<long long>(a.ld_out));
  PK_CHECK_ARG(a.ld_src >= a.hidden && a.ld_out >= a.hidden, "dispatch_rows: a row stride is smaller than hidden");
  if (a.num_tokens == 0 || a.hidden == 0 || a.num_rows == 0) return PK_OK;
  PK_CHECK_ARG(a.src && a.route_to_pool && a.out, "dispatch_rows: a pointer is null");
  if (on_device)
    PK_CHECK_ARG((reinterpret_cast<uintptr_t>(a.src) | reinterpret_cast<uintptr_t>(a.out)) % 16 == 0,
                 "dispatch_rows: src and out must be 16-byte aligned");
  return PK_OK;
}

}  // namespace

extern "C" {

int pk_combine_bf16_cuda(const void* slots, int64_t ld_slots, const int32_t* route_to_pool, const float* weights,
                         int64_t num_tokens, int64_t top_k, int64_t hidden, void* out, int64_t ld_out,
                         void* cuda_stream) {
  const CombineArgs a{slots, ld_slots, route_to_pool, weights, num_tokens, top_k, hidden, out, ld_out};
  if (const int rc = check_combine(a, true); rc != PK_OK) return rc;
  if (const int rc = deep_gemm::api::check_current_device(deep_gemm::api::ArchFamily::kAny); rc != PK_OK) return rc;
  if (a.num_tokens == 0 || a.hidden == 0) return deep_gemm::api::ok();
  const cudaError_t err = deep_gemm::common::launch_combine(a, static_cast<cudaStream_t>(cuda_stream));
  if (err != cudaSuccess) return deep_gemm::api::fail_cuda(err, "combine launch");
  return deep_gemm::api::ok();
}

int pk_combine_bf16_cpu(const void* slots, int64_t ld_slots, const int32_t* route_to_pool, const float* weights,
                        int64_t num_tokens, int64_t top_k, int64_t hidden, void* out, int64_t ld_out) {
  const CombineArgs a{slots, ld_slots, route_to_pool, weights, num_tokens, top_k, hidden, out, ld_out};
  if (const int rc = check_combine(a, false); rc != PK_OK) return rc;
  deep_gemm::common::combine_host(a);
  return deep_gemm::api::ok();
}

int pk_dispatch_rows_bf16_cuda(const void* src, int64_t ld_src, const int32_t* route_to_pool, int64_t num_tokens,
                               int64_t top_k, int64_t hidden, void* out, int64_t ld_out, int64_t num_rows,
                               void* cuda_stream) {
  const DispatchArgs a{src, ld_src, route_to_pool, num_tokens, top_k, hidden, out, ld_out, num_rows};
  if (const int rc = check_dispatch(a, true); rc != PK_OK) return rc;
  if (const int rc = deep_gemm::api::check_current_device(deep_gemm::api::ArchFamily::kAny); rc != PK_OK) return rc;
  if (a.num_tokens == 0 || a.hidden == 0 || a.num_rows == 0) return deep_gemm::api::ok();
  const cudaError_t err = deep_gemm::common::launch_dispatch_rows(a, static_cast<cudaStream_t>(cuda_stream));
  if (err != cudaSuccess) return deep_gemm::api::fail_cuda(err, "dispatch_rows launch");
  return deep_gemm::api::ok();
}

int pk_dispatch_rows_bf16_cpu(const void* src, int64_t ld_src, const int32_t* route_to_pool, int64_t num_tokens,
                              int64_t top_k, int64_t hidden, void* out, int64_t ld_out, int64_t num_rows) {
  const DispatchArgs a{src, ld_src, route_to_pool, num_tokens, top_k, hidden, out, ld_out, num_rows};
  if (const int rc = check_dispatch(a, false); rc != PK_OK) return rc;
  if (a.num_tokens == 0 || a.hidden == 0 || a.num_rows == 0) return deep_gemm::api::ok();
  deep_gemm::common::dispatch_rows_host(a);
  return deep_gemm::api::ok();
}

}  // extern "C"
