// C ABI of the pool-row SwiGLU kernels: argument checks, then the CUDA launch.
#include <cstdint>

#include "api/prime_kernels_api.h"
#include "api/errors.hpp"
#include "common/device_check.hpp"
#include "common/swiglu.hpp"

namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int check_common(const prime_kernels::common::SwigluArgs& a, const char* op) {
  if (const int rc = prime_kernels::api::check_device_findings(op); rc != PK_OK) return rc;
  PK_CHECK_ARG(a.inter > 0 && a.inter % 8 == 0, "%s: I must be a positive multiple of 8, got %lld", op,
               static_cast<long long>(a.inter));
  PK_CHECK_ARG(a.max_rows >= 0 && a.ld_h % 8 == 0 && a.ld_h >= 2 * a.inter,
               "%s: h must be [rows, >= 2I] with a row stride that is a multiple of 8", op);
  PK_CHECK_ARG(a.num_rows != nullptr && (a.max_rows == 0 || (a.h != nullptr && aligned16(a.h))),
               "%s: h / num_rows null or h not 16-byte aligned", op);
  return prime_kernels::api::check_current_device(prime_kernels::api::ArchFamily::kAny);
}

}  // namespace

extern "C" {

int pk_swiglu_fwd_bf16_cuda(const void* h, int64_t ld_h, void* s, int64_t ld_s, int64_t inter, const int32_t* num_rows,
                            int64_t max_rows, float clamp, void* cuda_stream) {
  prime_kernels::common::SwigluArgs a{};
  a.h = h, a.ld_h = ld_h, a.inter = inter, a.num_rows = num_rows, a.max_rows = max_rows;
  a.has_clamp = clamp >= 0.0f, a.clamp = clamp, a.s = s, a.ld_s = ld_s;
  if (const int rc = check_common(a, "swiglu_fwd"); rc != PK_OK) return rc;
  PK_CHECK_ARG(max_rows == 0 || (s != nullptr && aligned16(s) && ld_s % 8 == 0 && ld_s >= inter),
               "swiglu_fwd: s must be a 16-byte aligned [rows, >= I] tensor with a row stride multiple of 8");
  if (const cudaError_t err = prime_kernels::common::launch_swiglu_fwd(a, static_cast<cudaStream_t>(cuda_stream));
      err != cudaSuccess)
    return prime_kernels::api::fail_cuda(err, "swiglu_fwd launch");
  return prime_kernels::api::ok();
}

int pk_swiglu_bwd_bf16_cuda(const void* h, int64_t ld_h, const void* da, int64_t ld_da, const int32_t* pool_src_route,
                            const float* topk_weights, int64_t num_routes, int64_t inter, const int32_t* num_rows,
                            int64_t max_rows, float clamp, void* dh, int64_t ld_dh, void* a_out, int64_t ld_a, float* dt,
                            void* cuda_stream) {
  prime_kernels::common::SwigluArgs a{};
  a.h = h, a.ld_h = ld_h, a.inter = inter, a.num_rows = num_rows, a.max_rows = max_rows;
  a.has_clamp = clamp >= 0.0f, a.clamp = clamp, a.da = da, a.ld_da = ld_da, a.pool_src_route = pool_src_route;
  a.topk_weights = topk_weights, a.num_routes = num_routes, a.dh = dh, a.ld_dh = ld_dh, a.a = a_out, a.ld_a = ld_a, a.dt = dt;
  if (const int rc = check_common(a, "swiglu_bwd"); rc != PK_OK) return rc;
  PK_CHECK_ARG(num_routes >= 0, "swiglu_bwd: num_routes = %lld, must be >= 0", static_cast<long long>(num_routes));
  PK_CHECK_ARG(max_rows == 0 || (da && pool_src_route && (topk_weights || num_routes == 0) && dh && a_out && dt),
               "swiglu_bwd: a pointer is null");
  PK_CHECK_ARG(max_rows == 0 || (aligned16(da) && aligned16(dh) && aligned16(a_out)),
               "swiglu_bwd: da, dh and a must be 16-byte aligned");
  PK_CHECK_ARG(ld_da % 8 == 0 && ld_da >= inter && ld_dh % 8 == 0 && ld_dh >= 2 * inter && ld_a % 8 == 0 &&
                   ld_a >= inter,
               "swiglu_bwd: row strides must be multiples of 8 and cover I (da, a) or 2I (dh)");
  if (const cudaError_t err = prime_kernels::common::launch_swiglu_bwd(a, static_cast<cudaStream_t>(cuda_stream));
      err != cudaSuccess)
    return prime_kernels::api::fail_cuda(err, "swiglu_bwd launch");
  return prime_kernels::api::ok();
}

}  // extern "C"
