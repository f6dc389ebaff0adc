#include <algorithm>

#include "common/swiglu.cuh"
#include "common/swiglu.hpp"

namespace prime_kernels::common {

namespace {
unsigned grid_for(int64_t max_rows) {
  // Enough blocks to fill any GPU several times over; rows past *num_rows exit at once.
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(max_rows, 8192)));
}
}  // namespace

cudaError_t launch_swiglu_fwd(const SwigluArgs& a, cudaStream_t stream) {
  if (a.max_rows == 0) return cudaSuccess;
  swiglu_fwd_kernel<<<grid_for(a.max_rows), kSwigluThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(a.h), a.ld_h, static_cast<__nv_bfloat16*>(a.s), a.ld_s, a.inter, a.num_rows,
      a.max_rows, SwigluMath{a.clamp, a.has_clamp});
  return cudaGetLastError();
}

cudaError_t launch_swiglu_bwd(const SwigluArgs& a, cudaStream_t stream) {
  if (a.max_rows == 0) return cudaSuccess;
  swiglu_bwd_kernel<<<grid_for(a.max_rows), kSwigluThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(a.h), a.ld_h, static_cast<const __nv_bfloat16*>(a.da), a.ld_da,
      a.pool_src_route, a.topk_weights, a.num_routes, a.inter, a.num_rows, a.max_rows,
      SwigluMath{a.clamp, a.has_clamp}, static_cast<__nv_bfloat16*>(a.dh), a.ld_dh, static_cast<__nv_bfloat16*>(a.a),
      a.ld_a, a.dt, device_check_record());
  return cudaGetLastError();
}

}  // namespace prime_kernels::common
