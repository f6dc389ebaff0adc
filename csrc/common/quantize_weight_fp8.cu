// prime-kernels: the blockwise-FP8 recipe's weight quantization (recipe step W1, python/prime_kernels/mega/fp8.py's
// quantize_weight) in one pass over the weight: one CTA per 128 x 128 tile reads the tile once, reduces its amax,
// writes its scale and its e4m3 values. The rounding is fp8_quant_math.cuh's, shared with the other quantizing kernels
// and the host loop below, so the three give the bits of the reference. The tiles' transposed copy (the dgrad GEMMs
// read the weight K-major the other way round: FP8 wgmma on sm90 takes K-major operands only) is a byte transpose of
// the e4m3 copy, one CTA per tile through shared memory. No CTA waits for another: each owns its tile.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "common/fp8_quant_math.cuh"
#include "common/quantize_fp8.hpp"

namespace prime_kernels::common {

namespace {

constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr int kRowsPerPass = kThreads / (kTile / 8);  // 16 rows of 16 threads x 8 columns
constexpr int kPasses = kTile / kRowsPerPass;          // 8

__global__ void __launch_bounds__(kThreads) quantize_weight_fp8_kernel(const __nv_bfloat16* __restrict__ w,
                                                                       int64_t rows, int64_t cols,
                                                                       uint8_t* __restrict__ q,
                                                                       float* __restrict__ scale, bool pow2_scales) {
  __shared__ float warp_amax[kThreads / 32];
  __shared__ float tile_scale;
  const int64_t mat = blockIdx.z;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile, col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tid = static_cast<int>(threadIdx.x);
  const int chunk = tid % (kTile / 8);  // columns 8 * chunk .. + 8 of the tile
  const int r_base = tid / (kTile / 8);
  const __nv_bfloat16* src = w + (mat * rows + row0) * cols + col0 + 8 * chunk;

  float v[kPasses][8];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int64_t r = r_base + kRowsPerPass * i;
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src + r * cols));
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(pairs[j]);
      v[i][2 * j] = f.x;
      v[i][2 * j + 1] = f.y;
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  if (tid % 32 == 0) warp_amax[tid / 32] = amax;
  __syncthreads();
  if (tid == 0) {
    float m = warp_amax[0];
#pragma unroll
    for (int k = 1; k < kThreads / 32; ++k) m = fmaxf(m, warp_amax[k]);
    const float s = fp8_block_scale(m, pow2_scales);
    tile_scale = s;
    scale[(mat * (rows / kTile) + blockIdx.y) * (cols / kTile) + blockIdx.x] = s;
  }
  __syncthreads();
  const float s = tile_scale;
  uint8_t* dst = q + (mat * rows + row0) * cols + col0 + 8 * chunk;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int r = r_base + kRowsPerPass * i;
    uint2 out;
    out.x = (e4m3x2_bits(v[i][0], v[i][1], s) & 0xffffu) | (e4m3x2_bits(v[i][2], v[i][3], s) << 16);
    out.y = (e4m3x2_bits(v[i][4], v[i][5], s) & 0xffffu) | (e4m3x2_bits(v[i][6], v[i][7], s) << 16);
    *reinterpret_cast<uint2*>(dst + static_cast<int64_t>(r) * cols) = out;
  }
}

// Shared-memory row stride of the transposing kernel: 132 bytes = 33 words, so the stores (a warp covers 4 rows x 8
// 16-byte chunks) and the column reads (a warp reads 32 columns of one 16-row group) touch distinct banks.
constexpr int kTransposeStride = kTile + 4;
constexpr int kChunkBytes = 16;
constexpr int kChunksPerRow = kTile / kChunkBytes;  // 8

