// prime-kernels: the sm90 kernels' epilogues: accumulator fragments staged in shared memory and stored to global
// memory (plain stores or TMA stores) or stored straight from the registers, the SwiGLU epilogues' stores, and the L2
// cache policies of the hint bits (no __global__ here).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "kernel_common.cuh"
#include "ptx.cuh"
#include "swiglu_math.cuh"

namespace prime_kernels {
namespace sm90 {

// ---- asynchronous epilogue: TMA stores from a 128B-swizzled staging tile ---------------------------
// Each consumer warpgroup owns a 64-row half of a full-tile staging buffer, laid out as kBlockN / 64 boxes
// of 64 rows x 64 columns (8 KB each, 128-byte rows, 16-byte chunks XOR-swizzled by row % 8: the layout a
// 128B-swizzled tensor map reads). The warpgroup writes its fp32 fragment there as bf16 with stmatrix, and
// one elected thread issues one TMA store per box and goes on with the next tile's mainloop; the store's
// shared-memory read is waited for only before the next tile's epilogue rewrites the half. Halves whose
// rows are not all inside the group (a group's tail m-block: the rows after it belong to the next group,
// and a TMA store writes whole boxes) are copied out by the warpgroup's threads instead.
template <int kBlockN>
struct TmaStaging {
  static constexpr int kBoxBytes = 64 * 128;               // 64 rows x 64 bf16 columns
  static constexpr int kHalfBytes = (kBlockN / 64) * kBoxBytes;  // one warpgroup's 64 rows
  static constexpr int kBytes = 2 * kHalfBytes;
};

// Plain bf16 rounding (round to nearest even) of two fp32 values into one bf16x2 word.
struct PackBf16x2 {
  __device__ __forceinline__ uint32_t operator()(float lo, float hi) const { return ptx::pack_bf16x2(lo, hi); }
};

template <int kBlockN, int kBoxes, typename Pack = PackBf16x2>
__device__ __forceinline__ void write_acc_boxes_to_staging(const float (&acc)[kBlockN / 2], uint32_t stg_half,
                                                           int wg_tid, int box0, const Pack& pack = Pack{}) {
  const int lane = wg_tid & 31;
  const int mi = lane >> 3;
  const int ri = lane & 7;
  const int row = (wg_tid >> 5) * 16 + ((mi & 1) << 3) + ri;
  const uint32_t base = stg_half + row * 128;
  const uint32_t x = static_cast<uint32_t>(((mi >> 1) ^ ri) << 4);
#pragma unroll
  for (int jq = 0; jq < kBoxes * 4; ++jq) {
    const int jp = box0 * 4 + jq;  // 16-column group of the fragment
    const int j0 = 2 * jp;
    const uint32_t addr = base + (jq >> 2) * TmaStaging<64 * kBoxes>::kBoxBytes +
                          ((static_cast<uint32_t>((jq & 3) * 2) << 4) ^ x);
    ptx::stmatrix_x4(addr, pack(acc[4 * j0 + 0], acc[4 * j0 + 1]), pack(acc[4 * j0 + 2], acc[4 * j0 + 3]),
                     pack(acc[4 * j0 + 4], acc[4 * j0 + 5]), pack(acc[4 * j0 + 6], acc[4 * j0 + 7]));
  }
}

// One warpgroup's 64 x kBlockN fp32 fragment (wgmma m64nN layout) -> bf16 into its swizzled staging half.
template <int kBlockN>
__device__ __forceinline__ void write_acc_to_swizzled_staging(const float (&acc)[kBlockN / 2], uint32_t stg_half,
                                                              int wg_tid) {
  write_acc_boxes_to_staging<kBlockN, kBlockN / 64>(acc, stg_half, wg_tid, 0);
}

// The shared-memory address of 16-byte chunk ch (columns 8 ch..) of row r of a swizzled staging half.
template <int kBlockN>
__device__ __forceinline__ uint32_t staging_chunk_addr(uint32_t stg_half, int r, int ch) {
  return stg_half + (ch >> 3) * TmaStaging<kBlockN>::kBoxBytes + r * 128 + (((ch & 7) ^ (r & 7)) << 4);
}

// Copies rows [0, rows) of a swizzled staging half to out (row stride ldo), columns col0.. below col_limit,
// with the warpgroup's 128 threads (16-byte loads and stores). kSplit (SwiGLU h): the left half of the
// tile's columns goes to out columns col0.., the right half to col_limit + col0.., each below col_limit.
template <int kBlockN, bool kSplit = false>
__device__ __forceinline__ void copy_swizzled_half_to_global(uint32_t stg_half, int wg_tid, int rows,
                                                             __nv_bfloat16* out, int64_t ldo, int row0,
                                                             int col0, int col_limit) {
  constexpr int kChunksPerRow = kBlockN / 8;
  const int total = rows * kChunksPerRow;
#pragma unroll 2
  for (int idx = wg_tid; idx < total; idx += 128) {
    const int r = idx / kChunksPerRow;
    const int ch = idx - r * kChunksPerRow;
    const bool right = kSplit && ch >= kChunksPerRow / 2;
    const int c = col0 + (right ? ch - kChunksPerRow / 2 : ch) * 8;
    const int gcol = c + (right ? col_limit : 0);
    if (c < col_limit) {
      const uint4 v = ptx::ld_shared_v4(staging_chunk_addr<kBlockN>(stg_half, r, ch));
      *reinterpret_cast<uint4*>(out + static_cast<int64_t>(row0 + r) * ldo + gcol) = v;
    }
  }
}

// Copies rows [0, rows) of a swizzled staging half (pool rows row0..) to their routes' rows of their source ranks'
// buffers: pool row m goes to slots[src_rank[m]] + src_route[m] * ld (src_rank null: rank 0), columns col0..;
// rows with src_route outside [0, num_routes) (padding; a bad route, which the dispatch reports) and columns >=
// col_limit are skipped; ranks are clamped to [0, num_ranks). The warpgroup's 128 threads, 16-byte loads and stores.
template <int kBlockN>
__device__ __forceinline__ void copy_swizzled_half_to_routes(uint32_t stg_half, int wg_tid, int rows,
                                                             const int32_t* src_route, const int32_t* src_rank,
                                                             int num_routes, __nv_bfloat16* const* slots,
                                                             int num_ranks, int64_t ld, int row0, int col0,
                                                             int col_limit) {
  constexpr int kChunksPerRow = kBlockN / 8;
  const int total = rows * kChunksPerRow;
#pragma unroll 2
  for (int idx = wg_tid; idx < total; idx += 128) {
    const int r = idx / kChunksPerRow;
    const int ch = idx - r * kChunksPerRow;
    const int route = __ldg(src_route + row0 + r);
    if (route >= 0 && route < num_routes && col0 + ch * 8 < col_limit) {
      const int rank = src_rank != nullptr ? min(max(__ldg(src_rank + row0 + r), 0), num_ranks - 1) : 0;
      const uint4 v = ptx::ld_shared_v4(staging_chunk_addr<kBlockN>(stg_half, r, ch));
      *reinterpret_cast<uint4*>(slots[rank] + static_cast<int64_t>(route) * ld + col0 + ch * 8) = v;
    }
  }
}

// L2 cache policies for the kernels' hint bits (MegaFwdParams, MGroupedParams, KGroupedParams::l2_hints): bit 3
// asks evict_last for the loads that many tiles read again (the weights; the k-grouped GEMM's operands); bit `bit`
// (0-2) evict_first for one kind of output store. A clear bit gives evict_normal, i.e. no preference.
__device__ __forceinline__ uint64_t l2_policy_reused_loads(int32_t hints) {
  return (hints & 8) ? ptx::l2_policy_evict_last() : ptx::l2_policy_evict_normal();
}
__device__ __forceinline__ uint64_t l2_policy_store(int32_t hints, int bit) {
  return ((hints >> bit) & 1) ? ptx::l2_policy_evict_first() : ptx::l2_policy_evict_normal();
}

// The asynchronous epilogue of one consumer warpgroup's 64-row half of an m-grouped tile (rows hrow0.., columns
// col0.. of d, bf16): waits until the previous tile's TMA store has read the staging half, writes the fragment into
// it, and stores it with one TMA store per 64-column box (evict_first when bit 0 of l2_hints is set) when all 64 rows
// lie inside the group; a group's tail half is copied out by the warpgroup's threads instead (rows >= row_end
// belong to the next group, and a TMA store writes whole boxes). Columns >= n are not written.
template <int kBlockN>
__device__ __forceinline__ void store_acc_half_async(const float (&acc)[kBlockN / 2], uint32_t stg_half, int wg,
                                                     int wg_tid, const void* tmap_d, int hrow0, int row_end, int col0,
                                                     int n, int32_t l2_hints, __nv_bfloat16* d, int64_t ldd) {
  if (wg_tid == 0) ptx::bulk_wait_group_read<0>();
  ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
  write_acc_to_swizzled_staging<kBlockN>(acc, stg_half, wg_tid);
  ptx::fence_proxy_async_smem();  // make the generic-proxy writes visible to the TMA engine
  ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
  if (hrow0 + 64 <= row_end) {
    if (wg_tid == 0) {
#pragma unroll
      for (int b = 0; b < kBlockN / 64; ++b)
        if (col0 + 64 * b < n)
          ptx::tma_store_2d_hint(tmap_d, stg_half + b * TmaStaging<kBlockN>::kBoxBytes, col0 + 64 * b, hrow0,
                                 l2_policy_store(l2_hints, 0));
      ptx::bulk_commit_group();
    }
  } else {
    copy_swizzled_half_to_global<kBlockN>(stg_half, wg_tid, row_end - hrow0, d, ldd, hrow0, col0, n);
  }
}

// One warpgroup's 64 x kBlockN fp32 fragment into its staging half as fp32: kBlockN / 32 boxes of 64 rows x 32
// columns (8 KB, 128-byte rows, chunks XOR-swizzled by row % 8 as above). A thread's column pair of one row is one
// 8-byte store; a warp's stores of one column group cover 16 chunks of 8 rows, two of each bank group.
template <int kBlockN>
__device__ __forceinline__ void write_acc_f32_to_swizzled_staging(const float (&acc)[kBlockN / 2], uint32_t stg_half,
                                                                  int wg_tid) {
  const int lane = wg_tid & 31;
  const int q = lane & 3;
  const int r = (wg_tid >> 5) * 16 + (lane >> 2);  // and r + 8: the same row % 8
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j) {
    const uint32_t chunk = static_cast<uint32_t>((2 * (j & 3) + (q >> 1)) ^ (r & 7));
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const uint32_t addr = stg_half + (j >> 2) * TmaStaging<kBlockN>::kBoxBytes + (r + 8 * hh) * 128 + (chunk << 4) +
                            (q & 1) * 8;
      ptx::st_shared_v2_f32(addr, acc[4 * j + 2 * hh], acc[4 * j + 2 * hh + 1]);
    }
  }
}

