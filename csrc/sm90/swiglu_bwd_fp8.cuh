// prime-kernels: sm90a FP8 L2 dgrad with the SwiGLU backward and a quantizing epilogue (the kernel of
// m_grouped_fp8_gemm_swiglu_bwd; precision "fp8_bwd", reference steps B2-B6 and B9 of the FP8 recipe, docs/fp8.md).
//
//   da  = G(qK(dy_p, 128), W2^T)   e4m3 x e4m3 wgmma, promoted into fp32 every 128 of K (= H), as
//                                  m_grouped_gemm_fp8.cuh (same producer, ring and promotion; B = W2^T [E, I, H])
//   dg, du, a = w * s, and the d topk_weights partials: the SwiGLU backward on fp32 da and the saved bf16 h
//                                  (swiglu_bwd_f32; the partials as the BF16 kernel, swiglu_bwd_pp.cuh, writes them)
//   outputs, quantized as python/prime_kernels/mega/fp8.py does (common/fp8_quant_math.cuh):
//     qK(dh, 128) along 2I: e4m3 [M, 2I] and its row scales K-block major (dh_sa[j * ld + m], j < 2I / 128): the A
//                           operand of m_grouped_fp8_gemm_nt for the L1 dgrad;
//     qT(dh_e), qT(a_e):    e4m3 [2I, M] and [I, M], token axis contiguous, one scale per column and 128-row block at
//                           s[b * ld + c]: the operands of k_grouped_fp8_gemm_tn for dW13 and dW2.
//
// Every quantization block is inside one 128 x 128 tile (128 rows of one expert's m-block, 128 columns of I: one 1x128
// block of dg and one of du per row, one 128x1 block of dg, du and a per column), so the CTA needs nobody else's
// values. I must be a multiple of 128 and every group offset a multiple of 128 (or m_total): then a tile's rows are
// one qT block of the pool's 128-row grid. Padding rows (route -1) and rows past the group's end are zeros in every
// output (they raise no amax), whatever dy and h hold there; their d weight partial is 0.
//
// Structure: the FP8 m-grouped GEMM's (384 threads; warpgroup 0's elected thread loads A, B and A's scales into the
// ring; warpgroups 1 and 2 each own 64 of the tile's rows and promote per k-block). The epilogue runs in both consumer
// warpgroups together, with the values computed twice from da (kept in registers) and h (read from global memory):
//   1. amaxes: a row's over its 128 columns within the quad (two shuffles); a column's over the warp's 16 rows by
//      shuffles, then over the 8 consumer warps through shared memory; the d weight partials;
//   2. the column scales (one thread per column and output), written to shared memory and to the scale outputs;
//   3. the values again, quantized with their row scale (qK, staged row-major) and column scale (qT, staged
//      column-major, so that the stores of the token-contiguous outputs are 16-byte runs of tokens);
//   4. the staged tile copied out with 16-byte stores (byte stores for a tail block's tokens).
// Recomputing (not keeping dg, du and a: 192 more registers per thread) costs the SwiGLU arithmetic twice; the
// explicit roundings of swiglu_bwd_f32 give both passes the same bits.
//
// group_offsets: non-decreasing within [0, m_total], each a multiple of 128 or m_total; every CTA checks that in its
// prologue, before any store, and the whole kernel writes nothing when they break it (a device-check finding).
//
// Forward progress: a CTA never waits on another CTA. Its tiles are a fixed stride of the static tile list, each
// computed start to end by that CTA alone (no exchange between CTAs), so any grid size gives the same bits. Its waits
// are on its own ring's mbarriers and on named barriers of its own consumer threads, which every consumer thread
// reaches once per tile (an inactive warpgroup of a tail tile too).
#pragma once

#include <cuda.h>

#include "common/device_check.hpp"
#include "common/fp8_quant_math.cuh"
#include "kernel_common.cuh"
#include "m_grouped_gemm_fp8.cuh"
#include "mainloop.cuh"
#include "pipeline.cuh"
#include "swiglu_bwd_pp.cuh"
#include "swiglu_math.cuh"

