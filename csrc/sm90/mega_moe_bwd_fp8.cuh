// prime-kernels: sm90a fused FP8 Mega MoE backward: the FP8 L2 dgrad with the SwiGLU backward and its quantizing
// epilogue, and the FP8 L1 dgrad on the qK(dh) it writes, in one persistent kernel over the dgrad tiles of the
// backward's task sequence (mega_moe_bwd_schedule.hpp without weight-gradient tiles; the weight gradients are
// k_grouped_fp8_gemm_tn's, on the qT operands written here).
//
// Per pool row m of expert e (dy quantized qK(dy, 128) by the dispatch before this kernel):
//   L2-dgrad tile (128 rows x 128 columns of I): da = G(qK(dy), W2^T), then the SwiGLU backward and the quantizing
//     epilogue of swiglu_bwd_fp8.cuh (SwigluBwdFp8Epilogue: qK(dh) with its row scales, qT(dh), qT(w * s), the d
//     topk_weights partials); then the m-block's counter gains one.
//   L1-dgrad tile (128 rows x 128 columns of H): dx = G(qK(dh), W13) with W13^T's K-major tiles, stored bf16 to the
//     row's dX slot.
// Both kinds are tiles of the kernels they fuse, with the same mainloops (one partial accumulator for the L2 dgrad,
// two for the L1 dgrad), the same promotion order and the same epilogues, so every output is bit for bit the pair
// m_grouped_fp8_gemm_swiglu_bwd -> m_grouped_fp8_gemm_nt on the same inputs, whatever CTA computes a tile.
// Structure: the FP8 m-grouped kernels' (384 threads; warpgroup 0's elected thread loads A, B and A's scales into a
// 4-stage ring; warpgroups 1 and 2 each own 64 rows of every tile and promote per 128 of K). The dX tiles go out
// through TMA stores staged in the part of the epilogue's qT staging that is 1024-byte aligned; the L2 epilogue
// writes that staging only once those stores have read it.
//
// Forward progress, without assuming that the grid is resident: the TMA thread of each CTA claims tasks from a
// global counter (one ahead) in sequence order and announces each in the CTA's task ring once the previous task's
// loads are issued, before the task's own wait. An L1-dgrad tile waits (bounded, common/watchdog.cuh) for the
// L2-dgrad tiles of its m-block, all lower in the sequence and so claimed already by running CTAs. Within a CTA the
// TMA thread finishes one task's loads before it waits for the next task's counter, and the consumers wait only for
// their stages and the task ring; an L2-dgrad tile's release needs nothing but its own stores. So the lowest
// unfinished task can always run: a grid of any size completes with any subset of its CTAs running.
// The L2 epilogue's outputs read by TMA in another CTA (qK(dh) and its scales: generic stores) are fenced for the
// async proxy by every storing thread and released after a barrier of the consumers; the reader acquires, then
// fences before its TMA loads.
#pragma once

#include <cuda.h>

#include "common/device_check.hpp"
#include "common/watchdog.cuh"
#include "epilogue.cuh"
#include "kernel_common.cuh"
#include "m_grouped_gemm_fp8.cuh"
#include "mainloop.cuh"
#include "mega_moe_bwd_fp8.hpp"
#include "mega_moe_bwd_schedule.hpp"
#include "mega_moe_heuristics.hpp"
#include "pipeline.cuh"
#include "swiglu_bwd_fp8.cuh"
#include "task_ring.cuh"

