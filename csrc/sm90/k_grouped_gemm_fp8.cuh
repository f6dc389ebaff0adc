// prime-kernels: sm90a k-grouped GEMM with blockwise-scaled FP8 (e4m3) operands (weight gradients).
//
//   C_e[m, n] (+)= sum over the 128-row blocks kb of expert e's token rows:
//                  (A_t[m, kb] . B_t[n, kb]) * sa[kb, m] * sb[kb, n]
//
//   The token axis is the reduction axis. sm90's FP8 wgmma reads both operands K-major only, so the operands are
//   stored transposed, token axis contiguous: A_t [M, P] and B_t [N, P] e4m3 (row strides lda, ldb bytes), P the
//   pool's rows. They are the recipe's qT operands (docs/fp8.md: one fp32 scale per column and 128 rows of the
//   token axis) as the producing epilogue or dispatch writes them: sa[kb * ld_sa + m] and sb[kb * ld_sb + n], one
//   row of M (N) scales per 128-row block of the pool, i.e. the m-grouped FP8 kernel's K-block-major A scales. The
//   128 scales of one tile's rows (columns) for one k-block are 512 contiguous bytes: one TMA box each, next to the
//   A and B tiles they scale, completing on the same mbarrier.
//   C [E, M, N] contiguous, 16-byte aligned, M and N multiples of 8: fp32 stored, fp32 added into (the
//   weight-gradient accumulator: a TMA reduction, one add per element, so the bits of a load, add and store), or bf16
//   stored.
//
//   offs: device int32 [E+1], non-decreasing within [0, P], and every entry a multiple of 128 or P: each expert
//   starts on a whole 128-row scale block, so no scale block straddles two experts (the routing plan's pool pads
//   every expert to a multiple of block_m = 128 with zero rows, which gives exactly this). An expert's last block
//   is then whole, or ends at P, past which the TMA loads zeros: no k-block needs masking. Every CTA checks the rule
//   in its prologue, before any store; offsets that break it make the whole kernel write nothing (a device-check
//   finding, common/device_check.hpp). An expert with no rows gives C_e = 0, or leaves C_e untouched when adding.
//
// Structure: the m-grouped FP8 kernel's (m_grouped_gemm_fp8.cuh) with the BF16 k-grouped kernel's tile order
// (k_grouped_rank_experts / k_grouped_locate / k_grouped_tile_of, kernel_common.cuh: experts by decreasing row
// count, serpentine over rounds). Persistent, warp-specialized, one CTA per SM, 384 threads; 128 x 128 tiles of C,
// 128 token rows per k-block. Warpgroup 0's elected thread loads A_t, B_t (128 rows of 128 bytes each) and the two
// 512-byte scale rows into a kNumStages ring; warpgroups 1 and 2 own 64 rows each: four m64n128k32 e4m3 wgmma per
// k-block into one of two partial accumulators, then acc = fma(part, sa[row] * sb[col], acc) while the next
// k-block's wgmma run (consumer_tile_mainloop_promoted with promote_rows_cols, mainloop.cuh). Unlike the m-grouped
// kernel both operands are scaled per row of C, so B's scales are read per column from the stage (16 float2 per
// thread and k-block) rather than one value per tile. The epilogue stages each warpgroup's half tile in shared
// memory and writes it with TMA stores (store_k_grouped_half_async, epilogue.cuh) while the next tile's mainloop
// runs: an expert of 1024 token rows gives a tile only 8 k-blocks, too few to hide register stores behind.
//
// Forward progress: a CTA never waits on another CTA. Its tiles are fixed by its index and gridDim.x alone, each
// computed start to end (all of its expert's k-blocks, in order) by that CTA, so any grid size (the num_sms cap)
// gives the same bits. The only waits are on the CTA's own mbarriers (bounded in debug builds, PK_DEBUG_SPIN_BOUND),
// on named barriers of one consumer warpgroup, which all of its threads reach once per tile, and on the completion of
// the CTA's own TMA stores.
#pragma once

#include <cuda.h>

#include "common/device_check.hpp"
#include "epilogue.cuh"
#include "kernel_common.cuh"
#include "mainloop.cuh"
#include "pipeline.cuh"