namespace prime_kernels {
namespace sm90 {

struct SwigluBwdFp8Params {
  int32_t l2_hints;  // kGemmL2Hints: bit 3, B (weight) loads evict_last
  common::DeviceCheckRecord* check;
  const float* sb;  // W2^T's 128 x 128 block scales, as MGroupedFp8Params
  int64_t sb_group_stride;
  int64_t sb_n_stride;
  const int32_t* group_offsets;
  int32_t m_total;
  int32_t n;  // I
  int32_t k;  // H
  int32_t num_groups;
  const __nv_bfloat16* h;  // [m_total, 2I]: gate | up, as saved
  int64_t ldh;
  const int32_t* pool_src_route;
  const float* route_weights;
  int32_t num_routes;
  float clamp;
  bool pow2_scales;
  uint8_t* dh_q;  // e4m3 [m_total, 2I], row stride ld_dh_q bytes
  int64_t ld_dh_q;
  float* dh_sa;  // [2I / 128] x ld_dh_sa, K-block major
  int64_t ld_dh_sa;
  uint8_t* dht_q;  // e4m3 [2I, m_total], row stride ld_dht_q bytes
  int64_t ld_dht_q;
  float* dht_s;  // [ceil(m_total / 128)] x ld_dht_s
  int64_t ld_dht_s;
  uint8_t* awt_q;  // e4m3 [I, m_total]
  int64_t ld_awt_q;
  float* awt_s;  // [ceil(m_total / 128)] x ld_awt_s
  int64_t ld_awt_s;
  float* dt_part;  // fp32 [m_total, dt_ld]
  int32_t dt_ld;
};

template <int kNumStages>
struct SwigluBwdFp8Layout : StageRingLayout<128, 128, 128, kNumStages, 1> {
  using Ring = StageRingLayout<128, 128, 128, kNumStages, 1>;
  using Gemm = MGroupedFp8Layout<128, kNumStages>;  // the A-scale boxes of the FP8 GEMM's stages
  static constexpr int kAScaleBlocks = 1;
  static constexpr int kSaBoxRows = Gemm::kSaBoxRows;
  static constexpr int kSaBytes = Gemm::kSaBytes;
  static constexpr int kStageTxBytes = Gemm::kStageTxBytes;
  static constexpr int kSaOff = Ring::kRingEnd;
  static constexpr int kQkOff = kSaOff + kNumStages * kSaBytes;  // qK(dh): 128 rows x (128 gate | 128 up) bytes
  static constexpr int kQkRowBytes = 256;
  static constexpr int kQtDhOff = kQkOff + 128 * kQkRowBytes;  // qT(dh): 256 columns x 128 tokens
  static constexpr int kQtAOff = kQtDhOff + 256 * 128;         // qT(a): 128 columns x 128 tokens
  static constexpr int kColMaxOff = kQtAOff + 128 * 128;       // [8 warps][3 outputs][128 columns] fp32
  static constexpr int kColScaleOff = kColMaxOff + 8 * 3 * 128 * 4;  // [3][128] fp32
  static constexpr int kBarOff = kColScaleOff + 3 * 128 * 4;
  static constexpr int kOffsOff = kBarOff + 2 * kNumStages * 8;
  static constexpr int kTileOff = kOffsOff + (kMaxGroups + 1) * 4;
  static constexpr int kEnd = kTileOff + (kMaxGroups + 1) * 4;
  static constexpr int kSmemBytes = kEnd + 1024;
  static_assert(kSmemBytes <= Ring::kSmemLimit, "shared memory budget exceeded");
  static_assert(kSaOff % 128 == 0 && kQkOff % 16 == 0, "TMA destinations 128-byte, staging 16-byte aligned");
};

// The epilogue of one 128 x 128 tile for one consumer thread (both warpgroups call every step, in order).
struct SwigluBwdFp8Epilogue {
  int ctid, lane, warp8;  // consumer thread and warp (0..255, 0..7)
  uint8_t* qk;            // staging (generic pointers into shared memory)
  uint8_t* qt_dh;
  uint8_t* qt_a;
  float* col_max;
  float* col_scale;

