// prime-kernels: the SwiGLU arithmetic of the sm90 epilogues, forward and backward: the sigmoid, s = silu(g) * u,
// the saved h's rounding (plain and with the clamp's masks) and the backward of one column pair. Values and
// register fragments only; the stores are in epilogue.cuh (no __global__ here).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "ptx.cuh"

namespace prime_kernels {
namespace sm90 {

// The saved pre-activation's rounding with a clamp (prime_kernels.mega.reference, rounding point F6): round to
// nearest even, except that a value strictly on one side of a bound never lands on or across it (it takes
// the nearest bf16 on its own side), so the backward's clamp masks evaluated on the bf16 h equal the
// forward's on the fp32 h. Gate columns have the bound c (min(g, c)); up columns also -c. below / above:
// the largest bf16 value < c and the smallest > c (so -above / -below are those of -c).
struct PackBf16x2ClampMasks {
  float c, below, above;
  bool up;
  __device__ __forceinline__ float round1(float v) const {
    const float r = __bfloat162float(__float2bfloat16_rn(v));
    if (v < c && r >= c) return below;
    if (v > c && r <= c) return above;
    if (up) {
      if (v < -c && r >= -c) return -above;
      if (v > -c && r <= -c) return -below;
    }
    return r;
  }
  __device__ __forceinline__ uint32_t operator()(float lo, float hi) const {
    return ptx::pack_bf16x2(round1(lo), round1(hi));  // exact: both are bf16 values already
  }
};

// 1 / (1 + e^-x) from 2^x and 1/x on the SFU (ptx::ex2_approx_ftz, rcp_approx_ftz: the values __expf and
// __fdividef give here, without their denormal-range checks), the sigmoid of every SwiGLU epilogue.
__device__ __forceinline__ float sigmoid_sfu(float x) {
  constexpr float kLog2e = 1.4426950408889634f;  // the factor __expf applies before its 2^x
  return ptx::rcp_approx_ftz(1.f + ptx::ex2_approx_ftz(-x * kLog2e));
}

// s = silu(g) * u in fp32 (clamp > 0: g <= clamp and -clamp <= u <= clamp first), the one formula of every
// forward epilogue, so that all of them round s identically. Its g and u are the pre-activations as the
// backward sees them (reference F3): h rounded to bf16 the way it is saved (round_acc_as_saved_h), so that s is
// exactly the bf16 rounding of the backward's s, and an epilogue that only holds bf16 h (the cooperative
// forward's hand-off) computes the same s as one that holds the fp32 accumulators.
__device__ __forceinline__ float swiglu_value(float g, float u, float clamp) {
  if (clamp > 0.f) {
    g = fminf(g, clamp);
    u = fmaxf(fminf(u, clamp), -clamp);
  }
  return g * sigmoid_sfu(g) * u;  // an IEEE division would cost a slow-path check per element
}

// The saved h's rounding (round to nearest even) of a pair of values, in place: one conversion instruction for
// both (conversions issue at a quarter of the FMA rate: one per value cost the cooperative forward's L1 epilogue
// ~45 us per CTA at 30B).
__device__ __forceinline__ void round_bf16_pair(float& a, float& b) {
  const uint32_t p = ptx::pack_bf16x2(a, b);
  a = __uint_as_float(p << 16);
  b = __uint_as_float(p & 0xffff0000u);
}

// Packs two values that are already bf16 values (their low 16 bits are zero) into one bf16x2 word, exactly and
// without a conversion instruction.
struct PackBf16x2Exact {
  __device__ __forceinline__ uint32_t operator()(float lo, float hi) const {
    return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);
  }
};

// The saved h's rounding of a pair of gate (gate()) or up (up()) values, in place: with a clamp (c > 0), rounding
// point F6 (PackBf16x2ClampMasks); without one, or where h is saved plainly (the grouped pipeline), RoundHPlain.
struct RoundHMasks {
  float c, below, above;
  __device__ __forceinline__ void gate(float& a, float& b) const {
    const PackBf16x2ClampMasks r{c, below, above, false};
    a = r.round1(a);
    b = r.round1(b);
  }
  __device__ __forceinline__ void up(float& a, float& b) const {
    const PackBf16x2ClampMasks r{c, below, above, true};
    a = r.round1(a);
    b = r.round1(b);
  }
};
struct RoundHPlain {
  __device__ __forceinline__ void gate(float& a, float& b) const { round_bf16_pair(a, b); }
  __device__ __forceinline__ void up(float& a, float& b) const { round_bf16_pair(a, b); }
};

// In place: a warpgroup's 64 x kBlockN fragment (left half gate columns, right half up columns) rounded to the
// bf16 values h is saved as (Round); then PackBf16x2Exact stages them and swiglu_in_place needs no rounding.
// Adjacent registers 2i, 2i + 1 are adjacent columns of one row (the wgmma accumulator layout).
template <int kBlockN, typename Round>
__device__ __forceinline__ void round_acc_as_saved_h(float (&acc)[kBlockN / 2], const Round& round) {
#pragma unroll
  for (int i = 0; i < kBlockN / 4; i += 2) {
    round.gate(acc[i], acc[i + 1]);
    round.up(acc[kBlockN / 4 + i], acc[kBlockN / 4 + i + 1]);
  }
}

// In place: the left kBlockN / 4 accumulator registers (the gate half's fragment) become s of the fragment's
// 64 x kBlockN / 2 columns, in the same fragment layout, so write_acc_boxes_to_staging can stage them. The
// fragment holds h as saved already (round_acc_as_saved_h).
template <int kBlockN>
__device__ __forceinline__ void swiglu_in_place(float (&acc)[kBlockN / 2], float clamp) {
#pragma unroll
  for (int i = 0; i < kBlockN / 4; ++i) acc[i] = swiglu_value(acc[i], acc[i + kBlockN / 4], clamp);
}

// The SwiGLU backward of one column pair (the per-element math of both L2-dgrad epilogues): g2 / u2 hold the
// pair's gate and up values as saved (bf16x2, first column in the low half), da0 / da1 its fp32 accumulators, w
// the route's weight. Returns dg, du and w * s as bf16x2 words and adds da * s to partial in column order.
struct SwigluBwdWords {
  uint32_t dg, du, aw;
};
// kClamp: kClampOff / kClampOn (clamp > 0) decide at compile time (the clamp's min / max / masks, computed and
// discarded at run time, were 8 of the ~33 instructions per element); kClampRuntime tests clamp > 0 per element
// (one copy of the code, for an epilogue that cannot spare the registers of two).
constexpr int kClampOff = 0, kClampOn = 1, kClampRuntime = 2;
template <int kClamp>
__device__ __forceinline__ SwigluBwdWords swiglu_bwd_pair(uint32_t g2, uint32_t u2, float da0, float da1, float w,
                                                          float clamp, float& partial) {
  const bool has_clamp = kClamp == kClampOn || (kClamp == kClampRuntime && clamp > 0.f);
  float dg[2], du[2], av[2];
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const float g = ptx::bf16_bits_to_float(static_cast<uint16_t>(t ? g2 >> 16 : g2 & 0xffffu));
    const float u = ptx::bf16_bits_to_float(static_cast<uint16_t>(t ? u2 >> 16 : u2 & 0xffffu));
    const float gc = has_clamp ? fminf(g, clamp) : g;
    const float uc = has_clamp ? fminf(fmaxf(u, -clamp), clamp) : u;
    const float sig = sigmoid_sfu(gc);
    const float silu = gc * sig;
    const float sv = silu * uc;
    const float da = t ? da1 : da0;
    partial = fmaf(da, sv, partial);
    const float ds = w * da;
    dg[t] = ds * uc * sig * (1.f + gc * (1.f - sig));
    du[t] = ds * silu;
    if (has_clamp) {
      dg[t] = g < clamp ? dg[t] : 0.f;
      du[t] = (u > -clamp && u < clamp) ? du[t] : 0.f;
    }
    av[t] = w * sv;
  }
  return SwigluBwdWords{ptx::pack_bf16x2(dg[0], dg[1]), ptx::pack_bf16x2(du[0], du[1]), ptx::pack_bf16x2(av[0], av[1])};
}

