// prime-kernels: sm90a fused Mega MoE forward in blockwise FP8 (precision "fp8"): the FP8 L1 with the SwiGLU forward
// and qK(s, 64), and the FP8 L2, in one persistent kernel, after the quantizing dispatch (dispatch_rows_fp8, launched
// just before it by the same host call; the combine is the launch after).
//
// Per pool row m of expert e (rows grouped by expert through the plan's offsets):
//   x_q[m], x_sa[., m] = qK(x[token(m)], 128)            (dispatch_rows_fp8_kernel: each token row read and quantized
//                                                         once, its bytes stored to every route's row; the rows no
//                                                         route names back, a padded plan's padding rows, are zeroed
//                                                         here by the row warps)
//   h[m]  = G(x_q, W13_e) promoted every 128 of K        (gate | up, fp32; stored rounded to bf16 when asked)
//   s_q[m], s_sa[., m] = qK(silu(g) * u, 64)             (on the fp32 accumulators: swiglu_fp8_row, then staged and
//                                                         TMA-stored (mega_fp8_l1_stage) or, in a tail half or
//                                                         one not on a 4-row boundary, stored by
//                                                         swiglu_fwd_fp8_epilogue)
//   o[m]  = G(s_q, W2_e) promoted every 64 of K          (bf16, for the combine)
// Every quantization, promotion and rounding is that of the FP8 forward pipeline's kernels (dispatch_rows_fp8.cuh,
// swiglu_fwd_fp8.cuh, m_grouped_gemm_fp8.cuh with 1 x 64 A scales), each in the same order, so h, s and o are those
// kernels' bits (tests/test_mega_fused_fp8.py compares them). The quantizing dispatch is its own launch because
// quantizing inside this kernel, by its three row warps per SM, was latency-bound: 4.48 against 2.12 ms for the
// whole pipeline at Qwen3-30B-A3B, T = 16384 (docs/performance.md).
//
// Work (the BF16 kernel's, mega_moe_fwd.cuh, with 128 x 128 x 128 e4m3 tiles): one task sequence, all L1 tiles (per
// expert: I / 64 n-blocks of 64 gate and 64 up columns) then all L2 tiles (per expert: H / 128 n-blocks), m-blocks
// fastest within bands (MegaTileSequence). An L1 tile waits until its m-block's rows are all written (the row
// warps count them), an L2 tile for every L1 tile of its m-block (both consumer warpgroups of each: 2 * I / 64
// arrivals).
//
// Forward progress, without assuming that the grid is resident (the BF16 kernel's argument, restated for this one):
//   * each CTA's TMA thread claims tasks from a global counter (atomicAdd), so tasks are handed out in sequence order
//     and only to running CTAs; a claimed task waits only for lower tasks (its m-block's L1 tiles) and for the row
//     warps. A consumer warpgroup's arrival for an L1 tile is made once its stores have landed: a half with generic
//     stores arrives at once; a staged half's arrival is deferred, and made before the warpgroup's next wait that could
//     depend on it: at the top of its next task, when that task's first stage is not full yet (its producer may be
//     waiting for this arrival), and otherwise right after that task's mainloop (once a task's first stage is full, its
//     producer has passed the task's one dependency wait, so none of the task's later waits needs the arrival), and
//     after the last task. By induction on the task index the lowest unfinished task can always proceed: its
//     dependencies are finished (every arrival they need is made), and the tasks its CTA claimed before it are
//     finished, so its producer and consumers are on it.
//   * the row warps of every running CTA claim runs of 32 pool rows until none are left; they wait for nothing, so
//     every claimed run is counted and every run is claimed.
//   * within a CTA, the consumers wait only for their producer, the row warps for nothing.
// A grid of any size therefore completes with any subset of its CTAs running, with the same bits (a task's output
// does not depend on which CTA ran it). Each wait on another CTA is bounded (common/watchdog.cuh): past the timeout
// it records what it waited for and traps.
// Writes read later by TMA in another CTA: the zeroed rows (generic stores) and the s_q, s_sa of a tail or unaligned
// half (generic stores) are followed by the writer's fence.proxy.async.global, then a release; the s_q, s_sa of a
// staged half (TMA stores, the common case) are waited for (bulk wait_group) and fenced the same way before the
// release; the reader acquires, then fences before its TMA loads. The dispatch kernel's rows are complete at this
// kernel's start (stream order).
#pragma once

#include <cuda.h>

