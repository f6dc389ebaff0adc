// prime-kernels: pieces shared by the sm90 grouped-GEMM kernels (no __global__ here).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "ptx.cuh"

namespace deep_gemm {
namespace sm90 {

// Largest number of groups (experts) one launch accepts: offsets and per-group tile starts live in
// shared memory.
constexpr int kMaxGroups = 1024;

// Thread roles: warpgroup 0 = producer (one elected thread issues TMA), warpgroups 1 and 2 = consumers.
constexpr int kNumThreads = 384;
constexpr int kNumConsumerThreads = 256;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;

// Named barrier ids (0 is __syncthreads).
constexpr uint32_t kBarEpilogueWg0 = 1;  // +wg
constexpr uint32_t kBarConsumers = 3;

// Epilogue staging: each consumer warpgroup owns 64 rows x 64 columns of bf16 with a 16-byte row pad
// (pitch 144 B keeps both the fragment writes and the 16-byte row reads free of bank conflicts).
constexpr int kStagePitchBytes = (64 + 8) * 2;
constexpr int kStageBytesPerWg = 64 * kStagePitchBytes;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int align_up(int a, int b) { return ceil_div(a, b) * b; }

__device__ __forceinline__ uint8_t* align_smem_1024(uint8_t* p) {
  const uint32_t a = ptx::smem_addr(p);
  return p + ((1024 - (a & 1023)) & 1023);
}

// Writes the 64 x kBlockN fp32 accumulator fragment of one consumer warpgroup (wgmma m64nN layout) as
// bf16 to global memory, through a 64-column shared-memory staging tile, with 16-byte coalesced stores.
// Rows >= row_limit and columns >= col_limit are not written.
//   out:        pointer to element (row 0, col 0) of the output matrix, row stride ldo elements.
//   row0/col0:  first row/column of this warpgroup's 64 x kBlockN block.
template <int kBlockN>
__device__ __forceinline__ void store_acc_bf16_staged(const float (&acc)[kBlockN / 2], uint32_t stage_addr,
                                                      uint32_t bar_id, int wg_tid, __nv_bfloat16* out,
                                                      int64_t ldo, int row0, int row_limit, int col0,
                                                      int col_limit) {
  const int warp_in_wg = wg_tid >> 5;
  const int lane = wg_tid & 31;
  const int frag_row = warp_in_wg * 16 + (lane >> 2);
  const int frag_col = (lane & 3) * 2;
#pragma unroll
  for (int c = 0; c < kBlockN / 64; ++c) {
    if (col0 + c * 64 >= col_limit) break;  // uniform across the warpgroup
    ptx::named_bar_sync(bar_id, 128);       // earlier reads of the staging tile are done
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const int j = c * 8 + jj;
      const uint32_t a0 = stage_addr + frag_row * kStagePitchBytes + (jj * 8 + frag_col) * 2;
      ptx::st_shared_b32(a0, ptx::pack_bf16x2(acc[4 * j + 0], acc[4 * j + 1]));
      ptx::st_shared_b32(a0 + 8 * kStagePitchBytes, ptx::pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]));
    }
    ptx::named_bar_sync(bar_id, 128);
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const int idx = it * 128 + wg_tid;
      const int r = idx >> 3;
      const int ch = idx & 7;
      const int grow = row0 + r;
      const int gcol = col0 + c * 64 + ch * 8;
      if (grow < row_limit && gcol < col_limit) {
        const uint4 v = ptx::ld_shared_v4(stage_addr + r * kStagePitchBytes + ch * 16);
        *reinterpret_cast<uint4*>(out + static_cast<int64_t>(grow) * ldo + gcol) = v;
      }
    }
  }
}


// ---- asynchronous epilogue -------------------------------------------------------------------------
// The consumers write their bf16 tile into a full-tile staging buffer (pitch kBlockN*2 + 16 bytes, which
// keeps the fragment writes and the 16-byte row reads free of bank conflicts) and go straight on to the
// next tile's mainloop; the otherwise idle warps 1..3 of the producer warpgroup copy the staging buffer to
// global memory. Two mbarriers hand the buffer back and forth (full: 8 consumer warps arrive; empty: the 3
// store warps arrive).
constexpr int kNumStoreWarps = 3;
template <int kBlockN>
struct AsyncStaging {
  static constexpr int kPitch = kBlockN * 2 + 16;
  static constexpr int kBytes = 128 * kPitch;
};

// Consumer side: one warpgroup's 64 x kBlockN fp32 fragment -> bf16 rows [64*wg, 64*wg + 64) of the buffer.
template <int kBlockN>
__device__ __forceinline__ void write_acc_to_staging(const float (&acc)[kBlockN / 2], uint32_t staging,
                                                     int wg, int wg_tid) {
  constexpr int kPitch = AsyncStaging<kBlockN>::kPitch;
  const int lane = wg_tid & 31;
  const int row = wg * 64 + (wg_tid >> 5) * 16 + (lane >> 2);
  const uint32_t base = staging + row * kPitch + (lane & 3) * 4;
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j) {
    ptx::st_shared_b32(base + j * 16, ptx::pack_bf16x2(acc[4 * j + 0], acc[4 * j + 1]));
    ptx::st_shared_b32(base + 8 * kPitch + j * 16, ptx::pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]));
  }
}

// Store-warp side: copies the 128 x kBlockN staging tile to out (row stride ldo), skipping rows >= row_limit
// and columns >= col_limit. row0/col0: tile origin in out. idx0 in [0, 32 * kNumStoreWarps).
template <int kBlockN>
__device__ __forceinline__ void copy_staging_to_global(uint32_t staging, int idx0, __nv_bfloat16* out, int64_t ldo,
                                                       int row0, int row_limit, int col0, int col_limit) {
  constexpr int kPitch = AsyncStaging<kBlockN>::kPitch;
  constexpr int kChunksPerRow = kBlockN / 8;
  constexpr int kTotal = 128 * kChunksPerRow;
  constexpr int kStride = 32 * kNumStoreWarps;
  const int rows = min(row_limit - row0, 128);
  const int cols = min(col_limit - col0, kBlockN);
  const int total = rows > 0 ? rows * kChunksPerRow : 0;
#pragma unroll 4
  for (int idx = idx0; idx < total && idx < kTotal; idx += kStride) {
    const int r = idx / kChunksPerRow;
    const int ch = idx - r * kChunksPerRow;
    if (ch * 8 < cols) {
      const uint4 v = ptx::ld_shared_v4(staging + r * kPitch + ch * 16);
      *reinterpret_cast<uint4*>(out + static_cast<int64_t>(row0 + r) * ldo + col0 + ch * 8) = v;
    }
  }
}

}  // namespace sm90
}  // namespace deep_gemm
