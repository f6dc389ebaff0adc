// prime-kernels: the consumer warpgroups' k-loops of the sm90 kernels: wgmma over the stage ring's descriptors,
// each stage released once the MMAs that read it have completed (no __global__ here).
#pragma once

#include <cstdint>

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
// scale times a column scale (col[j] the scales of columns c, c + 1 of group j), both operands scaled per row of C.
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
template <int kAccRegs>
__device__ __forceinline__ void promote_rows_cols(float (&acc)[kAccRegs], const float (&part)[kAccRegs], float s_lo,
                                                  float s_hi, const float2 (&col)[kAccRegs / 4]) {
#pragma unroll
  for (int j = 0; j < kAccRegs / 4; ++j) {
    acc[4 * j + 0] = fmaf(part[4 * j + 0], s_lo * col[j].x, acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(part[4 * j + 1], s_lo * col[j].y, acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(part[4 * j + 2], s_hi * col[j].x, acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(part[4 * j + 3], s_hi * col[j].y, acc[4 * j + 3]);
  }
}

// One tile's k-loop for a consumer warpgroup of the blockwise-FP8 grouped kernels (m_grouped_gemm_fp8.cuh,
// k_grouped_gemm_fp8.cuh), with promotion: each k-block's kBlockK / Mma::kK wgmma sum into `part` (the first
// overwrites it), and once they have completed, part times the block's scales is added into the fp32 accumulator acc.
// The tensor core's adder keeps fewer mantissa bits than fp32 for e4m3 products; summing only one 128-K block there
// and the blocks in fp32 bounds that loss to one block's worth whatever K is (DeepSeek-V3's recipe). Each k-block's
// MMAs are waited for before its promotion, so the two consumer warpgroups' MMAs and promotions interleave on the
// tensor cores. `scales` gives the block scales in three steps: pre = scales.prefetch(kb) before the stage's wait
// (a global load is then in flight during the wait and the MMAs), f = scales.load(pre, stage) from the landed stage
// before release(stage) hands it back, and scales.apply(f, part, acc) after it. A warpgroup with no rows
// (active = false) only releases stages. acc is zeroed first.
template <typename Mma, int kNumStages, int kBlockK, int kStageABytes, int kStageBBytes, int kPromoteSteps = 1,
          int kAccRegs, typename Scales, typename ReleaseFn>
__device__ __forceinline__ void consumer_tile_mainloop_promoted(float (&acc)[kAccRegs], float (&part)[kAccRegs],
                                                                bool active, int num_k_blocks, uint64_t* full_bar,
                                                                int& stage, uint32_t& phase, uint32_t a_lo0,
                                                                uint32_t a_hi, uint32_t b_lo0, uint32_t b_hi,
                                                                const Scales& scales, ReleaseFn&& release) {
  static_assert(kAccRegs % 4 == 0, "m64 fragment: 4 registers per 8-column group");
  constexpr uint32_t kKStepDesc = (Mma::kK * 1) >> 4;  // one k-step of 1-byte elements along a K-major row
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
  // kPromoteSteps > 1: A's scales change every kBlockK / kPromoteSteps of K (an L2 operand quantized 1 x 64), so
  // the stage's k-steps are issued in that many groups, each waited for and promoted with its own A scales.
  constexpr int kStepsPerPromotion = kBlockK / Mma::kK / kPromoteSteps;
  static_assert(kStepsPerPromotion * kPromoteSteps * Mma::kK == kBlockK, "promotions split the k-block evenly");
  for (int kb = 0; kb < num_k_blocks; ++kb) {
    const auto pre = scales.prefetch(kb);
    ptx::mbar_wait(&full_bar[stage], phase);
    const uint32_t a_lo = a_lo0 + static_cast<uint32_t>(stage) * (kStageABytes >> 4);
    const uint32_t b_lo = b_lo0 + static_cast<uint32_t>(stage) * (kStageBBytes >> 4);
#pragma unroll
    for (int sub = 0; sub < kPromoteSteps; ++sub) {
#pragma unroll
      for (int i = 0; i < kAccRegs; ++i) ptx::reg_fence(part[i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int j = 0; j < kStepsPerPromotion; ++j) {
        const int kk = sub * kStepsPerPromotion + j;
        Mma::mma(part, ptx::desc_from_halves(a_lo + kk * kKStepDesc, a_hi),
                 ptx::desc_from_halves(b_lo + kk * kKStepDesc, b_hi), j > 0 ? 1u : 0u);
      }
      ptx::wgmma_commit();
#pragma unroll
      for (int i = 0; i < kAccRegs; ++i) ptx::reg_fence(part[i]);
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < kAccRegs; ++i) ptx::reg_fence(part[i]);
      if constexpr (kPromoteSteps == 1) {
        const auto f = scales.load(pre, stage);
        release(stage);
        scales.apply(f, part, acc);
      } else {
        const auto f = scales.load(pre, stage, sub);
        if (sub == kPromoteSteps - 1) release(stage);
        scales.apply(f, part, acc);
      }
    }
    advance_stage<kNumStages>(stage, phase);
  }
}

// One tile's mainloop for a ping-pong consumer warpgroup that owns 128 rows: acc0 gets rows 0..63 and acc1
// rows 64..127 of each A stage (two m64 wgmma per k16 step against the same B). Both wgmma are issued
// unconditionally: a wgmma under a divergent branch makes ptxas serialize every wgmma of the kernel
// (C7520), so rows past an m-block's end compute on whatever the box holds and are never stored. Stages
// are released to the producer (empty_bar, one arrival per warp) as soon as the next k-block's MMAs are
// issued; pass_turn() runs once all of the tile's MMAs are issued (the other warpgroup may then issue its
// own), before the wait for them to finish.
template <typename Mma, int kNumStages, int kBlockK, int kStageABytes, int kStageBBytes, uint32_t kBStepDesc,
          int kAccRegs, typename PassTurn>
__device__ __forceinline__ void pingpong_tile_mainloop(float (&acc0)[kAccRegs], float (&acc1)[kAccRegs],
                                                       int num_k_blocks, uint64_t* full_bar, uint64_t* empty_bar,
                                                       int& stage, uint32_t& phase, uint32_t a_lo0, uint32_t a_hi,
                                                       uint32_t b_lo0, uint32_t b_hi, int lane,
                                                       PassTurn&& pass_turn) {
  constexpr uint32_t kHalfADesc = (64 * 128) >> 4;  // rows 64..127 of a 128-byte-swizzled A stage
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) {
    acc0[i] = 0.f;
    acc1[i] = 0.f;
  }
  int prev_stage = 0;
  for (int kb = 0; kb < num_k_blocks; ++kb) {
    ptx::mbar_wait(&full_bar[stage], phase);
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
      Mma::mma(acc0, ptx::desc_from_halves(a_lo + kk * (32 >> 4), a_hi), db, 1u);
      Mma::mma(acc1, ptx::desc_from_halves(a_lo + kHalfADesc + kk * (32 >> 4), a_hi), db, 1u);
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
