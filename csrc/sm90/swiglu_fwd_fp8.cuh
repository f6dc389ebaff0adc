// prime-kernels: sm90a FP8 L1 GEMM with the SwiGLU forward and the quantization of s in its epilogue (the kernel of
// m_grouped_fp8_gemm_swiglu; precision "fp8", reference steps F1, F3 and F6 of the FP8 recipe, docs/fp8.md).
//
//   h  = G(qK(x_p, 128), W13)   e4m3 x e4m3 wgmma, promoted into fp32 every 128 of K (= H), as m_grouped_gemm_fp8.cuh
//                               (same producer, ring and promotion), with B's tile W13's gate rows c and up rows I + c
//                               of 64 columns c of I (two TMA boxes of 64 rows), so one accumulator holds gate | up
//   s  = silu(g) * u            on the fp32 accumulators (F3: not on the bf16 h), swiglu_value (swiglu_math.cuh),
//                               with a clamp c > 0 first g <= c and -c <= u <= c (F2)
//   outputs:
//     qK(s, 64) along I:  e4m3 [M, I] and its row scales K-block major (s_sa[j * ld + m], j < I / 64): the A operand
//                         of the L2 GEMM, promoted every 64 of K (the recipe's l2_act_block = 64);
//     h~ (optional):      the fp32 h rounded to bf16 (F6: with a clamp, no value crosses a bound, so the backward's
//                         clamp masks on h~ are the forward's), [M, 2I] gate | up, for the backward.
//
// A tile is 128 rows x 64 columns of I: each row's 64 values of s are one 1x64 block, held by the four threads of a
// quad (16 each), so a row's amax is two shuffles and the CTA needs nobody else's values. H and I multiples of 64: a
// tile's 64 gate rows c and 64 up rows I + c each lie in one of W13's 128 x 128 scale blocks (blocked along 2I from
// row 0; with I = 64 mod 128 one block holds gate and up rows), and H's last k-block may hold 64 columns (the maps
// carry the true H, the rest loads as zeros). The clamp is a template flag (kClamp: its min / max and the masked
// rounding cost instructions per element, so the kernel without one keeps none of them); the fused FP8 forward
// (mega_moe_fwd_fp8.cuh) runs without.
// Padding rows hold zeros in A (the dispatch quantizes them so): their s and h are zeros and are written as such.
// Rows past the group's end are not written.
//
// group_offsets: the FP8 GEMM's contract (non-decreasing within [0, m_total]); every CTA checks it in its prologue,
// before any store, and the whole kernel writes nothing when they break it (a device-check finding).
//
// Forward progress: a CTA never waits on another CTA. Its tiles are a fixed stride of the static tile list, each
// computed start to end by that CTA alone, so any grid size gives the same bits. Its waits are on its own ring's
// mbarriers; the epilogue has no barrier (each thread's values, and its quad's shuffles, which all four reach).
#pragma once

#include <cuda.h>

#include <type_traits>

#include "common/device_check.hpp"
#include "common/fp8_quant_math.cuh"
#include "kernel_common.cuh"
#include "m_grouped_gemm_fp8.cuh"
#include "swiglu_math.cuh"