namespace prime_kernels {
namespace sm90 {

// The scale block along the token axis, and the alignment of the experts' first rows.
constexpr int kFp8TokenBlock = 128;

struct KGroupedFp8Params {
  const int32_t* group_offsets;
  int32_t p_total;
  int32_t m;
  int32_t n;
  int32_t num_groups;
  // The tile grid (ceil(m / 128), tiles per expert, all tiles), set by the host: read from the parameter bank where
  // used, they take no registers from the consumers' mainloop.
  int32_t m_blocks;
  int32_t tiles_per_group;
  int32_t num_tiles;
  // L2 cache hints (kKGroupedL2Hints): bit 3: the A and B loads evict_last (every tile of an expert re-reads them).
  int32_t l2_hints;
  // Where the kernel notes invalid offsets (may be null: they still make it write nothing).
  common::DeviceCheckRecord* check;
};

// The stage ring for an output kind: kOutBf16Store 5 stages (the 32 KB staging tile fits beside them), fp32 outputs
// 4 (their staging tile is 64 KB).
constexpr int k_grouped_fp8_stages(int out_kind) { return out_kind == kOutBf16Store ? 5 : 4; }

template <int kNumStages, int kOut>
struct KGroupedFp8Layout : StageRingLayout<128, 128, kFp8TokenBlock, kNumStages, 1> {
  using Ring = StageRingLayout<128, 128, kFp8TokenBlock, kNumStages, 1>;
  static constexpr int kScaleBytes = 128 * 4;  // one fp32 scale per tile row (column) and stage
  static constexpr int kSaOff = Ring::kRingEnd;
  static constexpr int kSbOff = kSaOff + kNumStages * kScaleBytes;
  // the epilogue's staging tile (TmaStaging's boxes; fp32 boxes hold 32 columns), 1024-aligned for the swizzle
  static constexpr int kStgHalfBytes = (kOut == kOutBf16Store ? 128 / 64 : 128 / 32) * TmaStaging<128>::kBoxBytes;
  static constexpr int kStgOff = (kSbOff + kNumStages * kScaleBytes + 1023) / 1024 * 1024;
  static constexpr int kBarOff = kStgOff + 2 * kStgHalfBytes;
  static constexpr int kOffsOff = kBarOff + (2 * kNumStages + 2) * 8;
  static constexpr int kOrderOff = kOffsOff + (kMaxGroups + 1) * 4;
  static constexpr int kEnd = kOrderOff + kMaxGroups * 4;
  static constexpr int kSmemBytes = kEnd + 1024;
  static constexpr int kStageTxBytes = Ring::kABytes + Ring::kBBytes + 2 * kScaleBytes;
  static_assert(kSmemBytes <= Ring::kSmemLimit, "shared memory budget exceeded");
  static_assert(kSaOff % 128 == 0 && kSbOff % 128 == 0, "TMA destinations are 128-byte aligned");
};

// The consumers' scales object for consumer_tile_mainloop_promoted: a thread's two A row scales and 32 B column
// scales of one k-block, read from the landed stage's two scale rows (nothing to prefetch from global memory).
template <int kBlockM, int kBlockN>
struct KGroupedFp8StageScales {
  const float* sa0;  // stage 0's scale of the thread's first accumulator row (the other is 8 rows on); stage s at
                     // s * kBlockM
  const float* sb0;  // stage 0's scale of its first accumulator column (the others at + 1 and + 8 j); stage s at
                     // s * kBlockN
  __device__ __forceinline__ int prefetch(int) const { return 0; }
  __device__ __forceinline__ void apply(int, int stage, int, const float (&part)[kBlockN / 2],
                                        float (&acc)[kBlockN / 2]) const {
    const float* sa = sa0 + stage * kBlockM;
    const float* sb = sb0 + stage * kBlockN;
    promote_rows_cols<kBlockN / 2>(acc, part, sa[0], sa[8], [&](int j) {
      return *reinterpret_cast<const float2*>(sb + 8 * j);
    });
  }
};

template <int kNumStages, int kOut>
__global__ void __launch_bounds__(kNumThreads, 1)
    k_grouped_fp8_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                              const __grid_constant__ CUtensorMap tmap_sa, const __grid_constant__ CUtensorMap tmap_sb,
                              const __grid_constant__ CUtensorMap tmap_c, const KGroupedFp8Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = KGroupedFp8Layout<kNumStages, kOut>;
  constexpr int kBlockM = L::kBlockM;
  constexpr int kBlockN = L::kBlockN;
  constexpr int kBlockK = L::kBlockK;
  using Mma = ptx::WgmmaFp8E4m3<kBlockN>;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + L::kBarOff);
  uint64_t* empty_bar = full_bar + kNumStages;
  int32_t* s_offs = reinterpret_cast<int32_t*>(smem + L::kOffsOff);
  int32_t* s_order = reinterpret_cast<int32_t*>(smem + L::kOrderOff);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int num_groups = p.num_groups;

  // ---- prologue: offsets check (before anything is stored: bad offsets write nothing), barriers, expert order
  if (common::group_offsets_invalid(p.group_offsets, num_groups, p.p_total, p.check, common::kCheckKGroupedFp8Offsets,
                                    kFp8TokenBlock))
    return;
  kernel_prologue<kNumStages>(full_bar, empty_bar, 1, kNumConsumerThreads / 32, &tmap_a, &tmap_b, &tmap_sa, &tmap_sb,
                               &tmap_c);
  load_group_offsets(p.group_offsets, num_groups, s_offs);
  k_grouped_rank_experts(s_offs, s_order, num_groups);
  __syncthreads();

