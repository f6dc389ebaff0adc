// qT of pool rows for the weight-gradient GEMMs: v bf16 [rows, cols] (pool rows, expert e's at
// [offsets[e], offsets[e + 1]), its first counts[e] live) -> q e4m3 [cols, rows] (token axis contiguous) and one
// fp32 scale per column and 128-row block at scale[b * ld_scale + c], the operand layout of k_grouped_fp8_gemm_tn.
// The rounding is python/prime_kernels/mega/fp8.py's quantize_along_tokens applied to each expert's rows
// (fp8_quant_math.cuh): every offset is a multiple of 128 (or rows), so each expert's block grid is the pool's
// 128-row grid and no block holds rows of two experts. Padding rows (past an expert's count) and rows in no expert
// are read as zeros, never loaded: they quantize to 0 and raise no amax, whatever the pool holds there.
//
// Gathering (src_route != null, QuantizeTokensFp8Args): pool row r is read from token row src_route[r] / top_k of
// v, so the bf16 pool is never written and read back; a negative route reads zeros, one past the routes reads zeros
// and is a device finding. With v_scale, v holds e4m3 rows quantized 1 x 128 along the columns, and each value is
// read as bf16(e4m3 * scale), the bits a dequantization to bf16 would hold, without writing that bf16 copy.
//
// One CTA per 128-row block x 64 columns, a transpose through shared memory so that both sides are coalesced:
//   1. load: thread (m = tid % 8, a = tid / 8) loads 8 columns (16 bytes of bf16, 8 of e4m3 and its block's scale)
//      of each of the rows 4a .. 4a+3; a warp's loads cover whole row segments;
//   2. the columns' amax: a thread's 4 rows, then the 4 row-quads of its warp (shuffles), then the 8 warps (shared);
//   3. each thread quantizes its 4 x 8 values and stores, per column, the 4 consecutive tokens' e4m3 bytes as one
//      word into the column-major stage (rows of 33 words: at most 2-way bank conflicts);
//   4. store: 8 threads per column write its 128 token bytes, 16 each (4 conflict-free shared words), to q.
// The layout (offsets non-decreasing within [0, rows], each a multiple of 128 or rows; 0 <= counts[e] <= the
// expert's rows) is checked by every CTA before it writes anything: a CTA that finds it broken writes nothing, and
// the finding goes to the device-check record (common/device_check.hpp).
//
// Forward progress: a CTA waits on nothing outside itself (no other CTA, no flag); its barriers are reached by all
// of its threads, since every early exit is taken by the whole CTA on a value that a barrier made uniform.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "common/bf16x8.cuh"
#include "common/device_check.hpp"
#include "common/fp8_quant_math.cuh"

namespace prime_kernels::common {

constexpr int kQuantTokensThreads = 256;
constexpr int kQuantTokensCols = 64;                    // columns per CTA (8 threads x 8 columns)
constexpr int kQuantTokensStageWords = kFp8Block / 4 + 1;  // one column's 128 bytes + one word of padding

// One thread's 8 columns of one row: bf16 (16 bytes) or e4m3 (8 bytes, read as bf16(value * its block's scale)).
template <bool kE4m3In>
struct QuantTokensInput;

template <>
struct QuantTokensInput<false> {
  using Elem = __nv_bfloat16;
  using Raw = uint4;
  __device__ __forceinline__ static void to_float(const Raw& raw, float /*scale*/, float (&out)[8]) {
    bf16x8_to_float(raw, out);
  }
};

template <>
struct QuantTokensInput<true> {
  using Elem = uint8_t;
  using Raw = uint2;
  __device__ __forceinline__ static void to_float(const Raw& raw, float scale, float (&out)[8]) {
    const uint32_t words[2] = {raw.x, raw.y};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const auto pair = static_cast<__nv_fp8x2_storage_t>((words[j / 2] >> (16 * (j % 2))) & 0xffffu);
      const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
      out[2 * j] = __bfloat162float(__float2bfloat16_rn(f.x * scale));
      out[2 * j + 1] = __bfloat162float(__float2bfloat16_rn(f.y * scale));
    }
  }
};