namespace prime_kernels {
namespace sm90 {

constexpr int kMegaBwdFp8MaxLag = kMegaBwdMaxLagHost;
constexpr int kMegaBwdFp8TaskSlots = 4;
constexpr int kMegaBwdFp8MaxExperts = kMegaBwdFp8MaxExpertsHost;

struct MegaBwdFp8Params {
  // The L2 dgrad, as m_grouped_fp8_gemm_swiglu_bwd takes it (n = I, a multiple of 128; k = H).
  SwigluBwdFp8Params l2;
  // The L1 dgrad's B scales (W13^T's 128 x 128 blocks) and its output, the dX slots [m_total, hidden]
  const float* sb13;
  int64_t sb13_group_stride;
  int64_t sb13_n_stride;
  __nv_bfloat16* dx;
  int64_t lddx;
  int32_t hidden;
  int32_t lag;  // 0 .. kMegaBwdFp8MaxLag
  // [max_m_blocks] finished L2-dgrad tiles per m-block, [num_experts] (unused here), then the task claim counter;
  // zero before the launch
  int32_t* counters;
  int32_t max_m_blocks;
  WaitGuard wait_guard;
};

// The FP8 L2 dgrad's stage ring and epilogue staging (SwigluBwdFp8Layout's), one stage deeper: its per-group tables
// hold kMegaBwdFp8MaxExperts groups instead of kMaxGroups, which leaves room for the fourth stage that the L1-dgrad
// tiles' two partials need to keep a load in flight (the two-launch L1 dgrad runs 5 stages).
template <int kNumStages>
struct MegaBwdFp8Layout : StageRingLayout<128, 128, 128, kNumStages, 1> {
  using Ring = StageRingLayout<128, 128, 128, kNumStages, 1>;
  using Gemm = MGroupedFp8Layout<128, kNumStages>;  // the A-scale boxes of the FP8 GEMM's stages
  static constexpr int kSaBytes = Gemm::kSaBytes;
  static constexpr int kStageTxBytes = Gemm::kStageTxBytes;
  static constexpr int kSaOff = Ring::kRingEnd;
  // the epilogue's staging, as SwigluBwdFp8Layout lays it out: qK(dh) 128 rows x 256 bytes, qT 384 columns x 128
  // tokens, the column amaxes [8 warps][3 outputs][64 column pairs] and scales [3][64]
  static constexpr int kQkOff = kSaOff + kNumStages * kSaBytes;
  static constexpr int kQtOff = kQkOff + 128 * 256;
  static constexpr int kColMaxOff = kQtOff + 384 * 128;
  static constexpr int kColScaleOff = kColMaxOff + 8 * 3 * 64 * 4;
  static constexpr int kBarOff = kColScaleOff + 3 * 64 * 16;
  // The dX tiles' TMA staging: two 64-row halves (TmaStaging<128>), 1024-byte aligned, inside the qT staging.
  static constexpr int kDxStgOff = (kQtOff + 1023) / 1024 * 1024;
  // The groups' first rows and m-blocks; the task ring (task indices, -1: none left; their full barriers, one
  // arrival: the TMA thread; their empty barriers, one arrival per consumer warp); the sequence's steps.
  static constexpr int kOffsOff = kBarOff + 2 * kNumStages * 8;
  static constexpr int kMbOff = kOffsOff + (kMegaBwdFp8MaxExperts + 1) * 4;
  static constexpr int kTaskOff = kMbOff + (kMegaBwdFp8MaxExperts + 1) * 4;
  static constexpr int kTaskBarOff = (kTaskOff + 4 * kMegaBwdFp8TaskSlots + 7) / 8 * 8;
  static constexpr int kStepOff = kTaskBarOff + 2 * kMegaBwdFp8TaskSlots * 8;
  static constexpr int kEnd = kStepOff + (kMegaBwdFp8MaxExperts + kMegaBwdFp8MaxLag + 1) * 4;
  static constexpr int kSmemBytes = kEnd + 1024;
  static_assert(kDxStgOff + TmaStaging<128>::kBytes <= kColMaxOff, "the dX staging lies inside qT's");
  static_assert(kSaOff % 128 == 0 && kQkOff % 16 == 0 && kColScaleOff % 16 == 0 && kBarOff % 8 == 0,
                "TMA destinations 128-byte, staging 16-byte, mbarriers 8-byte aligned");
  static_assert(kSmemBytes <= Ring::kSmemLimit, "shared memory budget exceeded");
};

__device__ __forceinline__ BwdSchedule mega_bwd_fp8_schedule(const MegaBwdFp8Params& p, const int32_t* s_mb,
                                                             const int32_t* s_offs, const int32_t* s_steps) {
  return bwd_schedule_128(p.hidden, p.l2.n, 0, p.l2.num_groups, p.lag, s_mb, s_offs, s_steps);
}

template <int kNumStages>
__global__ void __launch_bounds__(kNumThreads, 1)
    mega_moe_bwd_fp8_kernel(const __grid_constant__ CUtensorMap tmap_dy, const __grid_constant__ CUtensorMap tmap_w2t,
                            const __grid_constant__ CUtensorMap tmap_dy_sa, const __grid_constant__ CUtensorMap tmap_dh,
                            const __grid_constant__ CUtensorMap tmap_w13t,
                            const __grid_constant__ CUtensorMap tmap_dh_sa, const __grid_constant__ CUtensorMap tmap_dx,
                            const __grid_constant__ MegaBwdFp8Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = MegaBwdFp8Layout<kNumStages>;
  constexpr int kBlockN = L::kBlockN;
  constexpr int kBlockK = L::kBlockK;
  static_assert(L::kBlockM == kBwdBlockM && kBlockN == 128 && kBlockK == 128, "the schedule's 128 x 128 tiles");
  using Mma = ptx::WgmmaFp8E4m3<kBlockN>;
  constexpr int kAcc = kBlockN / 2;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + L::kBarOff);
  uint64_t* empty_bar = full_bar + kNumStages;
  int32_t* s_offs = reinterpret_cast<int32_t*>(smem + L::kOffsOff);
  int32_t* s_mb = reinterpret_cast<int32_t*>(smem + L::kMbOff);
  int32_t* s_steps = reinterpret_cast<int32_t*>(smem + L::kStepOff);
  uint64_t* task_full = reinterpret_cast<uint64_t*>(smem + L::kTaskBarOff);
  uint64_t* task_empty = task_full + kMegaBwdFp8TaskSlots;
  const TaskRing<kMegaBwdFp8TaskSlots> ring{reinterpret_cast<int32_t*>(smem + L::kTaskOff), task_full, task_empty};

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const SwigluBwdFp8Params& g = p.l2;
  const int num_experts = g.num_groups;

