// prime-kernels: what every sm90 kernel here shares before its roles split: the CTA's thread roles and register
// split, the named barrier ids, integer helpers, the tile order within an expert (band_tile) and the groups'
// offsets and first m-blocks in shared memory, the k-grouped kernels' tile order (no __global__ here).
#pragma once

#include <cstdint>

#include "ptx.cuh"

namespace prime_kernels {
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

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int align_up(int a, int b) { return ceil_div(a, b) * b; }

// The tile order within one expert of the m-grouped kernels and the fused forward: n-block major, m-block fastest,
// in bands of at most kMBand m-blocks (every n-block of a band runs before the next band). Concurrent tiles share
// the expert's B slice and a band's A rows, and a band's A (16 x 128 rows: 3-16 MB at the layer shapes) stays in
// L2 while each of its n-blocks reads it. Without bands, an expert with far more rows than L2 holds (Zipf routing:
// one expert with ~15K of 16K tokens) had its A rows re-read from HBM once per n-block. An expert of at most
// kMBand m-blocks (every expert under uniform routing at the layer shapes) keeps the plain order.
constexpr int kMBand = 16;
__host__ __device__ __forceinline__ void band_tile(int local, int m_blocks, int n_blocks, int& nb, int& mb) {
  const int band = local / (kMBand * n_blocks);
  const int m0 = band * kMBand;
  const int band_rows = min(kMBand, m_blocks - m0);
  const int rem = local - band * kMBand * n_blocks;
  nb = rem / band_rows;
  mb = m0 + (rem - nb * band_rows);
}

// Warp-wide exclusive scan over groups (call from one whole warp): out[g] = sum of count(g') over g' < g for
// g in [0, num_groups), and out[num_groups] = the total. count(g) is evaluated by lane g % 32.
template <typename CountFn>
__device__ __forceinline__ void warp_exclusive_scan_groups(int num_groups, int lane, int32_t* out, CountFn count) {
  int running = 0;
  for (int base = 0; base < num_groups; base += 32) {
    const int g = base + lane;
    const int cnt = g < num_groups ? count(g) : 0;
    int incl = cnt;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int o = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += o;
    }
    if (g < num_groups) out[g] = running + incl - cnt;
    running += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) out[num_groups] = running;
}

// The m-grouped kernels' static tile list (m_grouped_gemm.cuh, m_grouped_gemm_fp8.cuh): tiles are numbered
// group-major, then by band_tile within the group. One warp: s_tile[g] = the first tile of group g (the sum over
// g' < g of its kBlockM-row m-blocks times n_blocks), s_tile[num_groups] = the number of tiles, or 0 when
// bad_offsets (the list is then empty, so no role of any CTA stores anything).
template <int kBlockM>
__device__ __forceinline__ void m_grouped_tile_starts(const int32_t* s_offs, int32_t* s_tile, int num_groups,
                                                      int n_blocks, bool bad_offsets, int lane) {
  warp_exclusive_scan_groups(num_groups, lane, s_tile, [&](int g) {
    return ceil_div(max(s_offs[g + 1] - s_offs[g], 0), kBlockM) * n_blocks;
  });
  if (bad_offsets && lane == 0) s_tile[num_groups] = 0;
}

// Tile u of that list.
struct MGroupedWork {
  int b_group;  // group whose B tile is loaded
  int row0;     // first A row loaded (and stored)
  int row_end;  // rows >= row_end are not stored
  int n0;       // first output column
};
// Each role walks its units in increasing order, so the group cursor g (0 before the first call) only moves
// forward. tile_cols: output columns per n-block.
template <int kBlockM>
__device__ __forceinline__ MGroupedWork m_grouped_locate(const int32_t* s_offs, const int32_t* s_tile, int n_blocks,
                                                         int tile_cols, int u, int& g) {
  while (s_tile[g + 1] <= u) ++g;
  const int start = s_offs[g];
  const int end = max(s_offs[g + 1], start);
  const int m_blocks = ceil_div(end - start, kBlockM);
  int nb, mb;
  band_tile(u - s_tile[g], m_blocks, n_blocks, nb, mb);
  return MGroupedWork{g, start + mb * kBlockM, end, nb * tile_cols};
}

