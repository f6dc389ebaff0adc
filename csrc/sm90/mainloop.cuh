// prime-kernels: the consumer warpgroups' k-loops of the sm90 kernels: wgmma over the stage ring's descriptors,
// each stage released once the MMAs that read it have completed (no __global__ here).
#pragma once

#include <cstdint>
#include <type_traits>

#include "pipeline.cuh"
#include "ptx.cuh"

namespace prime_kernels {
namespace sm90 {

// A consumer warpgroup's wgmma descriptors for stage 0 of a ring of K-major, 128-byte-swizzled tiles (rows of 128
// bytes, 8-row groups 1024 bytes apart): A at its 64 of the tile's rows (warpgroup wg), B at the whole tile; as
// 32-bit halves, since stage and k-step offsets are added to the low halves only (ptx::desc_from_halves).
struct StageDescHalves {
  uint32_t a_lo0, a_hi, b_lo0, b_hi;
};
__device__ __forceinline__ StageDescHalves k_major_stage_descs(const uint8_t* a_stage0, const uint8_t* b_stage0,
                                                               int wg) {
  const uint64_t da = ptx::make_desc_sw128(ptx::smem_addr(a_stage0) + wg * (64 * 128), 0, 1024);
  const uint64_t db = ptx::make_desc_sw128(ptx::smem_addr(b_stage0), 0, 1024);
  return StageDescHalves{static_cast<uint32_t>(da), static_cast<uint32_t>(da >> 32), static_cast<uint32_t>(db),
                         static_cast<uint32_t>(db >> 32)};
}

// One tile's k-loop for a consumer warpgroup of the m-grouped kernels: waits for each stage of the mbarrier
// ring, issues its kBlockK / 16 wgmma (one group kept in flight) and releases the stage once the group that
// read it has completed (release(stage)); a warpgroup with no rows (active = false) only releases stages.
// acc is zeroed first and settled on return. Descriptors: stage s, k-step kk adds s * kStageA/BBytes and
// kk * 32 (A) / kBStepBytes (B) bytes (>> 4) to the low halves a_lo0 / b_lo0. kProxyFence: A was written
// through the generic proxy (cp.async gather), fence before wgmma reads it.
// kAStepBytes: A's k16 step (32 bytes for K-major A; 16 rows of 128 bytes for MN-major A).
// hook (optional, NoTileHook shows the interface): before_first_wait(bar, parity) runs before the first
// k-block's wait and after_first_issue() once that k-block's MMAs are issued (an inactive warpgroup: right
// after before_first_wait): work of the previous tile that may wait until this tile's MMAs are queued;
// on_stage(kb, stage) runs once k-block kb's stage has landed, before its MMAs (e.g. to patch the stage).
struct NoTileHook {
  __device__ __forceinline__ void before_first_wait(uint64_t*, uint32_t) const {}
  __device__ __forceinline__ void after_first_issue() const {}
  __device__ __forceinline__ void on_stage(int, int) const {}
};

template <typename Mma, int kNumStages, int kBlockK, int kStageABytes, int kStageBBytes, uint32_t kBStepBytes,
          bool kProxyFence, uint32_t kAStepBytes = 32, int kAccRegs, typename ReleaseFn, typename Hook = NoTileHook>
__device__ __forceinline__ void consumer_tile_mainloop(float (&acc)[kAccRegs], bool active, int num_k_blocks,
                                                       uint64_t* full_bar, int& stage, uint32_t& phase,
                                                       uint32_t a_lo0, uint32_t a_hi, uint32_t b_lo0,
                                                       uint32_t b_hi, ReleaseFn&& release, Hook&& hook = Hook{}) {
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) acc[i] = 0.f;
  int prev_stage = 0;
  hook.before_first_wait(&full_bar[stage], phase);
  if (!active) {
    hook.after_first_issue();
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      ptx::mbar_wait(&full_bar[stage], phase);
      release(stage);
      advance_stage<kNumStages>(stage, phase);
    }
  } else {
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      ptx::mbar_wait(&full_bar[stage], phase);
      hook.on_stage(kb, stage);
      // (compile-time: a runtime test here costs the consumers registers they do not have at 224)
      if constexpr (kProxyFence) ptx::fence_proxy_async_smem();
#pragma unroll
      for (int i = 0; i < kAccRegs; ++i) ptx::reg_fence(acc[i]);
      ptx::wgmma_fence();
      const uint32_t a_lo = a_lo0 + static_cast<uint32_t>(stage) * (kStageABytes >> 4);
      const uint32_t b_lo = b_lo0 + static_cast<uint32_t>(stage) * (kStageBBytes >> 4);
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        const uint64_t da = ptx::desc_from_halves(a_lo + kk * (kAStepBytes >> 4), a_hi);
        const uint64_t db = ptx::desc_from_halves(b_lo + kk * (kBStepBytes >> 4), b_hi);
        Mma::mma(acc, da, db, 1u);
      }
      ptx::wgmma_commit();
#pragma unroll
      for (int i = 0; i < kAccRegs; ++i) ptx::reg_fence(acc[i]);
      if (kb == 0) hook.after_first_issue();
      if (kb > 0) {
        ptx::wgmma_wait<1>();
        release(prev_stage);
      }
      prev_stage = stage;
      advance_stage<kNumStages>(stage, phase);
    }
  }
  ptx::wgmma_wait<0>();  // unconditional: lets ptxas see every accumulator settled on all paths
  if (active && num_k_blocks > 0) release(prev_stage);
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) ptx::reg_fence(acc[i]);
}

