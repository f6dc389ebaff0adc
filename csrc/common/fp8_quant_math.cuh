// The blockwise-FP8 recipe's scale and e4m3 rounding (python/prime_kernels/mega/fp8.py, rules Q2 and Q3), written
// once for the quantizing kernels and for their host loops, so that the CPU ops compute what the CUDA ops compute.
//
//   scale = amax / 448 (fp32, round to nearest); 1 when that quotient is 0; with pow2 scales, 2^ceil(log2(quotient))
//           read off the quotient's fp32 bits (a quotient that is a power of two keeps it).
//   q     = e4m3(v / scale): a true fp32 division, then round to nearest even with saturation to +-448.
//
// The division stays a division with pow2 scales too: it is exact then, and a reciprocal is not always
// representable (the reciprocal of a subnormal scale such as 2^-140 overflows fp32). An epilogue that divides many
// values by one scale may use div_by_scale (below), which gives the division's bits without a divide.
// Inputs are finite; a NaN or an infinity in a block gives no defined result.
#pragma once

#include <cuda_fp8.h>

#include "common/fp8_div.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace prime_kernels::common {

constexpr int kFp8Block = 128;       // the recipe's block: 1 x 128 along K, 128 x 1 along the token axis
constexpr float kE4m3Max = 448.0f;   // the largest finite e4m3 (fn) value

// The bits of one 4-byte type read as another (memcpy: a register move on the device, defined behaviour on the host).
template <typename To, typename From>
__host__ __device__ __forceinline__ To bit_cast(From x) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of one size");
  To y;
  memcpy(&y, &x, sizeof(y));
  return y;
}
__host__ __device__ __forceinline__ uint32_t fp32_bits(float x) { return bit_cast<uint32_t>(x); }
__host__ __device__ __forceinline__ float fp32_from_bits(uint32_t u) { return bit_cast<float>(u); }

// Q2: the scale of a block whose fp32 amax is `amax` (>= 0).
__host__ __device__ __forceinline__ float fp8_block_scale(float amax, bool pow2_scales) {
  const float quotient = fp32_div_rn(amax, kE4m3Max);
  if (!(quotient > 0.0f)) return 1.0f;
  if (!pow2_scales) return quotient;
  const uint32_t bits = fp32_bits(quotient);  // positive: no sign bit
  const uint32_t mantissa = bits & 0x7fffffu;
  const uint32_t exponent = bits >> 23;
  if (exponent != 0) return mantissa == 0 ? quotient : fp32_from_bits((exponent + 1) << 23);
  // Subnormal: quotient = mantissa * 2^-149, so the power of two above it is the next power of two of the integer
  // mantissa read as fp32 bits (1 << 23 reads as 2^-126, the smallest normal).
  if ((mantissa & (mantissa - 1)) == 0) return quotient;
#ifdef __CUDA_ARCH__
  const int width = 32 - __clz(mantissa);
#else
  const int width = 32 - __builtin_clz(mantissa);
#endif
  return fp32_from_bits(1u << width);
}

// Q3 on the host: e4m3 (fn) bits of x, round to nearest even, saturating to +-448 (cvt.rn.satfinite); NaN -> 0x7f.
inline uint8_t e4m3_bits_host(float x) {
  uint32_t u = fp32_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7fu;
  if (u >= 0x43e00000u) return sign | 0x7eu;  // >= 448, infinity included: saturate
  if (u < 0x3c800000u) {                       // below 2^-6, the smallest normal: multiples of 2^-9
    const float steps = std::nearbyint(fp32_from_bits(u) * 512.0f);  // exact scaling; rounds to nearest even
    return sign | static_cast<uint8_t>(steps);  // 8 steps is the smallest normal's encoding
  }
  u += 0x7ffffu + ((u >> 20) & 1u);  // keep 3 mantissa bits, ties to even (may carry into the exponent)
  const uint32_t exponent = (u >> 23) - 127u + 7u;
  return sign | static_cast<uint8_t>((exponent << 3) | ((u >> 20) & 7u));
}

// The value of e4m3 (fn) bits on the host (exact in fp32); 0x7f / 0xff (NaN) give NaN.
inline float e4m3_value_host(uint8_t bits) {
  const int exponent = (bits >> 3) & 15, mantissa = bits & 7;
  float magnitude;
  if (exponent == 15 && mantissa == 7) {
    magnitude = fp32_from_bits(0x7fc00000u);
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: multiples of 2^-9
  } else {
    magnitude = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);  // 1.mmm * 2^(exponent - 7)
  }
  return (bits & 0x80u) ? -magnitude : magnitude;
}

#ifdef __CUDACC__
// Q3 on the device for two values: the low byte is `lo`'s (cvt.rn.satfinite.e4m3x2.f32).
__device__ __forceinline__ uint32_t e4m3x2_bits(float lo, float hi, float scale) {
  return __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(lo, scale), __fdiv_rn(hi, scale)), __NV_SATFINITE, __NV_E4M3);
}

// Q3 on the device for two values by a scale and its fp8_scale_rcp (div_by_scale: the division's bits).
__device__ __forceinline__ uint32_t e4m3x2_bits(float lo, float hi, float scale, float rcp) {
  return __nv_cvt_float2_to_fp8x2(make_float2(div_by_scale(lo, scale, rcp), div_by_scale(hi, scale, rcp)),
                                  __NV_SATFINITE, __NV_E4M3);
}
#endif

}  // namespace prime_kernels::common