// The SwiGLU backward of one element in fp32 for an epilogue that quantizes its outputs (swiglu_bwd_fp8.cuh): every
// operation rounded on its own (no contraction into fused multiply-adds), in the order of the reference's fp32 steps
// (B3-B5, B9), so that the two passes such an epilogue makes over a tile (amaxes, then quantization) compute the same
// bits, and the values differ from the reference's only by the sigmoid (sigmoid_sfu). g, u: the saved h; da: the
// fp32 accumulator; w: the route weight. Returns dg, du (0 outside the clamp's pass-through), w * s and s.
struct SwigluBwdF32 {
  float dg, du, a, s;
};
template <int kClamp>
__device__ __forceinline__ SwigluBwdF32 swiglu_bwd_f32(float g, float u, float da, float w, float clamp) {
  const bool has_clamp = kClamp == kClampOn || (kClamp == kClampRuntime && clamp > 0.f);
  const float gc = has_clamp ? fminf(g, clamp) : g;
  const float uc = has_clamp ? fminf(fmaxf(u, -clamp), clamp) : u;
  const float sig = sigmoid_sfu(gc);
  const float silu = __fmul_rn(gc, sig);
  const float s = __fmul_rn(silu, uc);
  const float ds = __fmul_rn(w, da);
  const float dsig = __fadd_rn(1.f, __fmul_rn(gc, __fsub_rn(1.f, sig)));  // 1 + gc (1 - sig)
  float dg = __fmul_rn(__fmul_rn(__fmul_rn(ds, uc), sig), dsig);
  float du = __fmul_rn(ds, silu);
  if (has_clamp) {
    dg = g < clamp ? dg : 0.f;
    du = (u > -clamp && u < clamp) ? du : 0.f;
  }
  return SwigluBwdF32{dg, du, __fmul_rn(w, s), s};
}

}  // namespace sm90
}  // namespace prime_kernels
