// prime-kernels: the dispatch of the sm_100a fused forward (mega_moe_sm100.cu): x_pool[m] = x[pool_src_route[m] /
// top_k] for every pool row of the plan, in pool order, zeros where the route is negative (a padded plan's padding
// rows) or past num_tokens * top_k (noted as kCheckMegaFwdRoute), the rows past expert_offsets[num_experts] not
// written, nothing written when the offsets are not a plan. The contract of the sm90 forward's x_pool, as a
// launch of its own beside the tcgen05 GEMMs, which gather their rows from x themselves: mega_moe_sm100.cu runs it
// only when the caller keeps x_pool (o is another buffer).
//
// One warp per pool row at a time (grid-stride), 16-byte loads and stores; no cross-CTA waits.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/device_check.hpp"

namespace prime_kernels {
namespace sm100 {

constexpr int kDispatchPoolThreads = 256;

struct DispatchPoolSm100Params {
  const __nv_bfloat16* x;  // [num_tokens, hidden], row stride ld_x
  int64_t ld_x;
  const int32_t* pool_src_route;  // [m_total]
  int32_t top_k;
  int32_t num_tokens;
  const int32_t* expert_offsets;  // [num_experts + 1]
  int32_t num_experts;
  int32_t m_total;
  int32_t hidden;         // a multiple of 8
  __nv_bfloat16* x_pool;  // [m_total, hidden]
  common::DeviceCheckRecord* check;
};

__global__ void __launch_bounds__(kDispatchPoolThreads)
    mega_dispatch_pool_sm100_kernel(const __grid_constant__ DispatchPoolSm100Params p) {
  if (common::group_offsets_invalid(p.expert_offsets, p.num_experts, p.m_total, p.check,
                                    common::kCheckMegaFwdOffsets))
    return;
  const int rows = __ldg(p.expert_offsets + p.num_experts);
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warps = static_cast<int>(blockDim.x / 32 * gridDim.x);
  const int64_t routes = static_cast<int64_t>(p.num_tokens) * p.top_k;
  for (int m = static_cast<int>(blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32); m < rows; m += warps) {
    const int route = __ldg(p.pool_src_route + m);
    const bool ok = route >= 0 && route < routes;
    if (route >= routes && lane == 0) common::report_device_check(p.check, common::kCheckMegaFwdRoute, route, routes);
    const uint4* src =
        reinterpret_cast<const uint4*>(p.x + (ok ? static_cast<int64_t>(route / p.top_k) * p.ld_x : 0));
    uint4* dst = reinterpret_cast<uint4*>(p.x_pool + static_cast<int64_t>(m) * p.hidden);
    for (int c = lane; c < p.hidden / 8; c += 32) dst[c] = ok ? __ldg(src + c) : make_uint4(0, 0, 0, 0);
  }
}

}  // namespace sm100
}  // namespace prime_kernels
