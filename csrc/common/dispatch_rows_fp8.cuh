// Dispatch with qK(., 128): for every route p = route_to_pool[t, k], q[p, :] = e4m3 of the bf16 token row src[t, :]
// in 1 x 128 blocks along H, and the fp32 scale of block j at sa[j * ld_sa + p] (K-block major, the layout
// m_grouped_fp8_gemm_nt reads). The rounding is python/prime_kernels/mega/fp8.py's quantize_along_k
// (fp8_quant_math.cuh). Routes of -1 write nothing; a route outside [0, num_rows) writes nothing either and is noted
// in the device-check record (common/device_check.hpp); rows no route names keep their contents.
//
// Token-major, as the bf16 dispatch (combine.cuh): a token row is read and quantized once and its q bytes stored
// to each of its routes' rows. Each thread owns 8 consecutive columns (one 16-byte load, one 8-byte store per
// route); the 16 threads of a half-warp hold one 128-column block and reduce its amax with shuffles, so the scale
// needs no shared memory and no barrier.
//
// hidden = 64 (mod 128): the last block is 64 columns wide (fp8.py's tail block, its amax over those 64). This kernel
// takes the whole blocks before it (launched with hidden rounded down to 128) and dispatch_rows_fp8_tail_kernel that
// block, so the kernel for multiples of 128 keeps its code.
//
// Forward progress: a CTA waits on nothing (no barrier, no other CTA); the only cross-thread step is the half-warp
// shuffle, which every thread of the half-warp reaches (hidden is a multiple of 128, so the column guard keeps or
// drops whole half-warps).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/device_check.hpp"
#include "common/fp8_quant_math.cuh"

namespace prime_kernels::common {

constexpr int kDispatchFp8Threads = 256;

// One thread's 8 bf16 values (raw) of a block held by the lanes of `lanes`, kTopLaneBit the highest lane bit inside
// it: the block's amax over those lanes, its scale (Q2, into scale) and the 8 values' e4m3 bytes (Q3).
template <int kTopLaneBit>
__device__ __forceinline__ uint2 dispatch_fp8_quantize(const uint4& raw, unsigned lanes, bool pow2_scales,
                                                       float& scale) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
  float v[8];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
    amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
  }
#pragma unroll
  for (int lane_bit = kTopLaneBit; lane_bit >= 1; lane_bit >>= 1)
    amax = fmaxf(amax, __shfl_xor_sync(lanes, amax, lane_bit));
  scale = fp8_block_scale(amax, pow2_scales);
  uint2 packed;
  packed.x = e4m3x2_bits(v[0], v[1], scale) | (e4m3x2_bits(v[2], v[3], scale) << 16);
  packed.y = e4m3x2_bits(v[4], v[5], scale) | (e4m3x2_bits(v[6], v[7], scale) << 16);
  return packed;
}

// Grid: x = ceil(hidden / 8 / kDispatchFp8Threads) column chunks, y = tokens (grid-stride).
__global__ void __launch_bounds__(kDispatchFp8Threads)
dispatch_rows_fp8_kernel(const __nv_bfloat16* __restrict__ src, int64_t ld_src,
                         const int32_t* __restrict__ route_to_pool, int64_t num_tokens, int top_k, int64_t hidden,
                         uint8_t* __restrict__ q, int64_t ld_q, float* __restrict__ sa, int64_t ld_sa,
                         int64_t num_rows, bool pow2_scales, DeviceCheckRecord* check) {
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kDispatchFp8Threads + threadIdx.x) * 8;
  if (col >= hidden) return;
  const unsigned half_warp = 0xffffu << (threadIdx.x & 16);
  const bool writes_scale = (threadIdx.x & 15) == 0;
  float* const block_scales = sa + (col / kFp8Block) * ld_sa;
  for (int64_t t = blockIdx.y; t < num_tokens; t += gridDim.y) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src + t * ld_src + col));
    float scale;
    const uint2 packed = dispatch_fp8_quantize<8>(raw, half_warp, pow2_scales, scale);
    for (int k = 0; k < top_k; ++k) {
      const int32_t row = __ldg(route_to_pool + t * top_k + k);
      if (row >= 0 && row < num_rows) {
        *reinterpret_cast<uint2*>(q + row * ld_q + col) = packed;
        if (writes_scale) block_scales[row] = scale;
      } else if (row != -1 && col == 0) {
        report_device_check(check, kCheckDispatchFp8Route, row, num_rows);
      }
    }
  }
}

constexpr int kDispatchFp8TailRows = kDispatchFp8Threads / 8;  // token rows per CTA and step

// The 64-column last block of every token row (hidden = 64 mod 128), src, q and sa given at that block (its first
// column, its scale row): eight threads of 8 columns per row, the row's amax over their aligned 8 lanes (three
// shuffles, which all eight reach: they share the row). Grid: x CTAs striding over the rows.
__global__ void __launch_bounds__(kDispatchFp8Threads)
dispatch_rows_fp8_tail_kernel(const __nv_bfloat16* __restrict__ src, int64_t ld_src,
                              const int32_t* __restrict__ route_to_pool, int64_t num_tokens, int top_k,
                              uint8_t* __restrict__ q, int64_t ld_q, float* __restrict__ sa, int64_t num_rows,
                              bool pow2_scales, DeviceCheckRecord* check) {
  const int col = 8 * (threadIdx.x & 7);
  const unsigned lanes = 0xffu << (threadIdx.x & 24);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kDispatchFp8TailRows + (threadIdx.x >> 3); t < num_tokens;
       t += static_cast<int64_t>(gridDim.x) * kDispatchFp8TailRows) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src + t * ld_src + col));
    float scale;
    const uint2 packed = dispatch_fp8_quantize<4>(raw, lanes, pow2_scales, scale);
    // (the route loop of dispatch_rows_fp8_kernel, written out in both: as a shared helper it changed that kernel's
    // code)
    for (int k = 0; k < top_k; ++k) {
      const int32_t row = __ldg(route_to_pool + t * top_k + k);
      if (row >= 0 && row < num_rows) {
        *reinterpret_cast<uint2*>(q + row * ld_q + col) = packed;
        if (col == 0) sa[row] = scale;
      } else if (row != -1 && col == 0) {
        report_device_check(check, kCheckDispatchFp8Route, row, num_rows);
      }
    }
  }
}

}  // namespace prime_kernels::common