// ---- synchronous epilogue: plain stores from the registers -------------------------------------------
// The k-grouped kernels' outputs (C_e [M, N] per expert, contiguous): fp32 stored, fp32 added into what C holds
// (a weight-gradient accumulator: each element is read and written by its one owner thread, so no atomics), or bf16
// stored. Registers go out as 8-byte (fp32) or 4-byte (bf16) pairs straight from the wgmma fragment: a tile is
// written once, after its whole K, so staging it for TMA buys little against the k-loop.
enum KGroupedOut : int { kOutF32Store = 0, kOutF32Accumulate = 1, kOutBf16Store = 2 };

// The asynchronous epilogue of a k-grouped kernel's consumer warpgroup (its 64-row half of a tile of C_g, rows
// row0.. and columns col0.. of expert g's [M, N]): waits until the previous tile's TMA operations have read the
// staging half, writes the fragment there (bf16 for kOutBf16Store, else fp32) and issues one TMA store (fp32 add for
// kOutF32Accumulate) per box. tmap_c is C as [E][M][N] with boxes of 64 rows and 128 bytes of columns, so rows >= M
// and columns >= N of a box are not written and no box reaches into the next expert.
template <int kBlockN, int kOut>
__device__ __forceinline__ void store_k_grouped_half_async(const float (&acc)[kBlockN / 2], uint32_t stg_half, int wg,
                                                           int wg_tid, const void* tmap_c, int group, int row0,
                                                           int col0, int n) {
  constexpr int kBoxCols = kOut == kOutBf16Store ? 64 : 32;
  if (wg_tid == 0) ptx::bulk_wait_group_read<0>();
  ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
  if constexpr (kOut == kOutBf16Store)
    write_acc_to_swizzled_staging<kBlockN>(acc, stg_half, wg_tid);
  else
    write_acc_f32_to_swizzled_staging<kBlockN>(acc, stg_half, wg_tid);
  ptx::fence_proxy_async_smem();  // make the generic-proxy writes visible to the TMA engine
  ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
  if (wg_tid == 0) {
#pragma unroll
    for (int b = 0; b < kBlockN / kBoxCols; ++b) {
      if (col0 + kBoxCols * b >= n) continue;
      const uint32_t src = stg_half + b * TmaStaging<kBlockN>::kBoxBytes;
      if constexpr (kOut == kOutF32Accumulate)
        ptx::tma_reduce_add_3d(tmap_c, src, col0 + kBoxCols * b, row0, group);
      else
        ptx::tma_store_3d(tmap_c, src, col0 + kBoxCols * b, row0, group);
    }
    ptx::bulk_commit_group();
  }
}

