// Eight bf16 values of one 16-byte chunk as fp32 (exact), for the row kernels that load 8 columns per thread.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace prime_kernels::common {

__device__ __forceinline__ void bf16x8_to_float(const uint4& raw, float (&out)[8]) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(pairs[j]);
    out[2 * j] = f.x;
    out[2 * j + 1] = f.y;
  }
}

}  // namespace prime_kernels::common
