// prime-kernels: sm90a fused Mega MoE backward (BF16), dgrad part: the L2 dgrad with the SwiGLU backward and the L1
// dgrad in one persistent kernel, over the task sequence of mega_moe_bwd_schedule.hpp (built without its
// weight-gradient tiles: the k-grouped GEMM computes those after this kernel).
//
// Per pool row m of expert e (dy_pool gathered by the dispatch kernel before this one):
//   L2-dgrad tile (128 rows x 128 columns of I): da = dy_pool @ w2_e, then dh, w * s and the d topk_weights
//     partials (swiglu_bwd_pp.cuh's epilogue, SwigluBwdTileEpilogue); then the m-block's counter gains one.
//   L1-dgrad tile (128 rows x 128 columns of H): dx = dh @ w13_e (K = 2I), stored bf16 to the row's dX slot.
// Each tile is one consumer warpgroup's (the ping-pong split of swiglu_bwd_pp.cuh: 64-row accumulator halves
// acc0 / acc1); the CTA's claimed tiles alternate between its two warpgroups. Both kinds read B MN-major (w2_e
// [H, I] and w13_e [2I, H], N contiguous), so one wgmma form serves them.
//
// Forward progress, without assuming that the grid is resident: the TMA thread of each CTA claims tasks from a
// global counter (one ahead) in sequence order and announces each in the CTA's task ring (kMegaBwdTaskSlots
// entries) once the previous task's loads are issued, before the task's own wait. An L1-dgrad tile waits (bounded,
// common/watchdog.cuh) for its m-block's L2-dgrad tiles, all lower in the sequence (mega_moe_bwd_schedule.hpp), so
// all claimed already by running CTAs.
// Within a CTA the TMA thread finishes one task's loads before it waits for the next task's counter, and the
// consumers wait only for their own stages, their own h pieces and the task ring; an L2-dgrad tile's counter
// release needs nothing but its own stores. So the lowest unfinished task can always run: a grid of any size
// completes with any subset of its CTAs running, with the same bits (a tile's result does not depend on the CTA).
// Writes read by TMA in another CTA (dh: TMA stores, generic stores for an m-block's last partial rows) are
// completed (bulk wait_group), fenced (fence.proxy.async.global) and released; the reader acquires, then fences
// before its TMA loads.
#pragma once

#include <cuda.h>

#include "common/device_check.hpp"
#include "common/watchdog.cuh"
#include "epilogue.cuh"
#include "kernel_common.cuh"
#include "mainloop.cuh"
#include "mega_moe_bwd_schedule.hpp"
#include "mega_moe_heuristics.hpp"
#include "pipeline.cuh"
#include "swiglu_bwd_pp.cuh"

