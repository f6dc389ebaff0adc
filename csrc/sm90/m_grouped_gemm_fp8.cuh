// prime-kernels: sm90a m-grouped GEMM with blockwise-scaled FP8 (e4m3) operands (rows grouped by expert).
//
//   D[m, n] = bf16( sum over k-blocks kb of 128:  (A[m, kb] . B_g[n, kb]) * sa[m, kb] * sb_g[n / 128, kb] )
//   for every row m in [offs[g], offs[g+1]),  g = 0 .. E-1
//
//   A   [M_total, K] e4m3, K contiguous (row stride lda bytes), one fp32 scale per row per 128 of K.
//   B   [E, N, K] e4m3, K contiguous ("nt": sm90's FP8 wgmma reads both operands K-major only), one fp32 scale per
//       128 x 128 block.
//   sa  fp32, K-block major ("MN-major"): sa[kb * ld_sa + m], ld_sa >= M_total and a multiple of 4. The 128 scales
//       of one tile's rows for one k-block are then contiguous, and one TMA box (from the 16-byte boundary at or
//       before the tile's first row, see MGroupedFp8Layout::kSaBoxRows) brings them into the stage
//       next to the A and B tiles they scale, completing on the same mbarrier (a row-major [M_total, K / 128] tensor
//       would need one 4-byte box row per tile row).
//       With kAScaleBlocks = 2 A has one scale per row per 64 of K (sa[kb64 * ld_sa + m], the FP8 forward's L2 operand
//       s): two boxes per stage, and each k-block's four k32 wgmma are promoted in two pairs, each with its own scale.
//   sb  fp32 [E, ceil(N / 128), K / 128] at sb[g * sb_group_stride + nb * sb_n_stride + kb], read by the consumers
//       from global memory (one value per tile and k-block, loaded before the stage's wait so the wait hides it).
//   D   [M_total, N] bf16 (row stride ldd). Rows outside every group are not written.
//   offs: device int32 [E+1], the contract of the BF16 kernel (m_grouped_gemm.cuh): non-decreasing within
//   [0, M_total], no padding, empty groups allowed; checked by every CTA in its prologue, and offsets that break it
//   make the whole kernel write nothing (a device-check finding, common/device_check.hpp).
//
// Structure (the BF16 kernel's, with 128 x 128 x 128 tiles of e4m3: every stage tile is 128 rows of 128 bytes, the
// bytes of a bf16 128 x 64 tile, so the 128-byte swizzle, the descriptors and their k-step of 32 bytes are the
// same): persistent and warp-specialized, at most one CTA per SM, 384 threads. Warpgroup 0's elected thread issues
// the TMA loads of A, B and sa into a kNumStages-deep mbarrier ring; warpgroups 1 and 2 are consumers, each owning
// 64 of the tile's 128 rows: per k-block they issue four m64n128k32 e4m3 wgmma into a partial accumulator, wait for
// them, and promote the partial into the fp32 accumulator with its two scales (consumer_tile_mainloop_promoted,
// mainloop.cuh). The epilogue is the BF16 kernel's asynchronous one (store_acc_half_async, epilogue.cuh). Tiles,
// their order (group-major, band_tile within a group) and the per-group tile starts are the BF16 kernel's
// (m_grouped_tile_starts / m_grouped_locate, kernel_common.cuh).
//
// kBlockN is 128 because B's scales are per 128 columns: one tile is scaled by one sb value per k-block.
//
// Forward progress: a CTA never waits on another CTA. Its tiles are a fixed stride of the static tile list (CTA b
// takes b, b + gridDim.x, ...), each computed start to end by that CTA alone, so any grid size (the num_sms cap)
// gives the same tiles with the same bits, whichever CTAs are resident at a time. The only waits are on this CTA's
// own mbarriers (the ring, released by its own producer and consumers) and named barriers of one warpgroup; as in
// the BF16 kernels they are bounded in debug builds (PK_DEBUG_SPIN_BOUND, ptx.cuh). There is no wait on another CTA,
// so common/watchdog.cuh's bounded cross-CTA wait has nothing to bound here.
#pragma once

