// prime-kernels: sm90a k-grouped BF16 GEMM (weight gradients).
//
//   C_e[M, N] (+)= A_e^T @ B_e,   A_e = A[offs[e]:offs[e+1], :] of A [P, M],  B_e likewise of B [P, N]
//
//   A and B are token-major bf16 (row p = a token row; row strides lda, ldb), so both wgmma operands are
//   MN-major in shared memory. C is [E, M, N] contiguous: fp32 (store or accumulate) or bf16 (store).
//   An expert's row count (its K) is arbitrary, 0 included: K = 0 gives C_e = 0, or leaves C_e untouched when
//   accumulating. Rows of the last k-block past the expert's end are zeroed in shared memory before the
//   wgmma reads them (they hold the next expert's rows or the TMA's out-of-bounds zeros).
//
// Same persistent, warp-specialized structure as the m-grouped kernel. Every expert has the same number of
// tiles but not the same cost (cost ~ its row count), so the prologue orders experts by decreasing row
// count and CTAs take tiles in a serpentine order over rounds of gridDim.x tiles (heavy tiles first,
// spread over all CTAs).
//
// offs: device int32 [E+1], non-decreasing within [0, P]. Every CTA checks that in its prologue, before any
// store: offsets that break it make the whole kernel write nothing (and note it in the device-check record,
// common/device_check.hpp).
//
// Forward progress: a CTA never waits on another CTA. Its tiles are fixed by its index and gridDim.x alone, each
// computed start to end (all of its expert's rows, in order) by that CTA, so any grid size (the num_sms cap)
// gives the same bits, whichever CTAs are resident at a time.
#pragma once

#include <cuda.h>

#include "common/device_check.hpp"
#include "epilogue.cuh"
#include "kernel_common.cuh"
#include "mainloop.cuh"
#include "pipeline.cuh"

namespace prime_kernels {
namespace sm90 {

struct KGroupedParams {
  void* c;  // [E, M, N]
  const int32_t* group_offsets;
  int32_t p_total;
  int32_t m;
  int32_t n;
  int32_t num_groups;
  // L2 cache hints (kKGroupedL2Hints in gemm_heuristics.hpp): bit 0: the C stores evict_first; bit 3: the A and B
  // loads evict_last. A clear bit: no hint.
  int32_t l2_hints;
  // Where the kernel notes invalid offsets (may be null: they still make it write nothing).
  common::DeviceCheckRecord* check;
};

// The bf16 output is built with the asynchronous epilogue only (a full-tile TMA staging buffer), fp32 with the
// synchronous one only, which stores from registers and reads no staging. The fp32 kernels still keep 20 KB
// between the ring and the barriers: dropping them moves every later offset, so those kernels' code (measured
// with this layout) would change for a 20 KB smaller footprint that occupancy does not use (one CTA per SM).
template <int kBlockN, int kNumStages, bool kAsyncEpi>
struct KGroupedLayout : StageRingLayout<128, kBlockN, 64, kNumStages> {
  using Ring = StageRingLayout<128, kBlockN, 64, kNumStages>;
  static constexpr int kCOff = Ring::kRingEnd;
  static constexpr int kF32UnusedBytes = 20480;
  static constexpr int kCBytes = kAsyncEpi ? TmaStaging<kBlockN>::kBytes : kF32UnusedBytes;
  static constexpr int kBarOff = kCOff + kCBytes;
  static constexpr int kOffsOff = kBarOff + (2 * kNumStages + 2) * 8;
  static constexpr int kOrderOff = kOffsOff + (kMaxGroups + 1) * 4;
  static constexpr int kEnd = kOrderOff + kMaxGroups * 4;
  static constexpr int kSmemBytes = kEnd + 1024;
  static_assert(kSmemBytes <= Ring::kSmemLimit, "shared memory budget exceeded");
  static_assert(kBlockN % 64 == 0 && kBlockN <= 256, "kBlockN must be 64..256, a multiple of 64");
};

template <int kBlockN, int kNumStages, int kOut, bool kAsyncEpi>
__global__ void __launch_bounds__(kNumThreads, 1)
    k_grouped_bf16_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a,
                               const __grid_constant__ CUtensorMap tmap_b,
                               const __grid_constant__ CUtensorMap tmap_c, const KGroupedParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  static_assert(kAsyncEpi == (kOut == kOutBf16Store),
                "bf16 is stored by the asynchronous epilogue only, fp32 by the synchronous one only");
  using L = KGroupedLayout<kBlockN, kNumStages, kAsyncEpi>;
  constexpr int kBlockM = L::kBlockM;
  constexpr int kBlockK = L::kBlockK;
  constexpr int kBoxBytes = 64 * kBlockK * 2;  // one 64-wide MN block of one stage
  constexpr int kNumBoxes = (kBlockM + kBlockN) / 64;
  using Mma = ptx::WgmmaBf16<kBlockN, 1, 1>;

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
  const int m_blocks = ceil_div(p.m, kBlockM);
  const int n_blocks = ceil_div(p.n, kBlockN);
  const int tiles_per_group = m_blocks * n_blocks;
  const int num_tiles = tiles_per_group * num_groups;