  // frag_row: this thread's rows within the tile are frag_row and frag_row + 8 (wgmma's m64 fragment).
  // The values of column pair j (columns 8 j + 2 (lane & 3) + t of the tile) at this thread's row hh: the saved
  // h of both columns and the accumulators (rows that are not routed give zeros).
  template <int kClamp, int kAcc>
  __device__ __forceinline__ void values(const SwigluBwdFp8Params& p, const float (&acc)[kAcc], int j, int hh,
                                         const __nv_bfloat16* hrow, bool routed, float w, SwigluBwdF32 (&v)[2]) const {
    uint32_t g2 = 0, u2 = 0;
    if (routed) {
      const int c = 8 * j + 2 * (lane & 3);
      g2 = __ldg(reinterpret_cast<const unsigned int*>(hrow + c));
      u2 = __ldg(reinterpret_cast<const unsigned int*>(hrow + p.n + c));
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const float g = ptx::bf16_bits_to_float(static_cast<uint16_t>(t ? g2 >> 16 : g2 & 0xffffu));
      const float u = ptx::bf16_bits_to_float(static_cast<uint16_t>(t ? u2 >> 16 : u2 & 0xffffu));
      v[t] = swiglu_bwd_f32<kClamp>(g, u, acc[4 * j + 2 * hh + t], w, p.clamp);
      if (!routed) v[t] = SwigluBwdF32{0.f, 0.f, 0.f, 0.f};
    }
  }

  template <int kClamp, int kAcc>
  __device__ __forceinline__ void run(const SwigluBwdFp8Params& p, const float (&acc)[kAcc], int row0, int row_end,
                                      int n0, int frag_row) const {
    bool routed[2];
    float wgt[2];
    const __nv_bfloat16* hrow[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = row0 + frag_row + 8 * hh;
      wgt[hh] = pool_row_weight(p.pool_src_route, p.route_weights, p.num_routes, p.check, row, row_end, routed[hh]);
      hrow[hh] = p.h + static_cast<int64_t>(routed[hh] ? row : 0) * p.ldh + n0;
    }
    // ---- 1. amaxes and the d weight partials
    float rmax_g[2] = {0.f, 0.f}, rmax_u[2] = {0.f, 0.f}, partial[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kAcc / 4; ++j) {
      float cmax[3][2] = {{0.f, 0.f}, {0.f, 0.f}, {0.f, 0.f}};  // [dg, du, a][t] over this thread's two rows
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        SwigluBwdF32 v[2];
        values<kClamp>(p, acc, j, hh, hrow[hh], routed[hh], wgt[hh], v);
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          partial[hh] = fmaf(acc[4 * j + 2 * hh + t], v[t].s, partial[hh]);
          rmax_g[hh] = fmaxf(rmax_g[hh], fabsf(v[t].dg));
          rmax_u[hh] = fmaxf(rmax_u[hh], fabsf(v[t].du));
          cmax[0][t] = fmaxf(cmax[0][t], fabsf(v[t].dg));
          cmax[1][t] = fmaxf(cmax[1][t], fabsf(v[t].du));
          cmax[2][t] = fmaxf(cmax[2][t], fabsf(v[t].a));
        }
      }
#pragma unroll
      for (int o = 0; o < 3; ++o)
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          float m = cmax[o][t];  // over the 8 lanes of this column (lane bits 2..4): the warp's 16 rows
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
          if (lane < 4) col_max[(warp8 * 3 + o) * 128 + 8 * j + 2 * lane + t] = m;
        }
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {  // a row's 128 columns: the quad's four threads
      rmax_g[hh] = fmaxf(rmax_g[hh], __shfl_xor_sync(0xffffffffu, rmax_g[hh], 1));
      rmax_g[hh] = fmaxf(rmax_g[hh], __shfl_xor_sync(0xffffffffu, rmax_g[hh], 2));
      rmax_u[hh] = fmaxf(rmax_u[hh], __shfl_xor_sync(0xffffffffu, rmax_u[hh], 1));
      rmax_u[hh] = fmaxf(rmax_u[hh], __shfl_xor_sync(0xffffffffu, rmax_u[hh], 2));
    }
    const int nb = n0 / 128;
    write_dt_partials(p.dt_part, p.dt_ld, partial, routed, row0, frag_row, row_end, nb, lane);
    ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);