// Promotion of one k-block's partial sums into the fp32 accumulator of an m64 wgmma fragment (4 registers per
// 8-column group: rows r, r + 8 of columns c, c + 1): acc = fma(part, scale, acc), the scale the fp32 product of the
// two operands' block scales, as the recipe's emulation (docs/fp8.md, G2-G3) rounds it. promote_rows: one scale per
// row (s_lo for row r, s_hi for row r + 8: A's row scale times B's one scale per tile); promote_rows_cols: a row
// scale times a column scale (col_of(j): the scales of columns c, c + 1 of group j), both operands scaled per row of C.
template <int kAccRegs>
__device__ __forceinline__ void promote_rows(float (&acc)[kAccRegs], const float (&part)[kAccRegs], float s_lo,
                                             float s_hi) {
#pragma unroll
  for (int j = 0; j < kAccRegs / 4; ++j) {
    acc[4 * j + 0] = fmaf(part[4 * j + 0], s_lo, acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(part[4 * j + 1], s_lo, acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(part[4 * j + 2], s_hi, acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(part[4 * j + 3], s_hi, acc[4 * j + 3]);
  }
}
template <int kAccRegs, typename ColFn>
__device__ __forceinline__ void promote_rows_cols(float (&acc)[kAccRegs], const float (&part)[kAccRegs], float s_lo,
                                                  float s_hi, ColFn&& col_of) {
#pragma unroll
  for (int j = 0; j < kAccRegs / 4; ++j) {
    const float2 col = col_of(j);  // read where it is used: the partials beside it leave no room for all 16
    acc[4 * j + 0] = fmaf(part[4 * j + 0], s_lo * col.x, acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(part[4 * j + 1], s_lo * col.y, acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(part[4 * j + 2], s_hi * col.x, acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(part[4 * j + 3], s_hi * col.y, acc[4 * j + 3]);
  }
}

// One tile's k-loop for a consumer warpgroup of the blockwise-FP8 grouped kernels (m_grouped_gemm_fp8.cuh,
// k_grouped_gemm_fp8.cuh), with promotion: each k-block's kBlockK / Mma::kK wgmma sum into a partial accumulator
// (the first overwrites it), and once they have completed, the partial times the block's scales is added into the
// fp32 accumulator acc. The tensor core's adder keeps fewer mantissa bits than fp32 for e4m3 products; summing only
// one 128-K block there and the blocks in fp32 bounds that loss to one block's worth whatever K is (DeepSeek-V3's
// recipe).
// Two partials, part0 and part1, take turns: k-block kb + 1's MMAs are issued into one before k-block kb's promotion
// from the other, so the tensor core has this warpgroup's next MMAs queued while its CUDA cores promote (with one
// partial the promotion waits for the MMAs and the MMAs for the promotion; for a row x column scaled k-grouped tile
// the promotion is two fp32 operations per accumulator, about half the MMAs' time). A stage is released once its
// promotion has read its scales, so a warpgroup holds at most two stages.
// `scales` gives the block scales in two steps: pre = scales.prefetch(kb) before k-block kb's wait (a global load is
// then in flight during the wait and the MMAs), and scales.apply(pre, stage, sub, part, acc) adds part times the
// scales (read from the landed stage, before its release) into acc. kTwoPartials = false keeps part0 only and calls
// f = scales.load(pre, stage, sub), releases the stage, then scales.apply_loaded(f, part, acc): for the kernels where
// two partials measured slower (the FP8 L2 dgrad, whose ring has 3 stages, and the FP8 forward's L1 with SwiGLU and
// its L2 with 1 x 64 A scales; docs/performance.md). kPromoteSteps = 2: A's scales change every
// kBlockK / 2 of K (an L2 operand quantized 1 x 64), so each stage's k-steps are issued in two groups, each promoted
// with its own A scales (sub = 0, 1). A warpgroup with no rows (active = false) only releases stages. acc is zeroed
// first; on return every stage this call waited for is released and stage / phase point past them.
template <typename Mma, int kNumStages, int kBlockK, int kStageABytes, int kStageBBytes, int kPromoteSteps = 1,
          bool kTwoPartials = true, int kAccRegs, typename Scales, typename ReleaseFn>
__device__ __forceinline__ void consumer_tile_mainloop_promoted(float (&acc)[kAccRegs], float (&part0)[kAccRegs],
                                                                float (&part1)[kAccRegs], bool active,
                                                                int num_k_blocks, uint64_t* full_bar, int& stage,
                                                                uint32_t& phase, uint32_t a_lo0, uint32_t a_hi,
                                                                uint32_t b_lo0, uint32_t b_hi, const Scales& scales,
                                                                ReleaseFn&& release) {
  static_assert(kAccRegs % 4 == 0, "m64 fragment: 4 registers per 8-column group");
  static_assert(kPromoteSteps == 1 || kPromoteSteps == 2, "one or two promotions per k-block");
  constexpr uint32_t kKStepDesc = (Mma::kK * 1) >> 4;  // one k-step of 1-byte elements along a K-major row
  constexpr int kStepsPerPromotion = kBlockK / Mma::kK / kPromoteSteps;
  static_assert(kStepsPerPromotion * kPromoteSteps * Mma::kK == kBlockK, "promotions split the k-block evenly");
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) acc[i] = 0.f;
  if (!active) {
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      ptx::mbar_wait(&full_bar[stage], phase);
      release(stage);
      advance_stage<kNumStages>(stage, phase);
    }
    return;
  }
  // One unit's MMAs (sub-step sub of the landed stage's k-steps) into part, committed as one wgmma group.
  auto issue_mmas = [&](float(&part)[kAccRegs], int stage_, int sub) {
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) ptx::reg_fence(part[i]);
    ptx::wgmma_fence();
    const uint32_t a_lo = a_lo0 + static_cast<uint32_t>(stage_) * (kStageABytes >> 4);
    const uint32_t b_lo = b_lo0 + static_cast<uint32_t>(stage_) * (kStageBBytes >> 4);
#pragma unroll
    for (int j = 0; j < kStepsPerPromotion; ++j) {
      const int kk = sub * kStepsPerPromotion + j;
      Mma::mma(part, ptx::desc_from_halves(a_lo + kk * kKStepDesc, a_hi),
               ptx::desc_from_halves(b_lo + kk * kKStepDesc, b_hi), j > 0 ? 1u : 0u);
    }
    ptx::wgmma_commit();
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) ptx::reg_fence(part[i]);
  };
  if constexpr (!kTwoPartials) {
    // part0 only: each k-block's (or half k-block's) MMAs waited for, its scales read from the stage, the stage
    // released (the producer refills it during the promotion), then the promotion
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      const auto pre = scales.prefetch(kb);
      ptx::mbar_wait(&full_bar[stage], phase);
#pragma unroll
      for (int sub = 0; sub < kPromoteSteps; ++sub) {
        issue_mmas(part0, stage, sub);
        ptx::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < kAccRegs; ++i) ptx::reg_fence(part0[i]);
        const auto f = scales.load(pre, stage, sub);
        if (sub == kPromoteSteps - 1) release(stage);
        scales.apply_loaded(f, part0, acc);
      }
      advance_stage<kNumStages>(stage, phase);
    }
    return;
  }
  // Units u = kb * kPromoteSteps + sub, issued in order, alternately into part0 and part1; with two promotions per
  // k-block a unit's sub-step is then its partial's index.
  const int num_units = num_k_blocks * kPromoteSteps;
  if (num_units == 0) return;
  using Pre = decltype(scales.prefetch(0));
  Pre pre_issued{}, pre_retiring{};
  int issue_stage = stage;
  uint32_t issue_phase = phase;
  auto issue = [&](float(&part)[kAccRegs], int u, auto sub_tag) {
    constexpr int kSub = decltype(sub_tag)::value;
    pre_retiring = pre_issued;  // the unit before this one: this k-block's (sub 1) or the previous one's
    if constexpr (kSub == 0) {
      pre_issued = scales.prefetch(u / kPromoteSteps);
      ptx::mbar_wait(&full_bar[issue_stage], issue_phase);
    }
    issue_mmas(part, issue_stage, kSub);
    if constexpr (kSub == kPromoteSteps - 1) advance_stage<kNumStages>(issue_stage, issue_phase);
  };
  // the oldest unit not yet promoted, whose MMAs the caller has waited for
  auto retire = [&](float(&part)[kAccRegs], auto sub_tag) {
    constexpr int kSub = decltype(sub_tag)::value;
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) ptx::reg_fence(part[i]);
    scales.apply(pre_retiring, stage, kSub, part, acc);
    if constexpr (kSub == kPromoteSteps - 1) {
      release(stage);
      advance_stage<kNumStages>(stage, phase);
    }
  };
  using Sub0 = std::integral_constant<int, 0>;
  using Sub1 = std::integral_constant<int, kPromoteSteps - 1>;
  issue(part0, 0, Sub0{});
  for (int u = 1;; u += 2) {
    if (u == num_units) {
      ptx::wgmma_wait<0>();
      pre_retiring = pre_issued;
      retire(part0, Sub0{});
      break;
    }
    issue(part1, u, Sub1{});
    ptx::wgmma_wait<1>();
    retire(part0, Sub0{});
    if (u + 1 == num_units) {
      ptx::wgmma_wait<0>();
      pre_retiring = pre_issued;
      retire(part1, Sub1{});
      break;
    }
    issue(part0, u + 1, Sub0{});
    ptx::wgmma_wait<1>();
    retire(part1, Sub1{});
  }
}