  // bad offsets, expert count or lag: nothing is written (the offsets are noted in the device-check record)
  if (num_experts < 1 || num_experts > kMegaBwdFp8MaxExperts ||
      common::group_offsets_invalid(g.group_offsets, num_experts, g.m_total, g.check,
                                    common::kCheckSwigluBwdFp8Offsets, L::kBlockM) ||
      p.lag < 0 || p.lag > kMegaBwdFp8MaxLag)
    return;
  if (tid == 0) {
    for (int s = 0; s < kMegaBwdFp8TaskSlots; ++s) {
      ptx::mbar_init(&task_full[s], 1);
      ptx::mbar_init(&task_empty[s], kNumConsumerThreads / 32);
    }
  }
  // empty: one arrival per consumer warp; the init fence (thread 0, next) publishes the barriers above too
  kernel_prologue<kNumStages>(full_bar, empty_bar, 1, kNumConsumerThreads / 32, &tmap_dy, &tmap_w2t, &tmap_dy_sa,
                              &tmap_dh, &tmap_w13t, &tmap_dh_sa, &tmap_dx);
  load_group_offsets_and_mblocks<L::kBlockM>(g.group_offsets, num_experts, g.m_total, s_offs, s_mb);
  if (s_mb[num_experts] > p.max_m_blocks) return;  // counters too short: only a misuse of the launcher
  if (warp == 0) {
    const BwdSchedule sched = mega_bwd_fp8_schedule(p, s_mb, s_offs, s_steps);
    warp_exclusive_scan_groups(num_experts + p.lag, lane, s_steps, [&](int k) { return sched.step_tasks(k); });
  }
  __syncthreads();