#include <cuda.h>

#include "common/device_check.hpp"
#include "epilogue.cuh"
#include "kernel_common.cuh"
#include "mainloop.cuh"
#include "pipeline.cuh"

namespace prime_kernels {
namespace sm90 {

struct MGroupedFp8Params {
  // L2 cache hints (kGemmL2Hints): bit 0: D's TMA stores evict_first; bit 3: B (weight) loads evict_last.
  int32_t l2_hints;
  // Where the kernel notes invalid offsets (may be null: they are still handled, not noted).
  common::DeviceCheckRecord* check;
  __nv_bfloat16* d;
  int64_t ldd;
  const float* sb;
  int64_t sb_group_stride;
  int64_t sb_n_stride;
  const int32_t* group_offsets;
  int32_t m_total;
  int32_t n;
  int32_t k;
  int32_t num_groups;
};

// kAScaleBlocks: A's scale blocks per 128-wide k-block (1; 2 for an A quantized 1 x 64, the L2 operand s of the FP8
// forward), one scale box each in the stage.
template <int kBlockN, int kNumStages, int kAScaleBlocks_ = 1>
struct MGroupedFp8Layout : StageRingLayout<128, kBlockN, 128, kNumStages, 1> {
  using Ring = StageRingLayout<128, kBlockN, 128, kNumStages, 1>;
  static constexpr int kAScaleBlocks = kAScaleBlocks_;
  static constexpr int kCOff = Ring::kRingEnd;  // 1024-aligned, as the swizzled staging tile needs
  static constexpr int kCBytes = TmaStaging<kBlockN>::kBytes;
  // A tile's rows start anywhere (at its group's first row), but a TMA box's first element along the innermost
  // dimension must sit on a 16-byte boundary (an unaligned start is an illegal instruction): the box starts at the
  // tile's first row rounded down to a multiple of 4 scales and holds 4 more, and the consumers skip row0 % 4 of them.
  static constexpr int kSaBoxRows = Ring::kBlockM + 4;
  static constexpr int kSaBoxBytes = kSaBoxRows * 4;
  static constexpr int kSaBoxSlot = (kSaBoxBytes + 127) / 128 * 128;  // one box's place, 128-byte aligned
  static constexpr int kSaBytes = kAScaleBlocks * kSaBoxSlot;          // one stage's slot
  static constexpr int kSaOff = kCOff + kCBytes;
  static constexpr int kBarOff = kSaOff + kNumStages * kSaBytes;
  static constexpr int kOffsOff = kBarOff + (2 * kNumStages + 2) * 8;
  static constexpr int kTileOff = kOffsOff + (kMaxGroups + 1) * 4;
  static constexpr int kEnd = kTileOff + (kMaxGroups + 1) * 4;
  static constexpr int kSmemBytes = kEnd + 1024;
  static constexpr int kStageTxBytes = Ring::kABytes + Ring::kBBytes + kAScaleBlocks * kSaBoxBytes;
  static_assert(kSmemBytes <= Ring::kSmemLimit, "shared memory budget exceeded");
  static_assert(kBlockN == 128, "B's scales are per 128 columns: one sb value per tile and k-block");
  static_assert(kSaOff % 128 == 0 && kSaBytes % 128 == 0, "TMA destinations are 128-byte aligned");
};

// The elected producer thread of the m-grouped FP8 kernels (this one, swiglu_bwd_fp8.cuh, swiglu_fwd_fp8.cuh): per
// tile of this CTA (units u = blockIdx.x, + unit_step, ...) and k-block, the A tile, B_g's tile and the tile rows' A
// scales into the next ring stage. L: the stage layout (kAOff / kABytes, kBOff / kBBytes, kSaOff / kSaBytes,
// kStageTxBytes, kBlockK, kBlockN). kGateUp: B's tile is two boxes of kBlockN / 2 rows, rows n0 (gate) and
// up_row0 + n0 (up) of B_g, so that one accumulator holds gate | up of the same columns (tmap_b's box is then
// kBlockN / 2 rows).
template <typename L, int kNumStages, bool kGateUp = false, typename LocateFn>
__device__ __forceinline__ void m_grouped_fp8_produce(uint8_t* smem, uint64_t* full_bar, uint64_t* empty_bar,
                                                      const CUtensorMap* tmap_a, const CUtensorMap* tmap_b,
                                                      const CUtensorMap* tmap_sa, int num_units, int unit_step,
                                                      int num_k_blocks, int32_t l2_hints, int up_row0,
                                                      LocateFn&& locate) {
  const uint64_t pol_b = l2_policy_reused_loads(l2_hints);
  int stage = 0;
  uint32_t phase = 0;
  int g = 0;
  for (int u = (int)ptx::ctaid_x_volatile(); u < num_units; u += unit_step) {
    const MGroupedWork w = locate(u, g);
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
      ptx::mbar_arrive_expect_tx(&full_bar[stage], L::kStageTxBytes);
      ptx::tma_load_2d(smem + L::kAOff + stage * L::kABytes, tmap_a, &full_bar[stage], kb * L::kBlockK, w.row0);
      uint8_t* b_stage = smem + L::kBOff + stage * L::kBBytes;
      ptx::tma_load_3d_hint(b_stage, tmap_b, &full_bar[stage], kb * L::kBlockK, w.n0, w.b_group, pol_b);
      if constexpr (kGateUp)
        ptx::tma_load_3d_hint(b_stage + (L::kBlockN / 2) * 128, tmap_b, &full_bar[stage], kb * L::kBlockK,
                              up_row0 + w.n0, w.b_group, pol_b);
      // from the 16-byte boundary at or before row0; rows past M_total arrive as zeros (never stored); one box per
      // scale block of the k-block
#pragma unroll
      for (int i = 0; i < L::kAScaleBlocks; ++i)
        ptx::tma_load_2d(smem + L::kSaOff + stage * L::kSaBytes + i * (L::kSaBytes / L::kAScaleBlocks), tmap_sa,
                         &full_bar[stage], w.row0 & ~3, kb * L::kAScaleBlocks + i);
      advance_stage<kNumStages>(stage, phase);
    }
  }
}

// The block scales of consumer_tile_mainloop_promoted for a row-scaled A and a tile-scaled B: B's one scale per tile
// and k-block from global memory (sb_tile[kb]), this thread's two row scales (rows frag_row, frag_row + 8 of the box)
// from the stage's A-scale box (kSaStageFloats floats per stage).
template <int kSaStageFloats, int kAccRegs>
struct RowTimesTileScales {
  const float* sb_tile;
  const float* s_sa;
  int frag_row;
  __device__ __forceinline__ float prefetch(int kb) const { return __ldg(sb_tile + kb); }
  __device__ __forceinline__ float3 load(float sb, int s_, int) const {
    const float* sa = s_sa + s_ * kSaStageFloats + frag_row;
    return make_float3(sa[0], sa[8], sb);
  }
  __device__ __forceinline__ void apply_loaded(float3 f, const float (&part_)[kAccRegs],
                                               float (&acc_)[kAccRegs]) const {
    promote_rows(acc_, part_, f.x * f.z, f.y * f.z);
  }
  __device__ __forceinline__ void apply(float sb, int s_, int sub, const float (&part_)[kAccRegs],
                                        float (&acc_)[kAccRegs]) const {
    apply_loaded(load(sb, s_, sub), part_, acc_);
  }
};

// As RowTimesTileScales for an A with two scale blocks per k-block (MGroupedFp8Layout's kAScaleBlocks = 2): the
// promotion of k-steps group `sub` reads the stage's box `sub` (kSaBoxFloats floats apart).
template <int kSaStageFloats, int kSaBoxFloats, int kAccRegs>
struct RowTimesTileScalesSplitK {
  const float* sb_tile;
  const float* s_sa;
  int frag_row;
  __device__ __forceinline__ float prefetch(int kb) const { return __ldg(sb_tile + kb); }
  __device__ __forceinline__ float3 load(float sb, int s_, int sub) const {
    const float* sa = s_sa + s_ * kSaStageFloats + sub * kSaBoxFloats + frag_row;
    return make_float3(sa[0], sa[8], sb);
  }
  __device__ __forceinline__ void apply_loaded(float3 f, const float (&part_)[kAccRegs],
                                               float (&acc_)[kAccRegs]) const {
    promote_rows(acc_, part_, f.x * f.z, f.y * f.z);
  }
  __device__ __forceinline__ void apply(float sb, int s_, int sub, const float (&part_)[kAccRegs],
                                        float (&acc_)[kAccRegs]) const {
    apply_loaded(load(sb, s_, sub), part_, acc_);
  }
};

// As RowTimesTileScales for a gate | up tile (kGateUp): the fragment's left half (gate rows c of W13) and right half
// (up rows I + c) lie in different 128 x 128 scale blocks of W13, sb_gate[kb] and sb_up[kb].
template <int kSaStageFloats, int kAccRegs>
struct RowTimesGateUpScales {
  const float* sb_gate;
  const float* sb_up;
  const float* s_sa;
  int frag_row;
  __device__ __forceinline__ float2 prefetch(int kb) const {
    return make_float2(__ldg(sb_gate + kb), __ldg(sb_up + kb));
  }
  // (row scale, row + 8's scale, gate's block scale, up's block scale)
  __device__ __forceinline__ float4 load(float2 sb, int s_, int) const {
    const float* sa = s_sa + s_ * kSaStageFloats + frag_row;
    return make_float4(sa[0], sa[8], sb.x, sb.y);
  }
  __device__ __forceinline__ void apply(float2 sb, int s_, int sub, const float (&part_)[kAccRegs],
                                        float (&acc_)[kAccRegs]) const {
    apply_loaded(load(sb, s_, sub), part_, acc_);
  }
  __device__ __forceinline__ void apply_loaded(float4 f, const float (&part_)[kAccRegs],
                                               float (&acc_)[kAccRegs]) const {
    const float g_lo = f.x * f.z, g_hi = f.y * f.z, u_lo = f.x * f.w, u_hi = f.y * f.w;
#pragma unroll
    for (int j = 0; j < kAccRegs / 4; ++j) {  // groups j < kAccRegs / 8: gate columns
      const float lo = j < kAccRegs / 8 ? g_lo : u_lo, hi = j < kAccRegs / 8 ? g_hi : u_hi;
      acc_[4 * j + 0] = fmaf(part_[4 * j + 0], lo, acc_[4 * j + 0]);
      acc_[4 * j + 1] = fmaf(part_[4 * j + 1], lo, acc_[4 * j + 1]);
      acc_[4 * j + 2] = fmaf(part_[4 * j + 2], hi, acc_[4 * j + 2]);
      acc_[4 * j + 3] = fmaf(part_[4 * j + 3], hi, acc_[4 * j + 3]);
    }
  }
};

// The whole of an m-grouped FP8 kernel (this GEMM, swiglu_bwd_fp8.cuh) but its epilogue, for every thread of the CTA:
// the offsets check (align > 1: every offset a multiple of align or m_total too; bad offsets leave the tile list
// empty, noted under check_kind), the ring's barriers, the tile list, the producer, and each consumer warpgroup's
// promoted mainloop over its 64 rows of every tile of this CTA. L: the stage layout (MGroupedFp8Layout's ring, A-scale
// boxes, kBarOff, kOffsOff, kTileOff); P: the parameters (l2_hints, check, sb and its strides, group_offsets,
// m_total, n, k, num_groups). After each tile's mainloop every consumer thread calls
// epilogue(acc, work, active, wg, wg_tid, frag_row) (active: the warpgroup's rows start before the group's end;
// frag_row: this thread's first accumulator row in the tile), and after its last tile finish(wg_tid). kGateUp (the
// L1 with the SwiGLU epilogue): p.n is I, an n-block covers kBlockN / 2 columns c of it, and B's tile holds W13's
// gate rows c and up rows I + c (m_grouped_fp8_produce), so work.n0 is a column of I. kTwoPartials: the promoted
// mainloop's (consumer_tile_mainloop_promoted, mainloop.cuh).
// kReloadUnits: the consumers read the tile count from shared memory again after setmaxnreg (a volatile load), so
// that no copy of it is live across the reconfiguration; a kernel whose epilogue leaves ptxas no register for that
// copy spills it otherwise.
template <typename L, int kNumStages, bool kGateUp = false, bool kTwoPartials = true, bool kReloadUnits = false,
          typename P, typename Epilogue, typename Finish>
__device__ __forceinline__ void m_grouped_fp8_kernel_body(uint8_t* smem_raw, const CUtensorMap* tmap_a,
                                                          const CUtensorMap* tmap_b, const CUtensorMap* tmap_sa,
                                                          const CUtensorMap* tmap_out, const P& p, int check_kind,
                                                          int align, Epilogue&& epilogue, Finish&& finish) {
  constexpr int kBlockM = L::kBlockM;
  constexpr int kBlockN = L::kBlockN;
  constexpr int kBlockK = L::kBlockK;
  using Mma = ptx::WgmmaFp8E4m3<kBlockN>;
  static_assert(kBlockN == 128, "B's scales are per 128 columns: one sb value per tile and k-block");

  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + L::kBarOff);
  uint64_t* empty_bar = full_bar + kNumStages;
  int32_t* s_offs = reinterpret_cast<int32_t*>(smem + L::kOffsOff);
  int32_t* s_tile = reinterpret_cast<int32_t*>(smem + L::kTileOff);
  const float* s_sa = reinterpret_cast<const float*>(smem + L::kSaOff);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int num_groups = p.num_groups;
  constexpr int kTileCols = kGateUp ? kBlockN / 2 : kBlockN;  // columns of p.n per n-block
  const int n_blocks = ceil_div(p.n, kTileCols);
  const int num_k_blocks = ceil_div(p.k, kBlockK);

