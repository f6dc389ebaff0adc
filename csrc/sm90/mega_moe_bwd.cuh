// prime-kernels: sm90a fused Mega MoE backward (BF16): the L2 dgrad with the SwiGLU backward, the L1 dgrad and
// (optionally) the weight gradients dW2 and dW13 in one persistent kernel, over the task sequence of
// mega_moe_bwd_schedule.hpp. Without the weight-gradient tiles the sequence holds the dgrad tiles alone (the
// k-grouped GEMM computes the weight gradients after the kernel).
//
// Per pool row m of expert e (dy_pool gathered by the dispatch kernel before this one, x_pool likewise):
//   L2-dgrad tile (128 rows x 128 columns of I): da = dy_pool @ w2_e, then dh, w * s and the d topk_weights
//     partials (swiglu_bwd_pp.cuh's epilogue, SwigluBwdTileEpilogue); then the m-block's and the expert's counters
//     gain one.
//   L1-dgrad tile (128 rows x 128 columns of H): dx = dh @ w13_e (K = 2I), stored bf16 to the row's dX slot.
//   dW2 tile (128 rows of H x 128 columns of I of dW2_e): dy_pool_e^T @ (w * s)_e, K = the expert's rows.
//   dW13 tile (128 rows of 2I x 128 columns of H of dW13_e): dh_e^T @ x_pool_e.
// Each tile is one consumer warpgroup's (the ping-pong split of swiglu_bwd_pp.cuh: 64-row accumulator halves
// acc0 / acc1); the CTA's claimed tiles alternate between its two warpgroups. Every kind reads B MN-major (w2_e
// [H, I], w13_e [2I, H], w * s and x_pool rows: N contiguous); A is K-major for the dgrad tiles (pool rows) and
// MN-major for the weight-gradient tiles (the pool rows transposed), two wgmma forms chosen per task, warp-uniform.
// A weight-gradient tile's last k-block may reach past the expert's rows: its warpgroup zeroes those rows of both
// operands in shared memory before the MMAs read them (the k-grouped GEMM's rule). Its result goes out as bf16
// (TMA stores, the 3-D map clips at the gradient's edges), fp32, or added to fp32 accumulators (generic stores; a
// tile is one CTA's, so the sums are deterministic).
//
// Forward progress, without assuming that the grid is resident: the TMA thread of each CTA claims tasks from a
// global counter (one ahead) in sequence order and announces each in the CTA's task ring (kMegaBwdTaskSlots
// entries) once the previous task's loads are issued, before the task's own wait. An L1-dgrad tile waits (bounded,
// common/watchdog.cuh) for its m-block's L2-dgrad tiles and a weight-gradient tile for all of its expert's, all
// lower in the sequence (mega_moe_bwd_schedule.hpp), so all claimed already by running CTAs.
// Within a CTA the TMA thread finishes one task's loads before it waits for the next task's counter, and the
// consumers wait only for their own stages, their own h pieces, the task ring and the mainloop turn (passed by the
// other warpgroup once it has waited for the stages of the task before, which the TMA thread loads first); an
// L2-dgrad tile's counter releases need nothing but its own stores. So the lowest unfinished task can always run: a
// grid of any size completes with any subset of its CTAs running, with the same bits (a tile's result does not
// depend on the CTA).
// Writes read by TMA in another CTA (dh and w * s: TMA stores, generic stores for an m-block's last partial rows)
// are completed (bulk wait_group), fenced (fence.proxy.async.global) and released; the reader acquires, then fences
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

// MegaBwdParams::wgrad_out without weight-gradient tiles (else a KGroupedOut, epilogue.cuh).
constexpr int32_t kMegaBwdNoWgrad = -1;