namespace prime_kernels {
namespace sm90 {

struct SwigluFwdFp8Params {
  int32_t l2_hints;  // kGemmL2Hints: bit 3, B (weight) loads evict_last
  common::DeviceCheckRecord* check;
  const float* sb;  // W13's 128 x 128 block scales [E, 2I / 128, H / 128], as MGroupedFp8Params
  int64_t sb_group_stride;
  int64_t sb_n_stride;
  const int32_t* group_offsets;
  int32_t m_total;
  int32_t n;  // I
  int32_t k;  // H
  int32_t num_groups;
  bool pow2_scales;
  __nv_bfloat16* h;  // [m_total, 2I] gate | up, row stride ldh; null: not saved
  int64_t ldh;
  uint8_t* s_q;  // e4m3 [m_total, I], row stride ld_s_q bytes
  int64_t ld_s_q;
  float* s_sa;  // [I / 64] x ld_s_sa, K-block major
  int64_t ld_s_sa;
};

// The clamp instantiation's parameters (its own type, so the kernels without a clamp keep theirs): the clamp c and the
// bf16 values next to it (host_utils.hpp, bf16_clamp_neighbours) that the saved h's masked rounding needs.
struct SwigluFwdFp8ClampParams : SwigluFwdFp8Params {
  float clamp;
  float clamp_below;
  float clamp_above;
};

constexpr int kSwigluFwdFp8Block = 64;  // the 1 x 64 blocks of s: one tile's columns

// s = silu(g) * u of one accumulator row of a 64 x 128 (gate | up) fragment of m64n128 (hh = 0: the thread's row
// frag_row, 1: frag_row + 8): the columns 8 j + 2 (lane & 3) + t (j < 8) of gate (registers 4 j + 2 hh + t) and of up
// (the same plus 32) into s[2 j + t]; returns the amax of the row's 64 values (its quad's four threads: every thread
// of the quad must call it). kClamp: g and u clamped by c first.
template <bool kClamp = false>
__device__ __forceinline__ float swiglu_fp8_row(const float (&acc)[64], int hh, float (&s)[16], float c = 0.f) {
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const float v = swiglu_value(acc[4 * j + 2 * hh + t], acc[4 * (j + 8) + 2 * hh + t], kClamp ? c : 0.f);
      s[2 * j + t] = v;
      amax = fmaxf(amax, fabsf(v));
    }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // the row's 64 columns: the quad
  return fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
}

// One consumer thread's part of a 128 x 64 tile: rows frag_row and frag_row + 8 of its warpgroup's fragment
// (swiglu_fp8_row), stored to global memory.
template <int kAcc, bool kClamp = false, typename Params = SwigluFwdFp8Params>
__device__ __forceinline__ void swiglu_fwd_fp8_epilogue(const Params& p, const float (&acc)[kAcc], int row0,
                                                        int row_end, int n0, int frag_row, int lane) {
  static_assert(kAcc == 64, "a 64 x 128 (gate | up) fragment of m64n128");
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = row0 + frag_row + 8 * hh;
    float s[16];
    float amax;
    if constexpr (kClamp)
      amax = swiglu_fp8_row<true>(acc, hh, s, p.clamp);
    else
      amax = swiglu_fp8_row(acc, hh, s);
    if (row >= row_end) continue;
    const float scale = common::fp8_block_scale(amax, p.pow2_scales);
    const float rcp = common::fp8_scale_rcp(scale);  // Q3 without a divide, the division's bits (common/fp8_div.hpp)
    if ((lane & 3) == 0) p.s_sa[static_cast<int64_t>(n0 / kSwigluFwdFp8Block) * p.ld_s_sa + row] = scale;
    uint8_t* s_row = p.s_q + static_cast<int64_t>(row) * p.ld_s_q + n0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = 8 * j + 2 * (lane & 3);
      *reinterpret_cast<uint16_t*>(s_row + c) =
          static_cast<uint16_t>(common::e4m3x2_bits(s[2 * j], s[2 * j + 1], scale, rcp));
    }
    if (p.h != nullptr) {
      __nv_bfloat16* h_row = p.h + static_cast<int64_t>(row) * p.ldh + n0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int c = 8 * j + 2 * (lane & 3);
        if constexpr (kClamp) {
          const PackBf16x2ClampMasks gate{p.clamp, p.clamp_below, p.clamp_above, false};
          const PackBf16x2ClampMasks up{p.clamp, p.clamp_below, p.clamp_above, true};
          *reinterpret_cast<uint32_t*>(h_row + c) = gate(acc[4 * j + 2 * hh], acc[4 * j + 2 * hh + 1]);
          *reinterpret_cast<uint32_t*>(h_row + p.n + c) = up(acc[4 * (j + 8) + 2 * hh], acc[4 * (j + 8) + 2 * hh + 1]);
        } else {
          *reinterpret_cast<uint32_t*>(h_row + c) =
              ptx::pack_bf16x2(acc[4 * j + 2 * hh], acc[4 * j + 2 * hh + 1]);
          *reinterpret_cast<uint32_t*>(h_row + p.n + c) =
              ptx::pack_bf16x2(acc[4 * (j + 8) + 2 * hh], acc[4 * (j + 8) + 2 * hh + 1]);
        }
      }
    }
  }
}

template <int kNumStages, bool kClamp>
__global__ void __launch_bounds__(kNumThreads, 1)
    m_grouped_fp8_swiglu_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                                const __grid_constant__ CUtensorMap tmap_sa,
                                const std::conditional_t<kClamp, SwigluFwdFp8ClampParams, SwigluFwdFp8Params> p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = MGroupedFp8Layout<128, kNumStages>;
  extern __shared__ uint8_t smem_raw[];
  // one partial: two measured slower here (docs/performance.md)
  m_grouped_fp8_kernel_body<L, kNumStages, true, false>(
      smem_raw, &tmap_a, &tmap_b, &tmap_sa, static_cast<const CUtensorMap*>(nullptr), p,
      common::kCheckMGroupedOffsets, 1,
      [&](const float (&acc)[L::kBlockN / 2], const MGroupedWork& w, bool active, int, int, int frag_row) {
        if (active)
          swiglu_fwd_fp8_epilogue<L::kBlockN / 2, kClamp>(p, acc, w.row0, w.row_end, w.n0, frag_row,
                                                          threadIdx.x & 31);
      },
      [](int) {});  // every store is a generic one, complete before the threads exit
#endif
}

}  // namespace sm90
}  // namespace prime_kernels