  int32_t* l2_done = p.counters;
  int32_t* task_claim = p.counters + p.max_m_blocks + num_experts;
  if (warp < 4) {
    // ================= producer warpgroup (one elected thread; the others have nothing to do)
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (warp == 0 && lane == 0) {
      const BwdSchedule sched = mega_bwd_fp8_schedule(p, s_mb, s_offs, s_steps);
      const int num_tasks = sched.num_tasks();
      const uint64_t pol_b = l2_policy_reused_loads(g.l2_hints);
      const int l2_k_blocks = ceil_div(g.k, kBlockK);
      const int l1_k_blocks = ceil_div(2 * g.n, kBlockK);
      int stage = 0;
      uint32_t phase = 0;
      produce_claimed_tasks(task_claim, num_tasks, ring, [&](int u) {
        const BwdTask t = sched.locate(u);
        const BwdWait w = sched.wait_of(t);
        if (w.counter == kBwdWaitMBlock)  // one call site: the timed-out path stays out of line
          wait_counter_at_least(l2_done + w.index, w.target, p.wait_guard, kWaitKernelMegaBwdFp8,
                                kWaitMegaBwdL2Dgrad, w.index);
        ptx::fence_proxy_async_global();  // qK(dh) rows another CTA wrote: acquired above, read by TMA below
        const bool l2 = t.kind == kBwdL2Dgrad;
        const CUtensorMap* map_a = l2 ? &tmap_dy : &tmap_dh;
        const CUtensorMap* map_b = l2 ? &tmap_w2t : &tmap_w13t;
        const CUtensorMap* map_sa = l2 ? &tmap_dy_sa : &tmap_dh_sa;
        const int kbs = l2 ? l2_k_blocks : l1_k_blocks;
        for (int kb = 0; kb < kbs; ++kb) {
          ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
          ptx::mbar_arrive_expect_tx(&full_bar[stage], L::kStageTxBytes);
          ptx::tma_load_2d(smem + L::kAOff + stage * L::kABytes, map_a, &full_bar[stage], kb * kBlockK, t.row0);
          ptx::tma_load_3d_hint(smem + L::kBOff + stage * L::kBBytes, map_b, &full_bar[stage], kb * kBlockK, t.col0,
                                t.expert, pol_b);
          // from the 16-byte boundary at or before row0 (MGroupedFp8Layout::kSaBoxRows)
          ptx::tma_load_2d(smem + L::kSaOff + stage * L::kSaBytes, map_sa, &full_bar[stage], t.row0 & ~3, kb);
          advance_stage<kNumStages>(stage, phase);
        }
      });
    }
  } else {
    // ================= consumer warpgroups
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const BwdSchedule sched = mega_bwd_fp8_schedule(p, s_mb, s_offs, s_steps);
    const int wg = (warp >> 2) - 1;  // 0 or 1: rows [64*wg, 64*wg + 64) of every tile
    const int wg_tid = tid - 128 * (wg + 1);
    // this thread's accumulator rows within the tile: r and r + 8 (wgmma's m64 fragment)
    const int frag_row = 64 * wg + 16 * ((wg_tid >> 5) & 3) + (lane >> 2);
    const StageDescHalves desc = k_major_stage_descs(smem + L::kAOff, smem + L::kBOff, wg);
    const float* s_sa = reinterpret_cast<const float*>(smem + L::kSaOff);
    const int l2_k_blocks = ceil_div(g.k, kBlockK);
    const int l1_k_blocks = ceil_div(2 * g.n, kBlockK);

    float acc[kAcc];
    float part0[kAcc], part1[kAcc];
    int stage = 0;
    uint32_t phase = 0;
    auto release = [&](int s_) {
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(&empty_bar[s_]);
    };
    for (int j = 0;; ++j) {
      const int u = ring.receive(j, lane);
      if (u < 0) break;
      const BwdTask t = sched.locate(u);
      const int row_end = max(s_offs[t.expert + 1], s_offs[t.expert]);
      // a warpgroup whose 64 rows all lie past the expert's end (a tail m-block) only keeps the ring moving
      const bool active = t.row0 + 64 * wg < row_end;
      const int sa_row = frag_row + (t.row0 & 3);
      if (t.kind == kBwdL2Dgrad) {
        const float* sb_tile = g.sb + t.expert * g.sb_group_stride + (t.col0 / kBlockN) * g.sb_n_stride;
        consumer_tile_mainloop_promoted<Mma, kNumStages, kBlockK, L::kABytes, L::kBBytes, 1, false>(
            acc, part0, part1, active, l2_k_blocks, full_bar, stage, phase, desc.a_lo0, desc.a_hi, desc.b_lo0,
            desc.b_hi, RowTimesTileScales<L::kSaBytes / 4, kAcc>{sb_tile, s_sa, sa_row}, release);
        // the dX stores of this CTA's earlier L1-dgrad tiles have read the staging the epilogue writes
        if (wg_tid == 0) ptx::bulk_wait_group_read<0>();
        ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);
        // (derived here, not before the roles split: a value live across setmaxnreg is spilled)
        const SwigluBwdFp8Epilogue epi{tid - 128,
                                       lane,
                                       warp - 4,
                                       smem + L::kQkOff,
                                       smem + L::kQtOff,
                                       reinterpret_cast<uint32_t*>(smem + L::kColMaxOff),
                                       reinterpret_cast<float4*>(smem + L::kColScaleOff)};
        if (g.clamp > 0.f)
          epi.run<kClampOn, false, false>(g, acc, t.row0, row_end, t.col0, frag_row);
        else
          epi.run<kClampOff, false, false>(g, acc, t.row0, row_end, t.col0, frag_row);
        // this tile's qK(dh) and its scales are read by the m-block's L1-dgrad tiles, in any CTA: every storing
        // thread fences its generic stores for the async proxy, then one thread releases after all of them
        ptx::fence_proxy_async_global();
        ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);
        if (tid == 128) ptx::red_release_gpu_add(l2_done + t.mb, 1);
      } else {
        const float* sb_tile = p.sb13 + t.expert * p.sb13_group_stride + (t.col0 / kBlockN) * p.sb13_n_stride;
        consumer_tile_mainloop_promoted<Mma, kNumStages, kBlockK, L::kABytes, L::kBBytes, 1, true>(
            acc, part0, part1, active, l1_k_blocks, full_bar, stage, phase, desc.a_lo0, desc.a_hi, desc.b_lo0,
            desc.b_hi, RowTimesTileScales<L::kSaBytes / 4, kAcc>{sb_tile, s_sa, sa_row}, release);
        if (active) {
          const uint32_t stg_half = ptx::smem_addr(smem + L::kDxStgOff) + wg * TmaStaging<kBlockN>::kHalfBytes;
          store_acc_half_async<kBlockN>(acc, stg_half, wg, wg_tid, &tmap_dx, t.row0 + 64 * wg, row_end, t.col0,
                                        p.hidden, g.l2_hints, p.dx, p.lddx);
        }
      }
    }
    if (wg_tid == 0) ptx::bulk_wait_group<0>();  // the last stores are complete before the CTA exits
  }
#endif
}

}  // namespace sm90
}  // namespace prime_kernels
