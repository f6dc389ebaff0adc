// The combine's per-slot step, shared by the standalone combine kernel (combine.cuh) and the fused
// forward's in-kernel combine (sm90/mega_moe_fwd_pp.cuh), so that the two round identically.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace prime_kernels::common {

// acc[i] += w * bf16 column i of the 16-byte chunk v (one fma each, in column order).
__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const uint4& v, float w) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(p[i]);
    acc[2 * i] = fmaf(w, f.x, acc[2 * i]);
    acc[2 * i + 1] = fmaf(w, f.y, acc[2 * i + 1]);
  }
}

}  // namespace prime_kernels::common