// Grid: x = ceil(rows / 128) token blocks, y = ceil(cols / 64) column tiles. kE4m3In: v is e4m3 with v_scale.
template <bool kE4m3In>
__global__ void __launch_bounds__(kQuantTokensThreads)
quantize_tokens_fp8_kernel(const void* __restrict__ v, int64_t ld_v, int64_t rows, int64_t cols,
                           const int32_t* __restrict__ offsets, const int32_t* __restrict__ counts, int num_experts,
                           uint8_t* __restrict__ q, int64_t ld_q, float* __restrict__ scale, int64_t ld_scale,
                           bool pow2_scales, const int32_t* __restrict__ src_route, int top_k, int num_routes,
                           const float* __restrict__ v_scale, int64_t v_scale_row_stride,
                           int64_t v_scale_block_stride, DeviceCheckRecord* check) {
  __shared__ uint32_t stage[kQuantTokensCols][kQuantTokensStageWords];
  __shared__ float warp_amax[kQuantTokensThreads / 32][kQuantTokensCols];
  __shared__ float col_scale[kQuantTokensCols];
  __shared__ int64_t live_end;  // the block's rows below it are live tokens

  const int tid = threadIdx.x;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kFp8Block;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kQuantTokensCols;

  // The pool layout, and which rows of this block are live (a block in no expert has none).
  if (tid == 0) live_end = row0;
  if (group_offsets_invalid(offsets, num_experts, static_cast<int>(rows), check, kCheckQuantizeTokensLayout,
                            kFp8Block))
    return;
  bool bad_count = false;
  for (int e = tid; e < num_experts; e += kQuantTokensThreads) {
    const int32_t lo = __ldg(offsets + e), hi = __ldg(offsets + e + 1), n = __ldg(counts + e);
    if (n < 0 || n > hi - lo) {
      bad_count = true;
      if (blockIdx.x == 0 && blockIdx.y == 0) report_device_check(check, kCheckQuantizeTokensLayout, n, hi - lo);
    } else if (lo <= row0 && row0 < hi) {
      live_end = lo + n;  // one expert at most holds row0: the others are empty there or end before it
    }
  }
  if (__syncthreads_or(bad_count)) return;

  // 1. load
  const int m = tid % 8, a = tid / 8;
  const int64_t col = col0 + 8 * m;
  const bool col_in = col < cols;
  // all four rows' loads first, then the conversions (a first version that converted each row right after its own
  // load, its input kind a runtime branch, ran the bf16 qT 24% slower on the H200)
  using In = QuantTokensInput<kE4m3In>;
  typename In::Raw raw[4];
  float row_scale[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t r = row0 + 4 * a + i;
    bool live = r < live_end;
    int64_t src_row = r;
    if (src_route != nullptr && live) {
      const int32_t route = __ldg(src_route + r);
      if (route >= num_routes) note_device_check(check, kCheckQuantizeTokensRoute);
      live = route >= 0 && route < num_routes;
      src_row = live ? route / top_k : 0;
    }
    const bool load = col_in && live;
    raw[i] = load ? __ldg(reinterpret_cast<const typename In::Raw*>(static_cast<const typename In::Elem*>(v) +
                                                                     src_row * ld_v + col))
                  : typename In::Raw{};
    row_scale[i] = 0.0f;
    if constexpr (kE4m3In) {
      if (load) row_scale[i] = __ldg(v_scale + src_row * v_scale_row_stride + (col / kFp8Block) * v_scale_block_stride);
    }
  }
  float x[4][8];
#pragma unroll
  for (int i = 0; i < 4; ++i) In::to_float(raw[i], row_scale[i], x[i]);

  // 2. amax per column
  float amax[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    amax[j] = fmaxf(fmaxf(fabsf(x[0][j]), fabsf(x[1][j])), fmaxf(fabsf(x[2][j]), fabsf(x[3][j])));
    amax[j] = fmaxf(amax[j], __shfl_xor_sync(0xffffffffu, amax[j], 8));
    amax[j] = fmaxf(amax[j], __shfl_xor_sync(0xffffffffu, amax[j], 16));
  }
  if ((tid & 31) < 8) {
#pragma unroll
    for (int j = 0; j < 8; ++j) warp_amax[tid / 32][8 * m + j] = amax[j];
  }
  __syncthreads();
  if (tid < kQuantTokensCols) {
    float block_amax = warp_amax[0][tid];
#pragma unroll
    for (int w = 1; w < kQuantTokensThreads / 32; ++w) block_amax = fmaxf(block_amax, warp_amax[w][tid]);
    const float s = fp8_block_scale(block_amax, pow2_scales);
    col_scale[tid] = s;
    if (col0 + tid < cols) scale[static_cast<int64_t>(blockIdx.x) * ld_scale + col0 + tid] = s;
  }
  __syncthreads();

  // 3. quantize into the column-major stage
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float s = col_scale[8 * m + j];
    stage[8 * m + j][a] = e4m3x2_bits(x[0][j], x[1][j], s) | (e4m3x2_bits(x[2][j], x[3][j], s) << 16);
  }
  __syncthreads();

  // 4. store: column c's tokens row0 + 16k .. row0 + 16k + 15
  const int k = tid % 8;
  const int64_t token = row0 + 16 * k;
#pragma unroll
  for (int pass = 0; pass < kQuantTokensCols / (kQuantTokensThreads / 8); ++pass) {
    const int c = tid / 8 + pass * (kQuantTokensThreads / 8);
    if (col0 + c >= cols || token >= rows) continue;
    uint8_t* dst = q + (col0 + c) * ld_q + token;
    if (token + 16 <= rows) {
      *reinterpret_cast<uint4*>(dst) =
          make_uint4(stage[c][4 * k], stage[c][4 * k + 1], stage[c][4 * k + 2], stage[c][4 * k + 3]);
    } else {  // the pool's last, partial 16 tokens: not a byte past rows (bytes taken from shared, not a local array)
      for (int b = 0; b < rows - token; ++b) dst[b] = static_cast<uint8_t>(stage[c][4 * k + b / 4] >> (8 * (b % 4)));
    }
  }
}

}  // namespace prime_kernels::common