    // ---- 2. column scales: outputs o = 0 (dg), 1 (du), 2 (a), one thread per column and output
    const int64_t tb = row0 / 128;  // the tile's qT block
    for (int idx = ctid; idx < 3 * 128; idx += kNumConsumerThreads) {
      const int o = idx >> 7, c = idx & 127;
      float m = 0.f;
#pragma unroll
      for (int w8 = 0; w8 < 8; ++w8) m = fmaxf(m, col_max[(w8 * 3 + o) * 128 + c]);
      const float sc = common::fp8_block_scale(m, p.pow2_scales);
      col_scale[o * 128 + c] = sc;
      if (o < 2)
        p.dht_s[tb * p.ld_dht_s + o * p.n + n0 + c] = sc;
      else
        p.awt_s[tb * p.ld_awt_s + n0 + c] = sc;
    }
    float rs_g[2], rs_u[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      rs_g[hh] = common::fp8_block_scale(rmax_g[hh], p.pow2_scales);
      rs_u[hh] = common::fp8_block_scale(rmax_u[hh], p.pow2_scales);
      const int row = row0 + frag_row + 8 * hh;
      if (row < row_end && (lane & 3) == 0) {
        p.dh_sa[static_cast<int64_t>(nb) * p.ld_dh_sa + row] = rs_g[hh];
        p.dh_sa[static_cast<int64_t>(p.n / 128 + nb) * p.ld_dh_sa + row] = rs_u[hh];
      }
    }
    ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);

    // ---- 3. quantize into the staging tiles