  const bool bad_offsets = common::group_offsets_invalid(p.group_offsets, num_groups, p.m_total, p.check, check_kind,
                                                         align);
  kernel_prologue<kNumStages>(full_bar, empty_bar, 1, kNumConsumerThreads / 32, tmap_a, tmap_b, tmap_sa, tmap_out);
  load_group_offsets(p.group_offsets, num_groups, s_offs);
  if (warp == 0) m_grouped_tile_starts<kBlockM>(s_offs, s_tile, num_groups, n_blocks, bad_offsets, lane);
  __syncthreads();

  const int num_units = s_tile[num_groups];
  const int unit_step = (int)gridDim.x;
  auto locate = [&](int u, int& g) -> MGroupedWork {
    return m_grouped_locate<kBlockM>(s_offs, s_tile, n_blocks, kTileCols, u, g);
  };

  if (warp < 4) {
    // ================= producer warpgroup (one elected thread; the others have nothing to do)
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (warp == 0 && lane == 0)
      m_grouped_fp8_produce<L, kNumStages, kGateUp>(smem, full_bar, empty_bar, tmap_a, tmap_b, tmap_sa, num_units,
                                                    unit_step, num_k_blocks, p.l2_hints, p.n, locate);
  } else {
    // ================= consumer warpgroups
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const int wg = (warp >> 2) - 1;  // 0 or 1: rows [64*wg, 64*wg + 64) of the tile
    const int wg_tid = tid - 128 * (wg + 1);
    // this thread's accumulator rows within the tile: r and r + 8 (wgmma's m64 fragment)
    const int frag_row = 64 * wg + 16 * ((wg_tid >> 5) & 3) + (lane >> 2);
    const StageDescHalves desc = k_major_stage_descs(smem + L::kAOff, smem + L::kBOff, wg);

    float acc[kBlockN / 2];
    float part0[kBlockN / 2], part1[kBlockN / 2];
    int stage = 0;
    uint32_t phase = 0;
    int g = 0;
    int consumer_units = num_units;
    if constexpr (kReloadUnits) consumer_units = *reinterpret_cast<const volatile int32_t*>(s_tile + num_groups);
    for (int u = (int)ptx::ctaid_x_volatile(); u < consumer_units; u += unit_step) {
      const MGroupedWork w = locate(u, g);
      // A warpgroup whose 64 rows all lie past the group's end (a tail m-block) only keeps the pipeline moving.
      const bool active = w.row0 + 64 * wg < w.row_end;
      const float* sb_group = p.sb + w.b_group * p.sb_group_stride;
      auto release = [&](int s_) {
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(&empty_bar[s_]);
      };
      auto mainloop = [&](const auto& scales) {
        consumer_tile_mainloop_promoted<Mma, kNumStages, kBlockK, L::kABytes, L::kBBytes, L::kAScaleBlocks,
                                        kTwoPartials>(
            acc, part0, part1, active, num_k_blocks, full_bar, stage, phase, desc.a_lo0, desc.a_hi, desc.b_lo0,
            desc.b_hi, scales, release);
      };
      if constexpr (kGateUp)
        mainloop(RowTimesGateUpScales<L::kSaBytes / 4, kBlockN / 2>{
            sb_group + (w.n0 / 128) * p.sb_n_stride, sb_group + ((p.n + w.n0) / 128) * p.sb_n_stride, s_sa,
            frag_row + (w.row0 & 3)});
      else if constexpr (L::kAScaleBlocks > 1)
        mainloop(RowTimesTileScalesSplitK<L::kSaBytes / 4, L::kSaBytes / 4 / L::kAScaleBlocks, kBlockN / 2>{
            sb_group + (w.n0 / kBlockN) * p.sb_n_stride, s_sa, frag_row + (w.row0 & 3)});
      else
        mainloop(RowTimesTileScales<L::kSaBytes / 4, kBlockN / 2>{sb_group + (w.n0 / kBlockN) * p.sb_n_stride, s_sa,
                                                                   frag_row + (w.row0 & 3)});
      epilogue(acc, w, active, wg, wg_tid, frag_row);
    }
    finish(wg_tid);
  }
}