namespace prime_kernels {
namespace sm90 {

// The longest lag (mega_moe_bwd_schedule.hpp) the kernel's shared step array holds (the launcher's
// mega_bwd_lag never exceeds it).
constexpr int kMegaBwdMaxLag = kMegaBwdMaxLagHost;
constexpr int kMegaBwdTaskSlots = 4;

struct MegaBwdDgradParams {
  // The L2 dgrad + SwiGLU backward, as m_grouped_bf16_gemm_swiglu_bwd takes it (a = dy_pool, n = I, k = H,
  // group_offsets = the plan's expert offsets, m_total = pool rows).
  MGroupedParams l2;
  // The L1 dgrad's output, the dX slots [m_total, hidden] (row stride lddx); rows outside every expert are not written.
  __nv_bfloat16* dx;
  int64_t lddx;
  int32_t hidden;
  int32_t lag;  // 0 .. kMegaBwdMaxLag
  // [max_m_blocks] finished L2-dgrad tiles per m-block, then the task claim counter; zero before the launch.
  int32_t* counters;
  int32_t max_m_blocks;
  WaitGuard wait_guard;
};

template <int kNumStages>
struct MegaBwdLayout : SwigluBwdPPLayout<kNumStages> {
  using Base = SwigluBwdPPLayout<kNumStages>;
  // The task ring: task indices (-1: none left) and their full (one arrival: the TMA thread) and empty (one arrival
  // per consumer warp) barriers; then the sequence's steps.
  static constexpr int kTaskOff = Base::kEnd;
  static constexpr int kTaskBarOff = kTaskOff + 4 * kMegaBwdTaskSlots;
  static constexpr int kStepOff = kTaskBarOff + 2 * kMegaBwdTaskSlots * 8;
  static constexpr int kEnd = kStepOff + (kMaxGroups + kMegaBwdMaxLag + 1) * 4;
  static constexpr int kSmemBytes = kEnd + 1024;
  static_assert(kTaskBarOff % 8 == 0, "mbarriers are 8-byte aligned");
  static_assert(kSmemBytes <= Base::kSmemLimit, "shared memory budget exceeded");
};

// The kernel's sequence: dgrad tiles of 128 columns, no weight-gradient tiles, one release per L2-dgrad tile.
__device__ __forceinline__ BwdSchedule mega_bwd_schedule(const MegaBwdDgradParams& p, const int32_t* s_mb,
                                                         const int32_t* s_offs, const int32_t* s_steps) {
  BwdSchedule s;
  s.shape = BwdTileShape{128, 128, 128, 128, p.hidden, p.l2.n, 0};
  s.num_experts = p.l2.num_groups;
  s.lag = p.lag;
  s.arrivals = 1;
  s.mb_first = s_mb;
  s.row_first = s_offs;
  s.step_first = s_steps;
  return s;
}

template <int kNumStages>
__global__ void __launch_bounds__(kNumThreads, 1)
    mega_moe_bwd_dgrad_kernel(const __grid_constant__ CUtensorMap tmap_dy, const __grid_constant__ CUtensorMap tmap_w2,
                              const __grid_constant__ CUtensorMap tmap_h, const __grid_constant__ CUtensorMap tmap_dh,
                              const __grid_constant__ CUtensorMap tmap_aw, const __grid_constant__ CUtensorMap tmap_dh_a,
                              const __grid_constant__ CUtensorMap tmap_w13, const __grid_constant__ CUtensorMap tmap_dx,
                              const __grid_constant__ MegaBwdDgradParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = MegaBwdLayout<kNumStages>;
  constexpr int kBlockM = L::kBlockM;
  constexpr int kBlockN = L::kBlockN;
  constexpr int kBlockK = L::kBlockK;
  static_assert(kBlockM == kBwdBlockM && kBlockN == 128, "the schedule's 128 x 128 tiles");
  using Mma = ptx::WgmmaBf16<kBlockN, 0, 1>;  // B MN-major
  constexpr int kAcc = kBlockN / 2;

  extern __shared__ uint8_t smem_raw[];
  const PingPongSmem<L> sm(smem_raw);
  uint8_t* smem = sm.base;
  int32_t* s_steps = reinterpret_cast<int32_t*>(smem + L::kStepOff);
  int32_t* task_slot = reinterpret_cast<int32_t*>(smem + L::kTaskOff);
  uint64_t* task_full = reinterpret_cast<uint64_t*>(smem + L::kTaskBarOff);
  uint64_t* task_empty = task_full + kMegaBwdTaskSlots;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const MGroupedParams& g = p.l2;
  const int num_experts = g.num_groups;

  // bad offsets or lag: nothing is written (the offsets are noted in the device-check record)
  if (common::group_offsets_invalid(g.group_offsets, num_experts, g.m_total, g.check, common::kCheckMGroupedOffsets) ||
      p.lag < 0 || p.lag > kMegaBwdMaxLag)
    return;
  if (tid == 0) {
    for (int s = 0; s < 4; ++s) ptx::mbar_init(reinterpret_cast<uint64_t*>(smem + L::kHBarOff) + s, 1);
    for (int s = 0; s < kMegaBwdTaskSlots; ++s) {
      ptx::mbar_init(&task_full[s], 1);
      ptx::mbar_init(&task_empty[s], kNumConsumerThreads / 32);
    }
  }
  // empty: the 4 warps of the consuming warpgroup; the init fence (thread 0, next) publishes the barriers above too
  kernel_prologue<kNumStages>(sm.full_bar, sm.empty_bar, 1, 4, &tmap_dy, &tmap_w2, &tmap_h, &tmap_dh, &tmap_aw,
                              &tmap_dh_a, &tmap_w13, &tmap_dx);
  load_group_offsets_and_mblocks<kBlockM>(g.group_offsets, num_experts, g.m_total, sm.s_offs, sm.s_mb);
  if (sm.s_mb[num_experts] > p.max_m_blocks) return;  // counters too short: only a misuse of the launcher
  if (warp == 0) {
    const BwdSchedule sched = mega_bwd_schedule(p, sm.s_mb, sm.s_offs, s_steps);
    warp_exclusive_scan_groups(num_experts + p.lag, lane, s_steps, [&](int k) { return sched.step_tasks(k); });
  }
  __syncthreads();

  int32_t* l2_done = p.counters;
  int32_t* task_claim = p.counters + p.max_m_blocks;
  if (warp < 4) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (warp == 0 && lane == 0) {
      const BwdSchedule sched = mega_bwd_schedule(p, sm.s_mb, sm.s_offs, s_steps);
      const int num_tasks = sched.num_tasks();
      const uint64_t pol_b = l2_policy_reused_loads(g.l2_hints);
      int stage = 0;
      uint32_t phase = 0;
      int j = 0;  // this CTA's tasks announced so far
      auto announce = [&](int u) {
        const int slot = j % kMegaBwdTaskSlots;
        ptx::mbar_wait(&task_empty[slot], ((j / kMegaBwdTaskSlots) & 1) ^ 1);
        ptx::st_shared_handoff(&task_slot[slot], u);
        ptx::mbar_arrive(&task_full[slot]);
        ++j;
      };
      int u = atomicAdd(task_claim, 1);
      if (u < num_tasks) announce(u);
      while (u < num_tasks) {
        // the next task is claimed now and announced once this one's loads are issued, before its own wait: every
        // task's consumers learn their stages without waiting on anything but lower tasks
        const int next = atomicAdd(task_claim, 1);
        const BwdTask t = sched.locate(u);
        const BwdWait w = sched.wait_of(t);
        if (w.counter == kBwdWaitMBlock)
          wait_counter_at_least(l2_done + w.index, w.target, p.wait_guard, kWaitKernelMegaBwd, kWaitMegaBwdL2Dgrad,
                                w.index);
        ptx::fence_proxy_async_global();  // dh rows another CTA wrote: acquired above, read by TMA below
        const bool l2 = t.kind == kBwdL2Dgrad;
        const int kbs = ceil_div(l2 ? g.k : 2 * g.n, kBlockK);
        const CUtensorMap* map_a = l2 ? &tmap_dy : &tmap_dh_a;
        const CUtensorMap* map_b = l2 ? &tmap_w2 : &tmap_w13;
        for (int kb = 0; kb < kbs; ++kb) {
          ptx::mbar_wait(&sm.empty_bar[stage], phase ^ 1);
          uint8_t* sa = smem + L::kAOff + stage * L::kABytes;
          uint8_t* sb = smem + L::kBOff + stage * L::kBBytes;
          ptx::mbar_arrive_expect_tx(&sm.full_bar[stage], L::kABytes + L::kBBytes);
          ptx::tma_load_2d(sa, map_a, &sm.full_bar[stage], kb * kBlockK, t.row0);
#pragma unroll
          for (int jb = 0; jb < kBlockN / 64; ++jb)
            ptx::tma_load_3d_hint(sb + jb * L::kMnBoxBytes, map_b, &sm.full_bar[stage], t.col0 + 64 * jb, kb * kBlockK,
                                  t.expert, pol_b);
          advance_stage<kNumStages>(stage, phase);
        }
        if (next < num_tasks) announce(next);
        u = next;
      }
      announce(-1);
    }
  } else {
    // ================= consumer warpgroups =================
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const BwdSchedule sched = mega_bwd_schedule(p, sm.s_mb, sm.s_offs, s_steps);
    const int wg = (warp >> 2) - 1;
    const int wg_tid = tid - 128 * (wg + 1);
    const PingPongDescs<L> d(smem);
    SwigluBwdTileEpilogue<L> epi(smem, wg, wg_tid, lane);
    // the L1-dgrad tile's staging: this warpgroup's two h slots, 4 boxes of 64 x 64 (rows 0..63: boxes 0, 1)
    const uint32_t stg = epi.hslots_addr;
    constexpr uint32_t kHalfStg = 2 * L::kBoxBytes;

    float acc0[kAcc], acc1[kAcc];
    int stage = 0;
    uint32_t phase = 0;
    for (int j = 0;; ++j) {
      const int slot = j % kMegaBwdTaskSlots;
      ptx::mbar_wait(&task_full[slot], (j / kMegaBwdTaskSlots) & 1);
      // read by the lane that frees the slot, and broadcast
      const int u = __shfl_sync(0xffffffffu, lane == 0 ? ptx::ld_shared_handoff(&task_slot[slot]) : 0, 0);
      if (lane == 0) ptx::mbar_arrive(&task_empty[slot]);
      if (u < 0) break;
      const BwdTask t = sched.locate(u);
      const bool l2 = t.kind == kBwdL2Dgrad;
      const int kbs = ceil_div(l2 ? g.k : 2 * g.n, kBlockK);
      if ((j & 1) != wg) {  // the other warpgroup's tile
        skip_stages<kNumStages>(stage, phase, kbs);
        continue;
      }
      const int row_end = max(sm.s_offs[t.expert + 1], sm.s_offs[t.expert]);
      if (l2) epi.prepare(g, &tmap_h, t.row0, row_end, t.col0);
      pingpong_tile_mainloop<Mma, kNumStages, kBlockK, L::kABytes, L::kBBytes, PingPongDescs<L>::kBStepDesc>(
          acc0, acc1, kbs, sm.full_bar, sm.empty_bar, stage, phase, d.a_lo0, d.a_hi, d.b_lo0, d.b_hi, lane, [] {});
      if (l2) {
        epi.finish(g, &tmap_h, &tmap_dh, &tmap_aw, acc0, acc1, t.row0, row_end, t.col0, t.col0 / kBlockN);
        // this tile's dh is read by the m-block's L1-dgrad tiles, in any CTA: stores complete, fenced, released
        ptx::fence_proxy_async_global();  // this thread's generic stores (a partial m-block)
        ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
        if (wg_tid == 0) {
          ptx::bulk_wait_group<0>();
          ptx::fence_proxy_async_global();
          ptx::red_release_gpu_add(l2_done + t.mb, 1);
        }
      } else {
        // dx rows: through the staging boxes (the h slots, free once this warpgroup's stores have read them)
        if (wg_tid == 0) ptx::bulk_wait_group_read<0>();
        ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
        write_acc_boxes_to_staging<kBlockN, 2>(acc0, stg, wg_tid, 0);
        write_acc_boxes_to_staging<kBlockN, 2>(acc1, stg + kHalfStg, wg_tid, 0);
        ptx::fence_proxy_async_smem();
        ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
#pragma unroll
        for (int hm = 0; hm < 2; ++hm) {
          const int prow0 = t.row0 + 64 * hm;
          const int rows = min(64, row_end - prow0);
          if (rows == 64) {
            if (wg_tid == 0) {
              const uint64_t pol = l2_policy_store(g.l2_hints, 0);
#pragma unroll
              for (int b = 0; b < 2; ++b)
                if (t.col0 + 64 * b < p.hidden)
                  ptx::tma_store_2d_hint(&tmap_dx, stg + hm * kHalfStg + b * L::kBoxBytes, t.col0 + 64 * b, prow0, pol);
            }
          } else if (rows > 0) {
            copy_swizzled_half_to_global<kBlockN>(stg + hm * kHalfStg, wg_tid, rows, p.dx, p.lddx, prow0, t.col0,
                                                  p.hidden);
          }
        }
        if (wg_tid == 0) ptx::bulk_commit_group();
        ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);  // the generic copies have read the staging
      }
    }
    if (wg_tid == 0) ptx::bulk_wait_group<0>();  // the last stores are complete before the CTA exits
  }
#endif
}

}  // namespace sm90
}  // namespace prime_kernels