  auto locate = [&](int t) -> KGroupedTile {
    return k_grouped_locate<kBlockM, kBlockN>(s_offs, s_order, p.tiles_per_group, p.m_blocks, t);
  };

  if (warp < 4) {
    // ================= producer warpgroup =================
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (warp == 0 && lane == 0) {
      const uint64_t pol = l2_policy_reused_loads(p.l2_hints);
      const int grid = gridDim.x;
      int stage = 0;
      uint32_t phase = 0;
      for (int i = 0; i * grid < p.num_tiles; ++i) {
        const int t = k_grouped_tile_of(i, grid);
        if (t >= p.num_tiles) continue;
        const KGroupedTile tile = locate(t);
        const int num_k_blocks = ceil_div(tile.rows, kBlockK);
        const int kb0 = tile.k_start / kBlockK;  // exact: experts start on whole blocks (or have no rows)
        for (int kb = 0; kb < num_k_blocks; ++kb) {
          ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
          ptx::mbar_arrive_expect_tx(&full_bar[stage], L::kStageTxBytes);
          const int krow = tile.k_start + kb * kBlockK;  // token columns past P arrive as zeros
          ptx::tma_load_2d_hint(smem + L::kAOff + stage * L::kABytes, &tmap_a, &full_bar[stage], krow, tile.m0, pol);
          ptx::tma_load_2d_hint(smem + L::kBOff + stage * L::kBBytes, &tmap_b, &full_bar[stage], krow, tile.n0, pol);
          // scale entries past M (N) arrive as zeros; their products are never stored
          ptx::tma_load_2d(smem + L::kSaOff + stage * L::kScaleBytes, &tmap_sa, &full_bar[stage], tile.m0, kb0 + kb);
          ptx::tma_load_2d(smem + L::kSbOff + stage * L::kScaleBytes, &tmap_sb, &full_bar[stage], tile.n0, kb0 + kb);
          advance_stage<kNumStages>(stage, phase);
        }
      }
    }
  } else {
    // ================= consumer warpgroups =================
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const int wg = (warp >> 2) - 1;  // 0 or 1: rows [64*wg, 64*wg + 64) of the tile
    const int wg_tid = tid - 128 * (wg + 1);
    // this thread's accumulator rows within the tile (r and r + 8 of wgmma's m64 fragment) and first column
    const int frag_row = 64 * wg + 16 * ((wg_tid >> 5) & 3) + (lane >> 2);
    const int frag_col = 2 * (lane & 3);
    const StageDescHalves desc = k_major_stage_descs(smem + L::kAOff, smem + L::kBOff, wg);

    const KGroupedFp8StageScales<kBlockM, kBlockN> scales{
        reinterpret_cast<const float*>(smem + L::kSaOff) + frag_row,
        reinterpret_cast<const float*>(smem + L::kSbOff) + frag_col};
    auto release = [&](int s_) {
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(&empty_bar[s_]);
    };

    float acc[kBlockN / 2];
    float part0[kBlockN / 2], part1[kBlockN / 2];
    const int grid = gridDim.x;
    int stage = 0;
    uint32_t phase = 0;
    for (int i = 0; i * grid < p.num_tiles; ++i) {
      const int t = k_grouped_tile_of(i, grid);
      if (t >= p.num_tiles) continue;
      // (the tile is located again for the epilogue: keeping it across the mainloop costs registers it has not)
      const KGroupedTile tile = locate(t);
      const int num_k_blocks = ceil_div(tile.rows, kBlockK);
      if (kOut == kOutF32Accumulate && num_k_blocks == 0) continue;
      // A warpgroup whose 64 rows all lie past M (a last m-block of 64 rows) only keeps the pipeline moving.
      const bool active = tile.m0 + 64 * wg < p.m;
      consumer_tile_mainloop_promoted<Mma, kNumStages, kBlockK, L::kABytes, L::kBBytes>(
          acc, part0, part1, active, num_k_blocks, full_bar, stage, phase, desc.a_lo0, desc.a_hi, desc.b_lo0,
          desc.b_hi, scales, release);
      if (active) {
        const KGroupedTile at = locate(t);
        store_k_grouped_half_async<kBlockN, kOut>(acc, ptx::smem_addr(smem + L::kStgOff) + wg * L::kStgHalfBytes,
                                                  wg, wg_tid, &tmap_c, at.group, at.m0 + 64 * wg, at.n0, p.n);
      }
    }
    if (wg_tid == 0) ptx::bulk_wait_group<0>();  // the stores complete before the CTA's shared memory goes away
  }
#endif
}

}  // namespace sm90
}  // namespace prime_kernels