__global__ void __launch_bounds__(kThreads) transpose_tiles_fp8_kernel(const uint8_t* __restrict__ q, int64_t rows,
                                                                       int64_t cols, uint8_t* __restrict__ qt) {
  __shared__ __align__(16) uint32_t tile[kTile * kTransposeStride / 4];
  const int64_t mat = blockIdx.z;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile, col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tid = static_cast<int>(threadIdx.x);
  {
    const int chunk = tid % kChunksPerRow;
    const uint8_t* src = q + (mat * rows + row0) * cols + col0 + kChunkBytes * chunk;
#pragma unroll
    for (int r = tid / kChunksPerRow; r < kTile; r += kThreads / kChunksPerRow) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(src + static_cast<int64_t>(r) * cols));
      uint32_t* dst = tile + (r * kTransposeStride + kChunkBytes * chunk) / 4;
      dst[0] = v.x;
      dst[1] = v.y;
      dst[2] = v.z;
      dst[3] = v.w;
    }
  }
  __syncthreads();
  // warp w writes bytes [16 w, 16 w + 16) of 32 output rows (input columns) per pass
  const int group = tid / 32, lane = tid % 32;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(tile);
#pragma unroll
  for (int c = lane; c < kTile; c += 32) {
    uint32_t packed[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t word = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        word |= static_cast<uint32_t>(bytes[(kChunkBytes * group + 4 * k + j) * kTransposeStride + c]) << (8 * j);
      packed[k] = word;
    }
    uint8_t* dst = qt + (mat * cols + col0 + c) * rows + row0 + kChunkBytes * group;
    *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

}  // namespace

cudaError_t launch_quantize_weight_fp8(const QuantizeWeightFp8Args& a, cudaStream_t stream) {
  if (a.num_mats == 0 || a.rows == 0 || a.cols == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(a.cols / kTile), static_cast<unsigned>(a.rows / kTile),
                  static_cast<unsigned>(a.num_mats));
  quantize_weight_fp8_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(a.w), a.rows, a.cols,
                                                            static_cast<uint8_t*>(a.q), a.scale, a.pow2_scales);
  return cudaGetLastError();
}

cudaError_t launch_transpose_tiles_fp8(const TransposeTilesFp8Args& a, cudaStream_t stream) {
  if (a.num_mats == 0 || a.rows == 0 || a.cols == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(a.cols / kTile), static_cast<unsigned>(a.rows / kTile),
                  static_cast<unsigned>(a.num_mats));
  transpose_tiles_fp8_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const uint8_t*>(a.q), a.rows, a.cols,
                                                            static_cast<uint8_t*>(a.qt));
  return cudaGetLastError();
}

void transpose_tiles_fp8_host(const TransposeTilesFp8Args& a) {
  const auto* q = static_cast<const uint8_t*>(a.q);
  auto* qt = static_cast<uint8_t*>(a.qt);
  for (int64_t m = 0; m < a.num_mats; ++m)
    for (int64_t r = 0; r < a.rows; ++r)
      for (int64_t c = 0; c < a.cols; ++c) qt[(m * a.cols + c) * a.rows + r] = q[(m * a.rows + r) * a.cols + c];
}

void quantize_weight_fp8_host(const QuantizeWeightFp8Args& a) {
  const auto* w = static_cast<const __nv_bfloat16*>(a.w);
  auto* q = static_cast<uint8_t*>(a.q);
  const int64_t tiles_r = a.rows / kTile, tiles_c = a.cols / kTile;
  for (int64_t m = 0; m < a.num_mats; ++m) {
    for (int64_t tr = 0; tr < tiles_r; ++tr) {
      for (int64_t tc = 0; tc < tiles_c; ++tc) {
        float amax = 0.0f;
        for (int64_t r = tr * kTile; r < (tr + 1) * kTile; ++r)
          for (int64_t c = tc * kTile; c < (tc + 1) * kTile; ++c)
            amax = std::max(amax, std::fabs(__bfloat162float(w[(m * a.rows + r) * a.cols + c])));
        const float s = fp8_block_scale(amax, a.pow2_scales);
        a.scale[(m * tiles_r + tr) * tiles_c + tc] = s;
        for (int64_t r = tr * kTile; r < (tr + 1) * kTile; ++r)
          for (int64_t c = tc * kTile; c < (tc + 1) * kTile; ++c) {
            q[(m * a.rows + r) * a.cols + c] =
                e4m3_bits_host(fp32_div_rn(__bfloat162float(w[(m * a.rows + r) * a.cols + c]), s));
          }
      }
    }
  }
}

}  // namespace prime_kernels::common