#include "common/device_check.hpp"
#include "common/fp8_quant_math.cuh"
#include "common/watchdog.cuh"
#include "dispatch_rows.cuh"
#include "epilogue.cuh"
#include "kernel_common.cuh"
#include "m_grouped_gemm_fp8.cuh"
#include "mainloop.cuh"
#include "mega_moe_fwd_roles.cuh"
#include "pipeline.cuh"
#include "swiglu_fwd_fp8.cuh"

namespace prime_kernels {
namespace sm90 {

struct MegaFwdFp8Params {
  // Source token rows: bf16 [num_tokens, hidden], row stride ld_x elements (single rank).
  const __nv_bfloat16* x;
  int64_t ld_x;
  const int32_t* pool_src_route;  // [m_total]: token * top_k + k per pool row (< 0: a row of zeros)
  int32_t top_k;
  int32_t num_tokens;
  const int32_t* expert_offsets;  // [num_experts + 1]
  int32_t num_experts;
  int32_t m_total;
  int32_t hidden;
  int32_t inter;
  // The pool route of each route [num_tokens * top_k] (< 0: none): a row counts as dispatched when its route names
  // it back.
  const int32_t* route_to_pool;
  // The dispatched pool: e4m3 [m_total, hidden] (row stride ld_x_q bytes; may be o's memory, see mega_moe.hpp) and
  // its 1 x 128 scales, K-block major (x_sa[j * ld_x_sa + m], j < hidden / 128).
  uint8_t* x_q;
  int64_t ld_x_q;
  float* x_sa;
  int64_t ld_x_sa;
  // The L1 with SwiGLU: W13's block scales, s_q / s_sa / h and pow2_scales, as the FP8 L1 kernel takes them.
  SwigluFwdFp8Params l1;
  // The L2: W2's block scales and o (d: bf16 [m_total, hidden]), as the FP8 GEMM takes them.
  MGroupedFp8Params l2;
  // Counters, zero before the launch: [max_m_blocks] rows written, [max_m_blocks] L1, then kMegaFwdNumClaims claim
  // counters (MegaFwdClaim; tasks and row runs only).
  int32_t* counters;
  int32_t max_m_blocks;
  int32_t l2_hints;  // bit 3: W13 / W2 loads evict_last (the other bits: the L2 epilogue's store hints)
  WaitGuard wait_guard;
  common::DeviceCheckRecord* check;
};

template <int kNumStages>
struct MegaFwdFp8Layout : StageRingLayout<128, 128, 128, kNumStages, 1> {
  using Ring = StageRingLayout<128, 128, 128, kNumStages, 1>;
  using Scales = MGroupedFp8Layout<128, kNumStages, 2>;  // the A-scale boxes: two per stage (L2's 1 x 64 blocks)
  static constexpr int kSaBoxBytes = Scales::kSaBoxBytes;
  static constexpr int kSaBytes = Scales::kSaBytes;  // one stage's two box slots; L1 fills the first
  static constexpr int kCOff = Ring::kRingEnd;     // the L2 epilogue's staging tile (1024-aligned)
  // The L1 epilogue's s and its scales, one 64-row half per consumer warpgroup, TMA-stored (h goes through kCOff)
  static constexpr int kSStageBytes = 64 * 64;  // 64 rows x 64 e4m3 columns
  static constexpr int kSStOff = kCOff + TmaStaging<128>::kBytes;
  static constexpr int kSaStOff = kSStOff + 2 * kSStageBytes;
  static constexpr int kSaOff = kSaStOff + 2 * 64 * 4;
  static constexpr int kBarOff = kSaOff + kNumStages * kSaBytes;
  static constexpr int kTaskOff = kBarOff + 2 * kNumStages * 8;
  static constexpr int kOffsOff = kTaskOff + 4 * kNumStages;
  static constexpr int kMbOff = kOffsOff + (kMegaMaxExperts + 1) * 4;
  static constexpr int kEnd = kMbOff + (kMegaMaxExperts + 1) * 4;
  static constexpr int kSmemBytes = kEnd + 1024;
  static constexpr int kL1TxBytes = Ring::kABytes + Ring::kBBytes + kSaBoxBytes;
  static constexpr int kL2TxBytes = Ring::kABytes + Ring::kBBytes + 2 * kSaBoxBytes;
  static_assert(kSmemBytes <= Ring::kSmemLimit, "shared memory budget exceeded");
  static_assert(kSaOff % 128 == 0 && kSaBytes % 128 == 0 && kSStOff % 128 == 0 && kSaStOff % 128 == 0,
                "TMA sources and destinations are 128-byte aligned");
};

// The row warps (producer warps 1-3 of every CTA): claim runs of 32 pool rows (one lane per row) until none are
// left; a row whose route names it back (route_to_pool[route] == row) was written by the dispatch kernel, every other
// row (a padded plan's padding rows, route < 0; rows of an inconsistent plan; a route past the tokens, noted) is
// zeroed here (bytes and scales, as the pipeline's padding fill: its h, s and o rows are then zeros). Then a proxy
// fence (TMA reads the rows) and one release per m-block the run touches, by the lane of its first row: disp_ctr[mb]
// gains the run's rows of mb.
template <int kBlockM>
__device__ __forceinline__ void mega_fp8_rows_role(const MegaFwdFp8Params& p, int lane, const int32_t* s_offs,
                                                   const int32_t* s_mb, int32_t* disp_ctr, int32_t* run_claim) {
  const int num_experts = p.num_experts;
  const int num_rows = s_offs[num_experts];
  const int num_routes = p.num_tokens * p.top_k;
  for (int base = 32 * warp_claim(run_claim, lane); base < num_rows; base = 32 * warp_claim(run_claim, lane)) {
    const int r = base + lane;
    bool zero = false;
    int mb = -1;
    if (r < num_rows) {
      const int route = __ldg(p.pool_src_route + r);
      if (route >= num_routes) common::note_device_check(p.check, common::kCheckMegaFwdRoute);
      zero = !(route >= 0 && route < num_routes && __ldg(p.route_to_pool + route) == r);
      const int g = pool_row_group(r, s_offs, num_experts);
      mb = s_mb[g] + (r - s_offs[g]) / kBlockM;
    }
    for (uint32_t rows = __ballot_sync(0xffffffffu, zero); rows != 0; rows &= rows - 1) {
      const int zr = __shfl_sync(0xffffffffu, r, __ffs(rows) - 1);
      uint8_t* out = p.x_q + zr * p.ld_x_q;
      for (int off = lane * 16; off < p.hidden; off += 32 * 16) ptx::st_global_v4(out + off, make_uint4(0, 0, 0, 0));
      for (int j = lane; j < p.hidden / 128; j += 32) p.x_sa[j * p.ld_x_sa + zr] = 0.0f;
    }
    const int prev_mb = __shfl_up_sync(0xffffffffu, mb, 1);
    const bool first = mb >= 0 && (lane == 0 || prev_mb != mb);
    const uint32_t firsts = __ballot_sync(0xffffffffu, first);
    ptx::fence_proxy_async_global();
    __syncwarp();
    if (first) {
      const uint32_t later = firsts & ~((2u << lane) - 1u);  // segment starts after this lane
      const int end = later ? __ffs(later) - 1 : min(32, num_rows - base);
      ptx::red_release_gpu_add(disp_ctr + mb, end - lane);
    }
  }
}

// The L1 epilogue of one warpgroup's 64 rows when all of them lie inside the expert: the values and bits of
// swiglu_fwd_fp8_epilogue (s from the fp32 accumulators, its 1 x 64 amax over the quad, fp8_block_scale, the
// division-free Q3; h rounded to bf16), written to this warpgroup's staging: s as 64 rows x 64 bytes at stg_s, the
// 64 row scales at stg_sa, h's gate and up boxes (h saved) at stg_h, for thread 0's TMA stores. Global stores of 2
// and 4 bytes from every thread, each a partial sector, are what the pipeline's FP8 L1 kernel spends its epilogue on.
__device__ __forceinline__ void mega_fp8_l1_stage(const MegaFwdFp8Params& p, const float (&acc)[64], uint32_t stg_h,
                                                  uint32_t stg_s, uint32_t stg_sa, int wg_tid) {
  const int lane = wg_tid & 31;
  const int r0 = 16 * (wg_tid >> 5) + (lane >> 2);  // this thread's rows r0, r0 + 8 of the half (wgmma m64 layout)
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = r0 + 8 * hh;
    float sv[16];
    const float amax = swiglu_fp8_row(acc, hh, sv);
    const float scale = common::fp8_block_scale(amax, p.l1.pow2_scales);
    const float rcp = common::fp8_scale_rcp(scale);
    if ((lane & 3) == 0) ptx::st_shared_u32(stg_sa + 4 * row, __float_as_uint(scale));
#pragma unroll
    for (int j = 0; j < 8; ++j)
      ptx::st_shared_u16(stg_s + row * 64 + 8 * j + 2 * (lane & 3),
                         static_cast<uint16_t>(common::e4m3x2_bits(sv[2 * j], sv[2 * j + 1], scale, rcp)));
  }
  if (p.l1.h != nullptr) write_acc_to_swizzled_staging<128>(acc, stg_h, wg_tid);  // gate box, then up box
}

// The FP8 forward's TMA producer: A (x_q or s_q) 128 rows x 128 bytes, B (W13's gate rows n0.. and up rows
// I + n0.., 64 each, or W2's 128 rows n0..) and A's scale boxes (one for L1, two for L2: its 1 x 64 blocks), all on
// the stage's full barrier. Dispatch counts one unit a row here.
template <typename L, int kNumStages, typename Seq>
__device__ __forceinline__ void mega_fp8_tma_producer(const MegaFwdFp8Params& p, const Seq& seq, int l2_ready,
                                                      uint8_t* smem, uint64_t* full_bar, uint64_t* empty_bar,
                                                      const CUtensorMap* tmap_xq, const CUtensorMap* tmap_xsa,
                                                      const CUtensorMap* tmap_w13, const CUtensorMap* tmap_sq,
                                                      const CUtensorMap* tmap_ssa, const CUtensorMap* tmap_w2) {
  const uint64_t pol_w = l2_policy_reused_loads(p.l2_hints);
  mega_producer_task_loop<L, kNumStages>(
      seq, 1, l2_ready, p.wait_guard, kWaitKernelMegaFwdFp8, smem, full_bar, empty_bar,
      [&](const auto& t, int kb, int stage) {
        uint8_t* sa = smem + L::kAOff + stage * L::kABytes;
        uint8_t* sb = smem + L::kBOff + stage * L::kBBytes;
        uint8_t* ss = smem + L::kSaOff + stage * L::kSaBytes;
        const int k0 = kb * L::kBlockK;
        // scale boxes start at the 16-byte boundary at or before row0 (MGroupedFp8Layout::kSaBoxRows)
        if (t.l1) {
          ptx::mbar_arrive_expect_tx(&full_bar[stage], L::kL1TxBytes);
          ptx::tma_load_2d(sa, tmap_xq, &full_bar[stage], k0, t.row0);
          ptx::tma_load_3d_hint(sb, tmap_w13, &full_bar[stage], k0, t.n0, t.e, pol_w);
          ptx::tma_load_3d_hint(sb + 64 * 128, tmap_w13, &full_bar[stage], k0, p.inter + t.n0, t.e, pol_w);
          ptx::tma_load_2d(ss, tmap_xsa, &full_bar[stage], t.row0 & ~3, kb);
        } else {
          ptx::mbar_arrive_expect_tx(&full_bar[stage], L::kL2TxBytes);
          ptx::tma_load_2d(sa, tmap_sq, &full_bar[stage], k0, t.row0);
          ptx::tma_load_3d_hint(sb, tmap_w2, &full_bar[stage], k0, t.n0, t.e, pol_w);
#pragma unroll
          for (int i = 0; i < 2; ++i)
            ptx::tma_load_2d(ss + i * (L::kSaBytes / 2), tmap_ssa, &full_bar[stage], t.row0 & ~3, 2 * kb + i);
        }
      });
}

template <int kNumStages>
__global__ void __launch_bounds__(kNumThreads, 1)
    mega_moe_fwd_fp8_kernel(const __grid_constant__ CUtensorMap tmap_xq, const __grid_constant__ CUtensorMap tmap_xsa,
                            const __grid_constant__ CUtensorMap tmap_w13, const __grid_constant__ CUtensorMap tmap_sq,
                            const __grid_constant__ CUtensorMap tmap_ssa, const __grid_constant__ CUtensorMap tmap_w2,
                            const __grid_constant__ CUtensorMap tmap_o, const __grid_constant__ CUtensorMap tmap_h,
                            const __grid_constant__ CUtensorMap tmap_sq_st,
                            const __grid_constant__ CUtensorMap tmap_ssa_st, const __grid_constant__ MegaFwdFp8Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = MegaFwdFp8Layout<kNumStages>;
  constexpr int kBlockM = L::kBlockM;
  constexpr int kBlockN = L::kBlockN;
  constexpr int kBlockK = L::kBlockK;
  using Mma = ptx::WgmmaFp8E4m3<kBlockN>;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + L::kBarOff);
  uint64_t* empty_bar = full_bar + kNumStages;
  int32_t* s_offs = reinterpret_cast<int32_t*>(smem + L::kOffsOff);
  int32_t* s_mb = reinterpret_cast<int32_t*>(smem + L::kMbOff);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  if (!mega_fwd_prologue<kNumStages, kBlockM>(p, full_bar, empty_bar, kNumConsumerThreads / 32, s_offs, s_mb,
                                              blockIdx.x == 0,
                                              &tmap_xq, &tmap_xsa, &tmap_w13, &tmap_sq, &tmap_ssa, &tmap_w2, &tmap_o,
                                              &tmap_sq_st, &tmap_ssa_st,
                                              [&] { return p.l1.h != nullptr ? &tmap_h : nullptr; }))
    return;
  // An L1 n-block is 64 columns of I (gate and up: 128 accumulator columns), an L2 n-block 128 columns of H.
  using Seq = MegaTileSequence<kBlockM, kBlockN, kBlockK>;
  // (each role builds its own Seq after its setmaxnreg: values live across the reallocation are spilled)