// One tile's mainloop for a ping-pong consumer warpgroup that owns 128 rows: acc0 gets rows 0..63 and acc1
// rows 64..127 of each A stage (two m64 wgmma per k16 step against the same B). Both wgmma are issued
// unconditionally: a wgmma under a divergent branch makes ptxas serialize every wgmma of the kernel
// (C7520), so rows past an m-block's end compute on whatever the box holds and are never stored. Stages
// are released to the producer (empty_bar, one arrival per warp) as soon as the next k-block's MMAs are
// issued; pass_turn() runs once all of the tile's MMAs are issued (the other warpgroup may then issue its
// own), before the wait for them to finish. A is K-major (a k16 step: 32 bytes) unless kAStepDesc says
// otherwise: an MN-major A in two 64-row boxes of 8 KB steps 16 rows of 128 bytes, and its rows 64..127 start
// 8 KB in as well. hook.on_stage(kb, stage) runs once k-block kb has landed, before its MMAs (NoTileHook).
template <typename Mma, int kNumStages, int kBlockK, int kStageABytes, int kStageBBytes, uint32_t kBStepDesc,
          uint32_t kAStepDesc = (32 >> 4), int kAccRegs, typename PassTurn, typename Hook = NoTileHook>
__device__ __forceinline__ void pingpong_tile_mainloop(float (&acc0)[kAccRegs], float (&acc1)[kAccRegs],
                                                       int num_k_blocks, uint64_t* full_bar, uint64_t* empty_bar,
                                                       int& stage, uint32_t& phase, uint32_t a_lo0, uint32_t a_hi,
                                                       uint32_t b_lo0, uint32_t b_hi, int lane,
                                                       PassTurn&& pass_turn, const Hook& hook = Hook{}) {
  constexpr uint32_t kHalfADesc = (64 * 128) >> 4;  // rows 64..127 of a 128-byte-swizzled A stage
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) {
    acc0[i] = 0.f;
    acc1[i] = 0.f;
  }
  int prev_stage = 0;
  for (int kb = 0; kb < num_k_blocks; ++kb) {
    ptx::mbar_wait(&full_bar[stage], phase);
    hook.on_stage(kb, stage);
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) {
      ptx::reg_fence(acc0[i]);
      ptx::reg_fence(acc1[i]);
    }
    ptx::wgmma_fence();
    const uint32_t a_lo = a_lo0 + static_cast<uint32_t>(stage) * (kStageABytes >> 4);
    const uint32_t b_lo = b_lo0 + static_cast<uint32_t>(stage) * (kStageBBytes >> 4);
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      const uint64_t db = ptx::desc_from_halves(b_lo + kk * kBStepDesc, b_hi);
      Mma::mma(acc0, ptx::desc_from_halves(a_lo + kk * kAStepDesc, a_hi), db, 1u);
      Mma::mma(acc1, ptx::desc_from_halves(a_lo + kHalfADesc + kk * kAStepDesc, a_hi), db, 1u);
    }
    ptx::wgmma_commit();
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) {
      ptx::reg_fence(acc0[i]);
      ptx::reg_fence(acc1[i]);
    }
    if (kb > 0) {
      ptx::wgmma_wait<1>();
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(&empty_bar[prev_stage]);
    }
    prev_stage = stage;
    advance_stage<kNumStages>(stage, phase);
  }
  pass_turn();
  ptx::wgmma_wait<0>();
  __syncwarp();
  if (lane == 0 && num_k_blocks > 0) ptx::mbar_arrive(&empty_bar[prev_stage]);
}

}  // namespace sm90
}  // namespace prime_kernels