  // ---- prologue: offsets check (before anything is stored: bad offsets write nothing), barriers, expert order
  if (common::group_offsets_invalid(p.group_offsets, num_groups, p.p_total, p.check, common::kCheckKGroupedOffsets))
    return;
  kernel_prologue<kNumStages>(full_bar, empty_bar, 1, kNumConsumerThreads / 32, &tmap_a, &tmap_b,
                              kOut == kOutBf16Store ? &tmap_c : nullptr);
  load_group_offsets(p.group_offsets, num_groups, s_offs);
  k_grouped_rank_experts(s_offs, s_order, num_groups);
  __syncthreads();

  auto locate = [&](int t) -> KGroupedTile {
    return k_grouped_locate<kBlockM, kBlockN>(s_offs, s_order, tiles_per_group, m_blocks, t);
  };
  const int grid = gridDim.x;
  auto tile_of = [&](int i) -> int { return k_grouped_tile_of(i, grid); };

  if (warp < 4) {
    // ================= producer warpgroup =================
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (warp == 0 && lane == 0) {
      const uint64_t pol = l2_policy_reused_loads(p.l2_hints);
      int stage = 0;
      uint32_t phase = 0;
      for (int i = 0; i * grid < num_tiles; ++i) {
        const int t = tile_of(i);
        if (t >= num_tiles) continue;
        const KGroupedTile tile = locate(t);
        const int num_k_blocks = ceil_div(tile.rows, kBlockK);
        for (int kb = 0; kb < num_k_blocks; ++kb) {
          ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
          uint8_t* sa = smem + L::kAOff + stage * L::kABytes;
          uint8_t* sb = smem + L::kBOff + stage * L::kBBytes;
          const int krow = tile.k_start + kb * kBlockK;
          ptx::mbar_arrive_expect_tx(&full_bar[stage], L::kABytes + L::kBBytes);
#pragma unroll
          for (int j = 0; j < kBlockM / 64; ++j)
            ptx::tma_load_2d_hint(sa + j * kBoxBytes, &tmap_a, &full_bar[stage], tile.m0 + 64 * j, krow, pol);
#pragma unroll
          for (int j = 0; j < kBlockN / 64; ++j)
            ptx::tma_load_2d_hint(sb + j * kBoxBytes, &tmap_b, &full_bar[stage], tile.n0 + 64 * j, krow, pol);
          advance_stage<kNumStages>(stage, phase);
        }
      }
    }
  } else {
    // ================= consumer warpgroups =================
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const int wg = (warp >> 2) - 1;
    const int wg_tid = tid - 128 * (wg + 1);
    const int ctid = tid - 128;  // 0..255 over both consumer warpgroups
    const uint32_t a_base = ptx::smem_addr(smem + L::kAOff) + wg * kBoxBytes;
    const uint32_t b_base = ptx::smem_addr(smem + L::kBOff);
    const uint64_t desc_a0 = ptx::make_desc_sw128(a_base, kBoxBytes, 1024);
    const uint64_t desc_b0 = ptx::make_desc_sw128(b_base, kBoxBytes, 1024);
    const uint32_t a_lo0 = static_cast<uint32_t>(desc_a0), a_hi = static_cast<uint32_t>(desc_a0 >> 32);
    const uint32_t b_lo0 = static_cast<uint32_t>(desc_b0), b_hi = static_cast<uint32_t>(desc_b0 >> 32);

    float acc[kBlockN / 2];
    int stage = 0;
    uint32_t phase = 0;
    const uint32_t stg_half = ptx::smem_addr(smem + L::kCOff) + (kAsyncEpi ? wg * TmaStaging<kBlockN>::kHalfBytes : 0);
    for (int i = 0; i * grid < num_tiles; ++i) {
      const int t = tile_of(i);
      if (t >= num_tiles) continue;
      const KGroupedTile tile = locate(t);
      const int num_k_blocks = ceil_div(tile.rows, kBlockK);
      if (kOut == kOutF32Accumulate && num_k_blocks == 0) continue;
      // Last, partial k-block: zero k-rows [valid, 64) of every box of the stage before the MMAs read it (whole
      // 128-byte rows, so the swizzle does not matter), then hand the writes to the async proxy.
      struct ZeroPartialKBlock : NoTileHook {
        uint8_t* smem;
        int rows, ctid;
        __device__ __forceinline__ void on_stage(int kb, int stage) const {
          const int valid = rows - kb * kBlockK;
          if (valid >= kBlockK) return;
          const int per_box = (kBlockK - valid) * 8;
          const uint32_t sa = ptx::smem_addr(smem + L::kAOff + stage * L::kABytes);
          const uint32_t sb = ptx::smem_addr(smem + L::kBOff + stage * L::kBBytes);
          for (int idx = ctid; idx < per_box * kNumBoxes; idx += kNumConsumerThreads) {
            const int box = idx / per_box;
            const int rem = idx - box * per_box;
            const int r = valid + (rem >> 3);
            const uint32_t base = box < kBlockM / 64 ? sa + box * kBoxBytes : sb + (box - kBlockM / 64) * kBoxBytes;
            ptx::st_shared_v4(base + r * 128 + (rem & 7) * 16, make_uint4(0, 0, 0, 0));
          }
          ptx::fence_proxy_async_smem();
          ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);
        }
      };
      auto release = [&](int s_) {
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(&empty_bar[s_]);
      };
      // both operands MN-major: a k16 step is 16 rows of 128 bytes in A and B
      consumer_tile_mainloop<Mma, kNumStages, kBlockK, L::kABytes, L::kBBytes, 16 * 128, false, 16 * 128>(
          acc, true, num_k_blocks, full_bar, stage, phase, a_lo0, a_hi, b_lo0, b_hi, release,
          ZeroPartialKBlock{{}, smem, tile.rows, ctid});

      const int64_t group_elems = static_cast<int64_t>(p.m) * p.n;
      const int row0 = tile.m0 + 64 * wg;
      if constexpr (kAsyncEpi) {
        // C is [E, M, N]: the 3-D map clips rows >= M and columns >= N, so every half goes out by TMA.
        if (row0 < p.m) {
          if (wg_tid == 0) ptx::bulk_wait_group_read<0>();
          ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
          write_acc_to_swizzled_staging<kBlockN>(acc, stg_half, wg_tid);
          ptx::fence_proxy_async_smem();
          ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
          if (wg_tid == 0) {
#pragma unroll
            for (int b = 0; b < kBlockN / 64; ++b)
              if (tile.n0 + 64 * b < p.n)
                ptx::tma_store_3d_hint(&tmap_c, stg_half + b * TmaStaging<kBlockN>::kBoxBytes, tile.n0 + 64 * b,
                                       row0, tile.group, l2_policy_store(p.l2_hints, 0));
            ptx::bulk_commit_group();
          }
        }
      } else {
        store_acc_rows_direct<kBlockN, kOut>(acc, reinterpret_cast<float*>(p.c) + tile.group * group_elems, p.n, row0,
                                             tile.n0, wg_tid, p.m, p.n);
      }
    }
    if constexpr (kOut == kOutBf16Store) {
      if (wg_tid == 0) ptx::bulk_wait_group<0>();
    }
  }
#endif
}

}  // namespace sm90
}  // namespace prime_kernels
