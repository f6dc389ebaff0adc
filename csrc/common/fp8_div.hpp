// Q3's division by a block scale (python/prime_kernels/mega/fp8.py): the IEEE fp32 division, and the same bits
// without a divide for an epilogue that quantizes many values by one scale. Plain C++ as well as CUDA, so that
// tests/cpp/fp8_div_check.cpp checks the host build of the very functions the kernels run.
//
// div_by_scale: with rcp = RN(1 / scale), y = RN(v * rcp) is within one ulp of v / scale, and one correction step on
// the exact residual (two fused multiply-adds, Markstein's) gives RN(v / scale) itself. The check compares the two on
// random values, on and next to every e4m3 rounding boundary, zeros of both signs and subnormal values. A scale
// outside [2^-100, 2^100] (its residual could leave fp32's normal range) keeps the division: fp8_scale_rcp returns 0
// for it, which div_by_scale reads as "divide".
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define PK_FP8_HD __host__ __device__ __forceinline__
#else
#define PK_FP8_HD inline
#endif

namespace prime_kernels::common {

PK_FP8_HD float fp32_div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);  // IEEE division whatever -prec-div says
#else
  return a / b;
#endif
}

PK_FP8_HD float fp8_scale_rcp(float scale) {
  if (!(scale >= 0x1p-100f && scale <= 0x1p100f)) return 0.f;
#ifdef __CUDA_ARCH__
  return __frcp_rn(scale);
#else
  return 1.0f / scale;
#endif
}

// div_by_scale for a scale whose fp8_scale_rcp is not 0 (an epilogue that has checked its tile's scales once).
PK_FP8_HD float div_by_scale_in_range(float v, float scale, float rcp) {
#ifdef __CUDA_ARCH__
  const float y = __fmul_rn(v, rcp);
  const float residual = __fmaf_rn(-y, scale, v);
  return residual == 0.f ? y : __fmaf_rn(residual, rcp, y);  // (an exact y keeps its sign: -0 stays -0)
#else
  const float y = v * rcp;
  const float residual = std::fma(-y, scale, v);
  return residual == 0.f ? y : std::fma(residual, rcp, y);
#endif
}

PK_FP8_HD float div_by_scale(float v, float scale, float rcp) {
  return rcp == 0.f ? fp32_div_rn(v, scale) : div_by_scale_in_range(v, scale, rcp);
}

}  // namespace prime_kernels::common