template <int kBlockN, int kNumStages, int kAScaleBlocks = 1>
__global__ void __launch_bounds__(kNumThreads, 1)
    m_grouped_fp8_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                              const __grid_constant__ CUtensorMap tmap_sa, const __grid_constant__ CUtensorMap tmap_d,
                              const MGroupedFp8Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = MGroupedFp8Layout<kBlockN, kNumStages, kAScaleBlocks>;
  extern __shared__ uint8_t smem_raw[];
  // two partials for the plain GEMM (the L1 dgrad, measured faster); one for the 1 x 64 scaled L2 (slower with two)
  m_grouped_fp8_kernel_body<L, kNumStages, false, (kAScaleBlocks == 1)>(
      smem_raw, &tmap_a, &tmap_b, &tmap_sa, &tmap_d, p, common::kCheckMGroupedOffsets, 1,
      [&](const float (&acc)[kBlockN / 2], const MGroupedWork& w, bool active, int wg, int wg_tid, int) {
        // (derived here, not before the roles split: a value live across setmaxnreg is spilled)
        const uint32_t stg_half =
            ptx::smem_addr(align_smem_1024(smem_raw) + L::kCOff) + wg * TmaStaging<kBlockN>::kHalfBytes;
        if (active)
          store_acc_half_async<kBlockN>(acc, stg_half, wg, wg_tid, &tmap_d, w.row0 + 64 * wg, w.row_end, w.n0, p.n,
                                        p.l2_hints, p.d, p.ldd);
      },
      [](int wg_tid) {
        if (wg_tid == 0) ptx::bulk_wait_group<0>();  // stores complete before the CTA's shared memory goes away
      });
#endif
}

}  // namespace sm90
}  // namespace prime_kernels