struct MegaBwdParams {
  // The L2 dgrad + SwiGLU backward, as m_grouped_bf16_gemm_swiglu_bwd takes it (a = dy_pool, n = I, k = H,
  // group_offsets = the plan's expert offsets, m_total = pool rows).
  MGroupedParams l2;
  // The L1 dgrad's output, the dX slots [m_total, hidden] (row stride lddx); rows outside every expert are not written.
  __nv_bfloat16* dx;
  int64_t lddx;
  int32_t hidden;
  int32_t lag;  // 0 .. kMegaBwdMaxLag
  // The weight gradients: kMegaBwdNoWgrad (no such tiles), kOutBf16Store (through tmap_dw2 / tmap_dw13), or
  // kOutF32Store / kOutF32Accumulate into dw2_f32 [E, H, I] and dw13_f32 [E, 2I, H] (contiguous).
  int32_t wgrad_out;
  float* dw2_f32;
  float* dw13_f32;
  // [max_m_blocks] finished L2-dgrad tiles per m-block, [num_experts] per expert, then the task claim counter;
  // zero before the launch.
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

// The kernel's sequence: 128 x 128 tiles of every kind (weight-gradient tiles only with wgrad_out), one release
// per L2-dgrad tile.
__device__ __forceinline__ BwdSchedule mega_bwd_schedule(const MegaBwdParams& p, const int32_t* s_mb,
                                                         const int32_t* s_offs, const int32_t* s_steps) {
  return bwd_schedule_128(p.hidden, p.l2.n, p.wgrad_out != kMegaBwdNoWgrad ? 1 : 0, p.l2.num_groups, p.lag, s_mb,
                          s_offs, s_steps);
}

// The k-blocks of task t's mainloop: K = H (L2 dgrad), 2I (L1 dgrad) or the expert's rows (weight gradients).
template <int kBlockK>
__device__ __forceinline__ int mega_bwd_k_blocks(const BwdTask& t, const MGroupedParams& g, const int32_t* s_offs) {
  if (t.kind == kBwdL2Dgrad) return ceil_div(g.k, kBlockK);
  if (t.kind == kBwdL1Dgrad) return ceil_div(2 * g.n, kBlockK);
  return ceil_div(max(s_offs[t.expert + 1] - s_offs[t.expert], 0), kBlockK);
}

// A weight-gradient tile's k-block that reaches past its expert's `rows`: k-rows [valid, kBlockK) of the stage's
// four 64-column boxes (A's two, B's two) are zeroed by the warpgroup's threads (whole 128-byte rows, so the swizzle
// does not matter) and handed to the async proxy before the MMAs read them. They hold the next expert's rows, or
// rows no kernel wrote (past the last expert), or the TMA's out-of-bounds zeros.
template <typename L>
struct ZeroRowsPastExpert {
  uint32_t a0, b0;  // stage 0's A and B
  int rows, wg, wg_tid;
  __device__ __forceinline__ void on_stage(int kb, int stage) const {
    const int valid = rows - kb * L::kBlockK;
    if (valid >= L::kBlockK) return;  // warpgroup-uniform
    const int per_box = (L::kBlockK - valid) * 8;  // 16-byte pieces
    const uint32_t sa = a0 + stage * L::kABytes;
    const uint32_t sb = b0 + stage * L::kBBytes;
    for (int idx = wg_tid; idx < 4 * per_box; idx += 128) {
      const int box = idx / per_box;
      const int rem = idx - box * per_box;
      const int r = valid + (rem >> 3);
      const uint32_t base = box < 2 ? sa + box * L::kMnBoxBytes : sb + (box - 2) * L::kMnBoxBytes;
      ptx::st_shared_v4(base + r * 128 + (rem & 7) * 16, make_uint4(0, 0, 0, 0));
    }
    ptx::fence_proxy_async_smem();
    ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
  }
};

// A warpgroup's 128 x kBlockN tile (acc0: rows 0..63, acc1: rows 64..127) as bf16 into its staging boxes (the
// halves at stg and stg + half_bytes), once its earlier TMA stores have read them; on return the boxes are complete
// and visible to the async proxy.
template <int kBlockN>
__device__ __forceinline__ void stage_tile_bf16(const float (&acc0)[kBlockN / 2], const float (&acc1)[kBlockN / 2],
                                                uint32_t stg, uint32_t half_bytes, int wg, int wg_tid) {
  if (wg_tid == 0) ptx::bulk_wait_group_read<0>();
  ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
  write_acc_boxes_to_staging<kBlockN, 2>(acc0, stg, wg_tid, 0);
  write_acc_boxes_to_staging<kBlockN, 2>(acc1, stg + half_bytes, wg_tid, 0);
  ptx::fence_proxy_async_smem();
  ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
}

template <int kNumStages>
__global__ void __launch_bounds__(kNumThreads, 1)
    mega_moe_bwd_kernel(const __grid_constant__ CUtensorMap tmap_dy, const __grid_constant__ CUtensorMap tmap_w2,
                        const __grid_constant__ CUtensorMap tmap_h, const __grid_constant__ CUtensorMap tmap_dh,
                        const __grid_constant__ CUtensorMap tmap_aw, const __grid_constant__ CUtensorMap tmap_dh_a,
                        const __grid_constant__ CUtensorMap tmap_w13, const __grid_constant__ CUtensorMap tmap_dx,
                        const __grid_constant__ CUtensorMap tmap_dy_mn, const __grid_constant__ CUtensorMap tmap_aw_mn,
                        const __grid_constant__ CUtensorMap tmap_dh_mn, const __grid_constant__ CUtensorMap tmap_x_mn,
                        const __grid_constant__ CUtensorMap tmap_dw2, const __grid_constant__ CUtensorMap tmap_dw13,
                        const __grid_constant__ MegaBwdParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = MegaBwdLayout<kNumStages>;
  constexpr int kBlockM = L::kBlockM;
  constexpr int kBlockN = L::kBlockN;
  constexpr int kBlockK = L::kBlockK;
  static_assert(kBlockM == kBwdBlockM && kBlockN == 128, "the schedule's 128 x 128 tiles");
  static_assert(L::kMnBoxBytes == 64 * 128 && L::kABytes == 2 * L::kMnBoxBytes,
                "an MN-major A stage is two 64-row boxes of 64 k-rows, where a K-major one has its rows 64..127");
  using Mma = ptx::WgmmaBf16<kBlockN, 0, 1>;   // dgrad: A K-major, B MN-major
  using MmaT = ptx::WgmmaBf16<kBlockN, 1, 1>;  // weight gradients: both MN-major
  constexpr uint32_t kAStepMn = (16 * 128) >> 4;  // one k16 step of an MN-major A: 16 rows of 128 bytes
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
  const bool with_wgrad = p.wgrad_out != kMegaBwdNoWgrad;

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
  int32_t* expert_done = p.counters + p.max_m_blocks;
  int32_t* task_claim = expert_done + num_experts;
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
        if (w.counter != kBwdWaitNone) {  // one call site: the timed-out path stays out of line, spill-free
          const bool mb = w.counter == kBwdWaitMBlock;
          wait_counter_at_least((mb ? l2_done : expert_done) + w.index, w.target, p.wait_guard, kWaitKernelMegaBwd,
                                mb ? kWaitMegaBwdL2Dgrad : kWaitMegaBwdExpert, w.index);
        }
        ptx::fence_proxy_async_global();  // dh and w * s rows another CTA wrote: acquired above, read by TMA below
        const int kbs = mega_bwd_k_blocks<kBlockK>(t, g, sm.s_offs);
        if (t.kind == kBwdL2Dgrad || t.kind == kBwdL1Dgrad) {
          const bool l2 = t.kind == kBwdL2Dgrad;
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
              ptx::tma_load_3d_hint(sb + jb * L::kMnBoxBytes, map_b, &sm.full_bar[stage], t.col0 + 64 * jb,
                                    kb * kBlockK, t.expert, pol_b);
            advance_stage<kNumStages>(stage, phase);
          }
        } else {
          // a weight-gradient tile: A and B are both the expert's pool rows, k-block by k-block, in 64-column boxes
          const bool w2 = t.kind == kBwdWgradW2;
          const CUtensorMap* map_a = w2 ? &tmap_dy_mn : &tmap_dh_mn;
          const CUtensorMap* map_b = w2 ? &tmap_aw_mn : &tmap_x_mn;
          const int k0 = sm.s_offs[t.expert];
          for (int kb = 0; kb < kbs; ++kb) {
            ptx::mbar_wait(&sm.empty_bar[stage], phase ^ 1);
            uint8_t* sa = smem + L::kAOff + stage * L::kABytes;
            uint8_t* sb = smem + L::kBOff + stage * L::kBBytes;
            ptx::mbar_arrive_expect_tx(&sm.full_bar[stage], L::kABytes + L::kBBytes);
#pragma unroll
            for (int jb = 0; jb < 2; ++jb) {
              ptx::tma_load_2d(sa + jb * L::kMnBoxBytes, map_a, &sm.full_bar[stage], t.row0 + 64 * jb,
                               k0 + kb * kBlockK);
              ptx::tma_load_2d(sb + jb * L::kMnBoxBytes, map_b, &sm.full_bar[stage], t.col0 + 64 * jb,
                               k0 + kb * kBlockK);
            }
            advance_stage<kNumStages>(stage, phase);
          }
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
    // the weight-gradient tiles' MN-major A: the same stage, 64-row boxes 8 KB apart
    const uint64_t desc_at = ptx::make_desc_sw128(ptx::smem_addr(smem + L::kAOff), L::kMnBoxBytes, 1024);
    const uint32_t at_lo0 = static_cast<uint32_t>(desc_at), at_hi = static_cast<uint32_t>(desc_at >> 32);
    SwigluBwdTileEpilogue<L> epi(smem, wg, wg_tid, lane);
    // the L1-dgrad and bf16 weight-gradient tiles' staging: this warpgroup's two h slots, 4 boxes of 64 x 64
    // (rows 0..63: boxes 0, 1)
    const uint32_t stg = epi.hslots_addr;
    constexpr uint32_t kHalfStg = 2 * L::kBoxBytes;

    float acc0[kAcc], acc1[kAcc];
    int stage = 0;
    uint32_t phase = 0;
    // The mainloops take turns in task order (kBarSwigluTurnWg0 + wg: the other warpgroup's 128 arrivals and this
    // one's 128): a warpgroup waits for its tile's first stage only after the other has waited for every stage of
    // the task before. Without the turns a warpgroup that skipped the other's stages could wait for ring position q
    // while position q - kNumStages, of the same barrier, is still in flight: that phase has the other parity, so
    // the wait would pass at once and the MMAs read the other tile's data (and its empty arrivals unbalance the
    // ring). Task 0 is warpgroup 0's turn; the turn passed after the last task is taken when the -1 is read, so no
    // arrival is left at exit.
    if (wg == 1) ptx::named_bar_arrive(kBarSwigluTurnWg0, 256);
    const auto pass_turn = [&] { ptx::named_bar_arrive(kBarSwigluTurnWg0 + (wg ^ 1), 256); };
    for (int j = 0;; ++j) {
      const int slot = j % kMegaBwdTaskSlots;
      ptx::mbar_wait(&task_full[slot], (j / kMegaBwdTaskSlots) & 1);
      // read by the lane that frees the slot, and broadcast
      const int u = __shfl_sync(0xffffffffu, lane == 0 ? ptx::ld_shared_handoff(&task_slot[slot]) : 0, 0);
      if (lane == 0) ptx::mbar_arrive(&task_empty[slot]);
      if (u < 0) {
        if ((j & 1) == wg) ptx::named_bar_sync(kBarSwigluTurnWg0 + wg, 256);
        break;
      }
      const BwdTask t = sched.locate(u);
      const int kbs = mega_bwd_k_blocks<kBlockK>(t, g, sm.s_offs);
      if ((j & 1) != wg) {  // the other warpgroup's tile: its turn orders the waits on these stages
        skip_stages<kNumStages>(stage, phase, kbs);
        continue;
      }
      if (t.kind == kBwdWgradW2 || t.kind == kBwdWgradW13) {
        const bool w2 = t.kind == kBwdWgradW2;
        const int rows = max(sm.s_offs[t.expert + 1] - sm.s_offs[t.expert], 0);
        const ZeroRowsPastExpert<L> zero_tail{ptx::smem_addr(smem + L::kAOff), ptx::smem_addr(smem + L::kBOff), rows,
                                              wg, wg_tid};
        ptx::named_bar_sync(kBarSwigluTurnWg0 + wg, 256);
        pingpong_tile_mainloop<MmaT, kNumStages, kBlockK, L::kABytes, L::kBBytes, PingPongDescs<L>::kBStepDesc,
                               kAStepMn>(acc0, acc1, kbs, sm.full_bar, sm.empty_bar, stage, phase, at_lo0, at_hi,
                                         d.b_lo0, d.b_hi, lane, pass_turn, zero_tail);
        // dW2_e is [H, I], dW13_e [2I, H]
        const int m_dim = w2 ? p.hidden : 2 * g.n;
        const int n_dim = w2 ? g.n : p.hidden;
        if (p.wgrad_out == kOutBf16Store) {
          stage_tile_bf16<kBlockN>(acc0, acc1, stg, kHalfStg, wg, wg_tid);
          if (wg_tid == 0) {
            const CUtensorMap* map_c = w2 ? &tmap_dw2 : &tmap_dw13;
            const uint64_t pol = l2_policy_store(g.l2_hints, 0);
#pragma unroll
            for (int hm = 0; hm < 2; ++hm)
#pragma unroll
              for (int b = 0; b < 2; ++b)
                if (t.row0 + 64 * hm < m_dim && t.col0 + 64 * b < n_dim)
                  ptx::tma_store_3d_hint(map_c, stg + hm * kHalfStg + b * L::kBoxBytes, t.col0 + 64 * b,
                                         t.row0 + 64 * hm, t.expert, pol);
            ptx::bulk_commit_group();
          }
        } else {
          float* c = (w2 ? p.dw2_f32 : p.dw13_f32) + static_cast<int64_t>(t.expert) * m_dim * n_dim;
          if (p.wgrad_out == kOutF32Accumulate) {
            if (kbs > 0) {  // an expert without rows adds nothing
              store_acc_rows_direct<kBlockN, kOutF32Accumulate>(acc0, c, n_dim, t.row0, t.col0, wg_tid, m_dim, n_dim);
              store_acc_rows_direct<kBlockN, kOutF32Accumulate>(acc1, c, n_dim, t.row0 + 64, t.col0, wg_tid, m_dim,
                                                                n_dim);
            }
          } else {
            store_acc_rows_direct<kBlockN, kOutF32Store>(acc0, c, n_dim, t.row0, t.col0, wg_tid, m_dim, n_dim);
            store_acc_rows_direct<kBlockN, kOutF32Store>(acc1, c, n_dim, t.row0 + 64, t.col0, wg_tid, m_dim, n_dim);
          }
        }
        continue;
      }
      const bool l2 = t.kind == kBwdL2Dgrad;
      const int row_end = max(sm.s_offs[t.expert + 1], sm.s_offs[t.expert]);
      if (l2) epi.prepare(g, &tmap_h, t.row0, row_end, t.col0);
      ptx::named_bar_sync(kBarSwigluTurnWg0 + wg, 256);
      pingpong_tile_mainloop<Mma, kNumStages, kBlockK, L::kABytes, L::kBBytes, PingPongDescs<L>::kBStepDesc>(
          acc0, acc1, kbs, sm.full_bar, sm.empty_bar, stage, phase, d.a_lo0, d.a_hi, d.b_lo0, d.b_hi, lane, pass_turn);
      if (l2) {
        epi.finish(g, &tmap_h, &tmap_dh, &tmap_aw, acc0, acc1, t.row0, row_end, t.col0, t.col0 / kBlockN);
        // this tile's dh and w * s are read by the m-block's L1-dgrad tiles and the expert's weight-gradient tiles,
        // in any CTA: stores complete, fenced, released
        ptx::fence_proxy_async_global();  // this thread's generic stores (a partial m-block)
        ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
        if (wg_tid == 0) {
          ptx::bulk_wait_group<0>();
          ptx::fence_proxy_async_global();
          ptx::red_release_gpu_add(l2_done + t.mb, 1);
          if (with_wgrad) ptx::red_release_gpu_add(expert_done + t.expert, 1);
        }
      } else {
        // dx rows: through the staging boxes (the h slots, free once this warpgroup's stores have read them)
        stage_tile_bf16<kBlockN>(acc0, acc1, stg, kHalfStg, wg, wg_tid);
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