#pragma unroll
    for (int j = 0; j < kAcc / 4; ++j) {
      SwigluBwdF32 v[2][2];  // [hh][t]
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) values<kClamp>(p, acc, j, hh, hrow[hh], routed[hh], wgt[hh], v[hh]);
      const int c = 8 * j + 2 * (lane & 3);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = frag_row + 8 * hh;
        const uint16_t qg = static_cast<uint16_t>(common::e4m3x2_bits(v[hh][0].dg, v[hh][1].dg, rs_g[hh]));
        const uint16_t qu = static_cast<uint16_t>(common::e4m3x2_bits(v[hh][0].du, v[hh][1].du, rs_u[hh]));
        *reinterpret_cast<uint16_t*>(qk + r * 256 + c) = qg;
        *reinterpret_cast<uint16_t*>(qk + r * 256 + 128 + c) = qu;
      }
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const int col = c + t;
        const uint32_t qg = common::e4m3x2_bits(v[0][t].dg, v[1][t].dg, col_scale[col]);
        const uint32_t qu = common::e4m3x2_bits(v[0][t].du, v[1][t].du, col_scale[128 + col]);
        const uint32_t qa = common::e4m3x2_bits(v[0][t].a, v[1][t].a, col_scale[256 + col]);
        qt_dh[col * 128 + frag_row] = static_cast<uint8_t>(qg);
        qt_dh[col * 128 + frag_row + 8] = static_cast<uint8_t>(qg >> 8);
        qt_dh[(128 + col) * 128 + frag_row] = static_cast<uint8_t>(qu);
        qt_dh[(128 + col) * 128 + frag_row + 8] = static_cast<uint8_t>(qu >> 8);
        qt_a[col * 128 + frag_row] = static_cast<uint8_t>(qa);
        qt_a[col * 128 + frag_row + 8] = static_cast<uint8_t>(qa >> 8);
      }
    }
    ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);

    // ---- 4. copy out: the tile's rows before row_end (a tile that ends early is the pool's last: tokens past it
    // do not exist, so the token-contiguous outputs get byte stores there)
    const int rows = min(128, row_end - row0);
    for (int idx = ctid; idx < rows * 16; idx += kNumConsumerThreads) {
      const int r = idx >> 4, ch = idx & 15;
      const int64_t col = (ch < 8 ? n0 : p.n + n0) + 16 * (ch & 7);
      *reinterpret_cast<uint4*>(p.dh_q + static_cast<int64_t>(row0 + r) * p.ld_dh_q + col) =
          *reinterpret_cast<const uint4*>(qk + r * 256 + 16 * ch);
    }
    if (rows == 128) {
      for (int idx = ctid; idx < 384 * 8; idx += kNumConsumerThreads) {
        const int cc = idx >> 3, ch = idx & 7;
        const uint4 val = *reinterpret_cast<const uint4*>((cc < 256 ? qt_dh + cc * 128 : qt_a + (cc - 256) * 128) +
                                                          16 * ch);
        uint8_t* dst = cc < 256 ? p.dht_q + static_cast<int64_t>((cc < 128 ? 0 : p.n - 128) + n0 + cc) * p.ld_dht_q
                                : p.awt_q + static_cast<int64_t>(n0 + cc - 256) * p.ld_awt_q;
        *reinterpret_cast<uint4*>(dst + row0 + 16 * ch) = val;
      }
    } else {
      for (int idx = ctid; idx < 384 * rows; idx += kNumConsumerThreads) {
        const int cc = idx / rows, r = idx - cc * rows;
        const uint8_t val = cc < 256 ? qt_dh[cc * 128 + r] : qt_a[(cc - 256) * 128 + r];
        uint8_t* dst = cc < 256 ? p.dht_q + static_cast<int64_t>((cc < 128 ? 0 : p.n - 128) + n0 + cc) * p.ld_dht_q
                                : p.awt_q + static_cast<int64_t>(n0 + cc - 256) * p.ld_awt_q;
        dst[row0 + r] = val;
      }
    }
  }
};

template <int kNumStages>
__global__ void __launch_bounds__(kNumThreads, 1)
    m_grouped_fp8_swiglu_bwd_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                                    const __grid_constant__ CUtensorMap tmap_sa, const SwigluBwdFp8Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = SwigluBwdFp8Layout<kNumStages>;
  extern __shared__ uint8_t smem_raw[];
  // 128-row starts: each tile's rows are one qT block of the pool's grid
  m_grouped_fp8_kernel_body<L, kNumStages>(
      smem_raw, &tmap_a, &tmap_b, &tmap_sa, static_cast<const CUtensorMap*>(nullptr), p,
      common::kCheckSwigluBwdFp8Offsets, L::kBlockM,
      [&](const float (&acc)[L::kBlockN / 2], const MGroupedWork& w, bool, int, int, int frag_row) {
        // (derived here, not before the roles split: a value live across setmaxnreg is spilled)
        uint8_t* smem = align_smem_1024(smem_raw);
        const int tid = threadIdx.x;
        const SwigluBwdFp8Epilogue epi{tid - 128,
                                       tid & 31,
                                       (tid >> 5) - 4,
                                       smem + L::kQkOff,
                                       smem + L::kQtDhOff,
                                       smem + L::kQtAOff,
                                       reinterpret_cast<float*>(smem + L::kColMaxOff),
                                       reinterpret_cast<float*>(smem + L::kColScaleOff)};
        if (p.clamp > 0.f)
          epi.run<kClampOn>(p, acc, w.row0, w.row_end, w.n0, frag_row);
        else
          epi.run<kClampOff>(p, acc, w.row0, w.row_end, w.n0, frag_row);
      },
      [](int) {});  // every store is a generic one, complete before the threads exit
#endif
}

}  // namespace sm90
}  // namespace prime_kernels