// The k-grouped kernels' tile order (k_grouped_gemm.cuh, k_grouped_gemm_fp8.cuh). Every expert has the same number
// of tiles but not the same cost (cost ~ its row count, the reduction length), so experts are ranked by decreasing
// row count and CTAs take tiles in a serpentine order over rounds of gridDim.x tiles: heavy tiles first, spread over
// all CTAs. Whole CTA, no barrier: s_order[rank] = expert, ties by index.
__device__ __forceinline__ void k_grouped_rank_experts(const int32_t* s_offs, int32_t* s_order, int num_groups) {
  for (int e = threadIdx.x; e < num_groups; e += kNumThreads) {
    const int rows_e = max(s_offs[e + 1] - s_offs[e], 0);
    int rank = 0;
    for (int f = 0; f < num_groups; ++f) {
      const int rows_f = max(s_offs[f + 1] - s_offs[f], 0);
      rank += (rows_f > rows_e) || (rows_f == rows_e && f < e);
    }
    s_order[rank] = e;
  }
}

// Tile t of the ranked list: expert slot-major (tiles_per_group = m_blocks * n-blocks), then n-block, m-block fastest.
struct KGroupedTile {
  int group, k_start, rows, m0, n0;
};
template <int kBlockM, int kBlockN>
__device__ __forceinline__ KGroupedTile k_grouped_locate(const int32_t* s_offs, const int32_t* s_order,
                                                         int tiles_per_group, int m_blocks, int t) {
  const int slot = t / tiles_per_group;
  const int local = t - slot * tiles_per_group;
  const int e = s_order[slot];
  const int start = s_offs[e];
  const int rows = max(s_offs[e + 1] - start, 0);
  const int nb = local / m_blocks;
  const int mb = local - nb * m_blocks;
  return KGroupedTile{e, start, rows, mb * kBlockM, nb * kBlockN};
}

// The i-th tile of this CTA (serpentine over rounds of `grid` tiles); may be >= the number of tiles (none).
__device__ __forceinline__ int k_grouped_tile_of(int i, int grid) {
  const int round_base = i * grid;
  return round_base + ((i & 1) ? (grid - 1 - (int)blockIdx.x) : (int)blockIdx.x);
}

// Whole CTA (kNumThreads threads): the groups' offsets as given, group_offsets[0..num_groups], into s_offs in shared
// memory (for a kernel that checked them already, or that reads them only through max(rows, 0)); ends with a
// __syncthreads.
__device__ __forceinline__ void load_group_offsets(const int32_t* group_offsets, int num_groups, int32_t* s_offs) {
  for (int i = threadIdx.x; i <= num_groups; i += kNumThreads) s_offs[i] = __ldg(group_offsets + i);
  __syncthreads();
}

// Whole CTA (kNumThreads threads): the groups' first pool rows, clamped to [0, m_total], into s_offs[0..num_groups]
// and each group's first kBlockM-row m-block into s_mb[0..num_groups] (s_mb[num_groups]: all m-blocks), both in
// shared memory; ends with a __syncthreads.
template <int kBlockM>
__device__ __forceinline__ void load_group_offsets_and_mblocks(const int32_t* group_offsets, int num_groups,
                                                               int m_total, int32_t* s_offs, int32_t* s_mb) {
  const int tid = threadIdx.x;
  for (int i = tid; i <= num_groups; i += kNumThreads) s_offs[i] = min(max(__ldg(group_offsets + i), 0), m_total);
  __syncthreads();
  if ((tid >> 5) == 0)
    warp_exclusive_scan_groups(num_groups, tid & 31, s_mb,
                               [&](int g) { return ceil_div(max(s_offs[g + 1] - s_offs[g], 0), kBlockM); });
  __syncthreads();
}

}  // namespace sm90
}  // namespace prime_kernels
