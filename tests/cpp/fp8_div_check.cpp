// Host check of common::div_by_scale (csrc/common/fp8_div.hpp), run by tests/test_quantize_fp8.py with the host C++
// compiler alone: the division-free quotient against the IEEE division over scales of the recipe's range (amax / 448
// for amaxes from subnormal to huge, a reciprocal or the divide fallback) and values drawn at random, on and next to
// every e4m3 rounding boundary, tiny and subnormal, zeros of both signs. Where the quotient is at least 2^-11 its fp32
// bits must be equal (e4m3 rounding reads them); below that both must be under 2^-10 with the same sign (e4m3 rounds
// them to a zero of that sign). Prints "ok <cases>", or the first failure and exits non-zero.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "common/fp8_div.hpp"

using prime_kernels::common::div_by_scale;
using prime_kernels::common::fp8_scale_rcp;

namespace {

uint64_t g_state = 88172645463325252ull;
uint64_t next() {  // xorshift64: reproducible, no <random> distribution differences between libraries
  g_state ^= g_state << 13;
  g_state ^= g_state >> 7;
  g_state ^= g_state << 17;
  return g_state;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float draw_amax() {
  if (next() % 8 == 0) return from_bits(static_cast<uint32_t>(next() % 0x7f800000u));  // any finite, subnormal too
  return from_bits(0x0d000000u + static_cast<uint32_t>(next() % (0x7e000000u - 0x0d000000u)));
}

float draw_value(float amax, float scale) {
  float v;
  switch (next() % 4) {
    case 0:  // uniform in [0, amax]
      v = amax * static_cast<float>(static_cast<double>(next() % (1u << 30)) / static_cast<double>(1u << 30));
      break;
    case 1: {  // a quotient on an e4m3 midpoint (3 mantissa bits + half) from 2^-14 to 2^5, moved by up to 2 ulps
      const int e = static_cast<int>(next() % 20) - 14;
      const float q = std::ldexp(1.0f + (static_cast<float>(next() % 16) + 0.5f) / 8.0f, e);
      const uint32_t at = bits(q * scale);  // (positive, so a step below 0 would wrap into NaNs: stay at 0 there)
      v = from_bits(at < 2 ? at : at + static_cast<uint32_t>(static_cast<int>(next() % 5) - 2));
      break;
    }
    case 2:  // any bit pattern at most amax's: tiny and subnormal values
      v = from_bits(static_cast<uint32_t>(next() % (static_cast<uint64_t>(bits(amax)) + 1)));
      break;
    default:
      v = next() % 2 ? 0.0f : from_bits(static_cast<uint32_t>(next() % 64));
  }
  return next() % 2 ? -v : v;
}

}  // namespace

int main() {
  const long kCases = 20000000;
  long reciprocal = 0;
  for (long i = 0; i < kCases; ++i) {
    const float amax = draw_amax();
    float scale = amax / 448.0f;
    if (!(scale > 0.0f)) scale = 1.0f;
    const float rcp = fp8_scale_rcp(scale);
    reciprocal += rcp != 0.0f;
    const float v = draw_value(amax, scale);
    const float want = v / scale;
    const float got = div_by_scale(v, scale, rcp);
    const bool same = std::fabs(want) >= 0x1p-11f
                          ? bits(got) == bits(want)
                          : std::fabs(got) < 0x1p-10f && std::signbit(got) == std::signbit(want);
    if (!same) {
      std::printf("FAIL v=%a scale=%a rcp=%a: division %a, div_by_scale %a\n", v, scale, rcp, want, got);
      return 1;
    }
  }
  if (reciprocal < kCases / 2) {
    std::printf("FAIL only %ld of %ld cases took the reciprocal path\n", reciprocal, kCases);
    return 1;
  }
  std::printf("ok %ld\n", kCases);
  return 0;
}