// One consumer warpgroup's 64 x kBlockN fragment (wgmma m64nN layout) into rows row0.. and columns col0.. of c
// (row stride ld elements; fp32 for kOutF32*, bf16 for kOutBf16Store). Rows >= m and columns >= n are not written.
template <int kBlockN, int kOut>
__device__ __forceinline__ void store_acc_rows_direct(const float (&acc)[kBlockN / 2], void* c, int64_t ld, int row0,
                                                      int col0, int wg_tid, int m, int n) {
  const int lane = wg_tid & 31;
  const int fr = row0 + (wg_tid >> 5) * 16 + (lane >> 2);
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j) {
    const int col = col0 + j * 8 + (lane & 3) * 2;
    if (col < n) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = fr + 8 * h;
        if (row < m) {
          const int64_t at = static_cast<int64_t>(row) * ld + col;
          if constexpr (kOut == kOutBf16Store) {
            *reinterpret_cast<uint32_t*>(reinterpret_cast<__nv_bfloat16*>(c) + at) =
                ptx::pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
          } else {
            float2* ptr = reinterpret_cast<float2*>(reinterpret_cast<float*>(c) + at);
            float2 v = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            if constexpr (kOut == kOutF32Accumulate) {
              const float2 o = *ptr;
              v.x += o.x;
              v.y += o.y;
            }
            *ptr = v;
          }
        }
      }
    }
  }
}