  if (warp < 4) {
    ptx::setmaxnreg_dec<kMegaProducerRegs>();
    if (warp == 0 && lane == 0) {
      const Seq seq(p, s_offs, s_mb);
      mega_fp8_tma_producer<L, kNumStages>(p, seq, 2 * seq.n1, smem, full_bar, empty_bar, &tmap_xq, &tmap_xsa,
                                           &tmap_w13, &tmap_sq, &tmap_ssa, &tmap_w2);
    } else if (warp >= 1) {
      mega_fp8_rows_role<kBlockM>(p, lane, s_offs, s_mb, p.counters,
                                  p.counters + 2 * p.max_m_blocks + kClaimDispatchRun);
    }
  } else {
    // ================= consumer warpgroups
    ptx::setmaxnreg_inc<kMegaConsumerRegs>();
    const Seq seq(p, s_offs, s_mb);
    const int wg = (warp >> 2) - 1;
    const int wg_tid = tid - 128 * (wg + 1);
    const int frag_row = 64 * wg + 16 * ((wg_tid >> 5) & 3) + (lane >> 2);
    const StageDescHalves desc = k_major_stage_descs(smem + L::kAOff, smem + L::kBOff, wg);
    const float* s_sa = reinterpret_cast<const float*>(smem + L::kSaOff);
    const uint32_t stg_half = ptx::smem_addr(smem + L::kCOff) + wg * TmaStaging<kBlockN>::kHalfBytes;
    const uint32_t stg_s = ptx::smem_addr(smem + L::kSStOff) + wg * L::kSStageBytes;
    const uint32_t stg_sa = ptx::smem_addr(smem + L::kSaStOff) + wg * 64 * 4;
    const volatile int32_t* stage_task = reinterpret_cast<const volatile int32_t*>(smem + L::kTaskOff);
    // A staged L1 tile's arrival on its m-block's L1 counter waits until its TMA stores have landed (a few
    // microseconds): thread 0 of the warpgroup makes it after the next tile's mainloop, or before the next tile's
    // first wait if that stage is not ready (the producer may be waiting for this very arrival: an L2 tile of the
    // same m-block). Any later is harmless: the L2 tiles that wait for it come after every L1 task.
    int pending_mb = -1;  // meaningful in wg_tid 0 only
    auto arrive_pending = [&] {
      if (wg_tid == 0 && pending_mb >= 0) {
        ptx::bulk_wait_group<0>();        // this thread's TMA stores (s, its scales, h) are complete
        ptx::fence_proxy_async_global();  // async-proxy writes, before the generic release
        ptx::red_release_gpu_add(seq.l1_ctr + pending_mb, 1);
        pending_mb = -1;
      }
    };

    float acc[kBlockN / 2];
    float part0[kBlockN / 2], part1[kBlockN / 2];
    int stage = 0;
    uint32_t phase = 0;
    int e = 0;
    bool in_l2 = false;
    for (;;) {
      if (wg_tid == 0 && pending_mb >= 0 && !ptx::mbar_test_wait(&full_bar[stage], phase)) arrive_pending();
      ptx::mbar_wait(&full_bar[stage], phase);
      // read by the lane that later releases the stage, so that the read is ordered before the producer's next
      // write of this slot by that lane's own program order
      const int u = __shfl_sync(0xffffffffu, lane == 0 ? stage_task[stage] : 0, 0);
      if (u < 0) break;
      const auto t = seq.locate(u, e, in_l2);
      const bool active = t.row0 + 64 * wg < t.row_end;
      auto release = [&](int s_) {
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(&empty_bar[s_]);
      };
      const int sa_row = frag_row + (t.row0 & 3);  // the scale boxes start at row0 & ~3
      if (t.l1) {
        const float* sb_e = p.l1.sb + t.e * p.l1.sb_group_stride;
        // one partial, as the FP8 L1 kernel (the same promotion order, so the same bits)
        consumer_tile_mainloop_promoted<Mma, kNumStages, kBlockK, L::kABytes, L::kBBytes, 1, false>(
            acc, part0, part1, active, seq.kb1, full_bar, stage, phase, desc.a_lo0, desc.a_hi, desc.b_lo0, desc.b_hi,
            RowTimesGateUpScales<L::kSaBytes / 4, kBlockN / 2>{sb_e + (t.n0 / 128) * p.l1.sb_n_stride,
                                                               sb_e + ((p.inter + t.n0) / 128) * p.l1.sb_n_stride,
                                                               s_sa, sa_row},
            release);
        arrive_pending();
        const int hrow0 = t.row0 + 64 * wg;
        // All 64 rows inside the expert and the half on a 4-row boundary: staged, TMA stores. The scales' store box
        // starts at row hrow0 of s_sa, its innermost dimension, which TMA takes only on a 16-byte boundary (an
        // unpadded plan's m-blocks start anywhere: their halves take the generic stores below).
        if (hrow0 + 64 <= t.row_end && (hrow0 & 3) == 0) {
          if (wg_tid == 0) ptx::bulk_wait_group_read<0>();  // the previous stores have read the staging
          ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
          mega_fp8_l1_stage(p, acc, stg_half, stg_s, stg_sa, wg_tid);
          ptx::fence_proxy_async_smem();
          ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
          if (wg_tid == 0) {
            if (p.l1.h != nullptr) {
              const uint64_t pol = l2_policy_store(p.l2.l2_hints, 0);  // h is read by the backward only
              ptx::tma_store_2d_hint(&tmap_h, stg_half, t.n0, hrow0, pol);
              ptx::tma_store_2d_hint(&tmap_h, stg_half + TmaStaging<kBlockN>::kBoxBytes, p.inter + t.n0, hrow0, pol);
            }
            ptx::tma_store_2d(&tmap_sq_st, stg_s, t.n0, hrow0);
            ptx::tma_store_2d(&tmap_ssa_st, stg_sa, hrow0, t.n0 / kSwigluFwdFp8Block);
            ptx::bulk_commit_group();
            pending_mb = t.mb;
          }
        } else {  // a tail half, an unaligned half or no rows: generic stores (or none), then the arrival at once
          if (active) {
            swiglu_fwd_fp8_epilogue(p.l1, acc, t.row0, t.row_end, t.n0, frag_row, lane);
            ptx::fence_proxy_async_global();  // s_q, s_sa are read by TMA in whichever CTA runs the L2 tiles
          }
          ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
          if (wg_tid == 0) ptx::red_release_gpu_add(seq.l1_ctr + t.mb, 1);
        }
      } else {
        const float* sb_e = p.l2.sb + t.e * p.l2.sb_group_stride;
        // one partial, as the FP8 GEMM with 1 x 64 A scales
        consumer_tile_mainloop_promoted<Mma, kNumStages, kBlockK, L::kABytes, L::kBBytes, 2, false>(
            acc, part0, part1, active, seq.kb2, full_bar, stage, phase, desc.a_lo0, desc.a_hi, desc.b_lo0, desc.b_hi,
            RowTimesTileScalesSplitK<L::kSaBytes / 4, L::kSaBytes / 8, kBlockN / 2>{
                sb_e + (t.n0 / kBlockN) * p.l2.sb_n_stride, s_sa, sa_row},
            release);
        arrive_pending();
        if (active)
          store_acc_half_async<kBlockN>(acc, stg_half, wg, wg_tid, &tmap_o, t.row0 + 64 * wg, t.row_end, t.n0,
                                        p.hidden, p.l2.l2_hints, p.l2.d, p.l2.ldd);
      }
    }
    arrive_pending();
    if (wg_tid == 0) ptx::bulk_wait_group<0>();  // o's stores complete before the CTA's shared memory goes away
  }
#endif
}

}  // namespace sm90
}  // namespace prime_kernels