// SwiGLU epilogue: s[row, c] = silu(gate) * up for one warpgroup's 64 x kBlockN fragment whose left kBlockN / 2
// columns are gate columns col0.. and right ones the matching up columns, already rounded as the kernel saves h
// (round_acc_as_saved_h); fp32 math, bf16x2 stores straight from registers (s is a third of the tile's output
// bytes; L2 merges the 16-byte row pieces). Rows >= row_end and columns >= col_limit are not written.
template <int kBlockN>
__device__ __forceinline__ void store_swiglu_from_acc(const float (&acc)[kBlockN / 2], int wg_tid, __nv_bfloat16* s,
                                                      int64_t lds, int row0, int row_end, int col0, int col_limit,
                                                      float clamp) {
  constexpr int kUp = kBlockN / 16;  // accumulator column group of the up half
  const int lane = wg_tid & 31;
  const int r0 = row0 + (wg_tid >> 5) * 16 + (lane >> 2);
  const int cbase = col0 + 2 * (lane & 3);
  auto f = [&](float g, float u) -> float { return swiglu_value(g, u, clamp); };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + 8 * h;
    if (row < row_end) {
      __nv_bfloat16* srow = s + static_cast<int64_t>(row) * lds;
#pragma unroll
      for (int j = 0; j < kBlockN / 16; ++j) {
        const int col = cbase + 8 * j;
        if (col < col_limit) {
          const uint32_t v = ptx::pack_bf16x2(f(acc[4 * j + 2 * h], acc[4 * (j + kUp) + 2 * h]),
                                              f(acc[4 * j + 2 * h + 1], acc[4 * (j + kUp) + 2 * h + 1]));
          *reinterpret_cast<uint32_t*>(srow + col) = v;
        }
      }
    }
  }
}

}  // namespace sm90
}  // namespace prime_kernels
