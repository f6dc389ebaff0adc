// prime-kernels: sm90a FP8 L2 dgrad with the SwiGLU backward and a quantizing epilogue (the kernel of
// m_grouped_fp8_gemm_swiglu_bwd; precision "fp8_bwd", reference steps B2-B6 and B9 of the FP8 recipe, docs/fp8.md).
//
//   da  = G(qK(dy_p, 128), W2^T)   e4m3 x e4m3 wgmma, promoted into fp32 every 128 of K (= H), as
//                                  m_grouped_gemm_fp8.cuh (same producer, ring and promotion; B = W2^T [E, I, H])
//   dg, du, a = w * s, and the d topk_weights partials: the SwiGLU backward on fp32 da and the saved bf16 h
//                                  (swiglu_bwd_f32; the partials as the BF16 kernel, swiglu_bwd_pp.cuh, writes them)
//   outputs, rounded to bf16 and quantized as python/prime_kernels/mega/fp8.py does (common/fp8_quant_math.cuh):
//     qK(dh, 128) of dg and of du: e4m3 [M, 2I] and its row scales K-block major (dh_sa[j * ld + m], j < 2I / 128;
//                           with I = 64 mod 128 per 64 columns, j < 2I / 64): the A operand of m_grouped_fp8_gemm_nt
//                           for the L1 dgrad;
//     qT(dh_e), qT(a_e):    e4m3 [2I, M] and [I, M], token axis contiguous, one scale per column and 128-row block at
//                           s[b * ld + c]: the operands of k_grouped_fp8_gemm_tn for dW13 and dW2.
//
// Every quantization block is inside one 128 x 128 tile (128 rows of one expert's m-block, 128 columns of I: one 1x128
// block of dg and one of du per row, one 128x1 block of dg, du and a per column), so the CTA needs nobody else's
// values. dg and du are each blocked from their own first column. I a multiple of 64: with I = 64 (mod 128)
// m_grouped_fp8_swiglu_bwd_tail_kernel runs, whose last tile holds 64 columns of I (SwigluBwdFp8Epilogue::run). H a
// multiple of 64 (the mainloop's last k-block may hold 64 columns: the maps carry the true H). Every group offset a
// multiple of 128 (or m_total): then a tile's rows are one qT block of the pool's 128-row grid. Padding rows (route -1) and rows past the group's end are zeros in every
// output (they raise no amax), whatever dy and h hold there; their d weight partial is 0.
//
// Structure: the FP8 m-grouped GEMM's (384 threads; warpgroup 0's elected thread loads A, B and A's scales into the
// ring; warpgroups 1 and 2 each own 64 of the tile's rows and promote per k-block). The epilogue runs in both consumer
// warpgroups together, in one pass over da (in registers) and h (loaded ahead, from global memory):
//   1. the values dg, du and a rounded to bf16 (B6, B9: the operands of the BF16 backward), kept as bf16x2 words in
//      the registers da and h free; the d weight partials (fp32 da * s); the amaxes of the bf16 values: a row's over
//      its 128 columns within the quad (two shuffles), a column pair's over the warp's 16 rows by shuffles, then over
//      the 8 consumer warps through shared memory;
//   2. the column scales (one thread per column pair and output), to shared memory and the scale outputs, and the
//      row scales; one barrier also decides whether every scale of the tile has its reciprocal (the quantization then
//      divides through it, the division's bits; else it divides);
//   3. the words quantized with their row scale (qK, staged row-major) and column scale (qT, staged column-major, so
//      that the stores of the token-contiguous outputs are 16-byte runs of tokens);
//   4. the staged tile copied out with 16-byte stores (byte stores for a tail block's tokens).
// The explicit roundings of swiglu_bwd_f32 give the values the reference's fp32 steps, up to the sigmoid.
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
  static constexpr int kQtOff = kQkOff + 128 * kQkRowBytes;  // qT(dg | du | a): 384 columns x 128 tokens
  static constexpr int kColMaxOff = kQtOff + 384 * 128;       // [8 warps][3 outputs][64 column pairs] bf16x2
  static constexpr int kColScaleOff = kColMaxOff + 8 * 3 * 64 * 4;  // [3][64] float4
  static constexpr int kBarOff = kColScaleOff + 3 * 64 * 16;
  static constexpr int kOffsOff = kBarOff + 2 * kNumStages * 8;
  static constexpr int kTileOff = kOffsOff + (kMaxGroups + 1) * 4;
  static constexpr int kEnd = kTileOff + (kMaxGroups + 1) * 4;
  static constexpr int kSmemBytes = kEnd + 1024;
  static_assert(kSmemBytes <= Ring::kSmemLimit, "shared memory budget exceeded");
  static_assert(kSaOff % 128 == 0 && kQkOff % 16 == 0 && kColScaleOff % 16 == 0, "TMA destinations 128-byte, staging 16-byte aligned");
};

// bf16x2 words of absolute values (sign bits clear), as the epilogue's amaxes hold them.
__device__ __forceinline__ uint32_t bf16x2_abs(uint32_t v) { return v & 0x7fff7fffu; }
__device__ __forceinline__ uint32_t bf16x2_max(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ float bf16x2_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16x2_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// Q3's quotient: without a divide where every scale of the tile has its reciprocal (fp8_scale_rcp != 0), else the
// division (a tile of values below ~1e-27 or above ~1e32; the choice is one per tile, uniform over the CTA).
template <bool kInRange>
__device__ __forceinline__ float scale_quotient(float v, float scale, float rcp) {
  if constexpr (kInRange)
    return common::div_by_scale_in_range(v, scale, rcp);
  else
    return common::fp32_div_rn(v, scale);
}
template <bool kInRange>
__device__ __forceinline__ uint32_t e4m3x2_of(float lo, float hi, float scale, float rcp) {
  return __nv_cvt_float2_to_fp8x2(
      make_float2(scale_quotient<kInRange>(lo, scale, rcp), scale_quotient<kInRange>(hi, scale, rcp)), __NV_SATFINITE,
      __NV_E4M3);
}

// The epilogue of one 128 x 128 tile for one consumer thread (both warpgroups call every step, in order).
//
// Register fragment (wgmma m64n128): this thread's rows are r = frag_row and r + 8 (hh = 0, 1), its columns
// 8 j + 2 q + t (q = lane & 3, j < 16, t < 2), accumulator register 4 j + 2 hh + t. The values dg, du and a of a
// column pair at one row are one bf16x2 word each (column 8 j + 2 q in the low half): 96 words, which take the place
// of the 64 accumulators and the 64 words of h as they are consumed.
//
// Staging, both XOR-swizzled by 16-byte chunk so that a warp's 2-byte stores hit distinct banks:
//   qk [128 rows][256 bytes] (gate | up): row r's chunk c sits at chunk c ^ (r & 7);
//   qt [384 columns][128 tokens] (dg, du, a): column cc's tokens 16 s .. 16 s + 15 (s: the consumer warp whose rows
//      they are) sit at chunk s ^ ((cc >> 1) & 7), in the order r, r + 8 for r = 0 .. 7 (the thread's row pair is one
//      2-byte store); the copy-out puts them back in token order.
struct SwigluBwdFp8Epilogue {
  int ctid, lane, warp8;  // consumer thread and warp (0..255, 0..7)
  uint8_t* qk;            // staging (generic pointers into shared memory)
  uint8_t* qt;
  uint32_t* col_max;  // [8 warps][3 outputs][64 column pairs] bf16x2
  float4* col_scale;  // [3 outputs][64 column pairs]: scale, rcp of the pair's two columns

  template <bool kInRange, int kJ>
  __device__ __forceinline__ void stage(const uint32_t (&v)[3][kJ][2], const float (&rs)[2][2],
                                        const float (&rr)[2][2], int frag_row) const {
    const int q = lane & 3;
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {  // qK: the row's scale (o = 0 gate, 1 up)
        const int r = frag_row + 8 * hh;
        uint8_t* dst = qk + r * 256 + (((j >> 1) ^ (r & 7)) << 4) + 8 * (j & 1) + 2 * q;
#pragma unroll
        for (int o = 0; o < 2; ++o)
          *reinterpret_cast<uint16_t*>(dst + 128 * o) = static_cast<uint16_t>(
              e4m3x2_of<kInRange>(bf16x2_lo(v[o][j][hh]), bf16x2_hi(v[o][j][hh]), rs[hh][o], rr[hh][o]));
      }
      const int pair = 4 * j + q;
#pragma unroll
      for (int o = 0; o < 3; ++o) {  // qT: the column's scale, rows r and r + 8 in one store
        const float4 sc = col_scale[o * 64 + pair];
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const int cc = o * 128 + 2 * pair + t;
          const float a0 = t ? bf16x2_hi(v[o][j][0]) : bf16x2_lo(v[o][j][0]);
          const float a1 = t ? bf16x2_hi(v[o][j][1]) : bf16x2_lo(v[o][j][1]);
          const uint32_t b = e4m3x2_of<kInRange>(a0, a1, t ? sc.z : sc.x, t ? sc.w : sc.y);
          *reinterpret_cast<uint16_t*>(qt + cc * 128 + ((warp8 ^ ((cc >> 1) & 7)) << 4) + 2 * (lane >> 2)) =
              static_cast<uint16_t>(b);
        }
      }
    }
  }

  // kITail (I = 64 mod 128): dh_sa holds a scale per 64 columns (a tail block's one slot, a whole block's two).
  // kHalf (the tail kernel's last tile): its columns 64.. lie past I. There the accumulators are zeros (B's rows past
  // I load as zeros), so dg and du are zeros and raise no row amax: the tile's row blocks are the 64 columns that
  // exist. Nothing past I is stored (nor its column scales). A template parameter, not a runtime test, because the
  // shifted h loads below would otherwise hold a register more across the whole epilogue (spills at 168).
  template <int kClamp, bool kITail, bool kHalf, int kAcc>
  __device__ __forceinline__ void run(const SwigluBwdFp8Params& p, const float (&acc)[kAcc], int row0, int row_end,
                                      int n0, int frag_row) const {
    constexpr int kJ = kAcc / 4;
    static_assert(kJ == 16, "a 64 x 128 fragment of m64n128");
    static_assert(kITail || !kHalf, "a half tile is the tail kernel's");
    const int q = lane & 3;
    constexpr bool half_tile = kHalf;  // columns 64.. (fragment groups j >= kJ / 2) past I
    bool routed[2];
    float wgt[2];
    // The thread's h, kAhead column groups of it in flight ahead of the values (all of it beside the accumulators
    // spills; so does half of it with the clamp's masks): groups j < kAhead first, then group j + kAhead while group
    // j is computed.
    constexpr int kAhead = kClamp == kClampOff ? kJ / 2 : kJ / 4;
    uint32_t hv[2][kJ][2];  // [gate, up][j][hh]
    const __nv_bfloat16* hrow[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = row0 + frag_row + 8 * hh;
      wgt[hh] = pool_row_weight(p.pool_src_route, p.route_weights, p.num_routes, p.check, row, row_end, routed[hh]);
      // a row that is not routed reads row 0 (always there) and its values are discarded
      hrow[hh] = p.h + static_cast<int64_t>(routed[hh] ? row : 0) * p.ldh + n0 + 2 * q;
    }
    // A half tile's groups j >= kJ / 2 (columns past I) read the row's h 64 columns before instead: in bounds and
    // finite, and with da = 0 there dg and du are zeros whatever h is; a = w * s there is never stored.
    auto load_h = [&](int j) {
      const int col = half_tile && j >= kJ / 2 ? 8 * (j - kJ / 2) : 8 * j;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        hv[0][j][hh] = __ldg(reinterpret_cast<const unsigned int*>(hrow[hh] + col));
        hv[1][j][hh] = __ldg(reinterpret_cast<const unsigned int*>(hrow[hh] + p.n + col));
      }
    };
#pragma unroll
    for (int j = 0; j < kAhead; ++j) load_h(j);
    // ---- 1. the values (bf16, as the BF16 backward hands dh and w * s on), the d weight partials, the amaxes
    uint32_t v[3][kJ][2];  // [dg, du, a][j][hh]
    float partial[2] = {0.f, 0.f};
    uint32_t rmax[2][2] = {{0u, 0u}, {0u, 0u}};  // [hh][dg, du]
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      if (j + kAhead < kJ) load_h(j + kAhead);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float o[3][2];
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const float g = t ? bf16x2_hi(hv[0][j][hh]) : bf16x2_lo(hv[0][j][hh]);
          const float u = t ? bf16x2_hi(hv[1][j][hh]) : bf16x2_lo(hv[1][j][hh]);
          const float da = acc[4 * j + 2 * hh + t];
          const SwigluBwdF32 r = swiglu_bwd_f32<kClamp>(g, u, da, wgt[hh], p.clamp);
          partial[hh] = fmaf(da, r.s, partial[hh]);
          o[0][t] = r.dg;
          o[1][t] = r.du;
          o[2][t] = r.a;
        }
        const uint32_t keep = routed[hh] ? 0xffffffffu : 0u;  // zeros in every output, whatever dy and h hold
#pragma unroll
        for (int k = 0; k < 3; ++k) v[k][j][hh] = ptx::pack_bf16x2(o[k][0], o[k][1]) & keep;
        rmax[hh][0] = bf16x2_max(rmax[hh][0], bf16x2_abs(v[0][j][hh]));
        rmax[hh][1] = bf16x2_max(rmax[hh][1], bf16x2_abs(v[1][j][hh]));
      }
#pragma unroll
      for (int k = 0; k < 3; ++k) {  // the column pair's amaxes over the warp's 16 rows (lane bits 2..4)
        uint32_t m = bf16x2_max(bf16x2_abs(v[k][j][0]), bf16x2_abs(v[k][j][1]));
        m = bf16x2_max(m, __shfl_xor_sync(0xffffffffu, m, 4));
        m = bf16x2_max(m, __shfl_xor_sync(0xffffffffu, m, 8));
        m = bf16x2_max(m, __shfl_xor_sync(0xffffffffu, m, 16));
        if (lane < 4) col_max[(warp8 * 3 + k) * 64 + 4 * j + lane] = m;
      }
    }
    float amax[2][2];  // [hh][dg, du]: a row's 128 columns, the quad's four threads
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const uint32_t x = rmax[hh][0], y = rmax[hh][1];
      uint32_t m = bf16x2_max(__byte_perm(x, y, 0x5410), __byte_perm(x, y, 0x7632));  // (dg, du)
      m = bf16x2_max(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = bf16x2_max(m, __shfl_xor_sync(0xffffffffu, m, 2));
      amax[hh][0] = bf16x2_lo(m);
      amax[hh][1] = bf16x2_hi(m);
    }
    const int nb = n0 / 128;
    write_dt_partials(p.dt_part, p.dt_ld, partial, routed, row0, frag_row, row_end, nb, lane);
    ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);

    // ---- 2. the scales: a column pair's for each output by one thread, the rows' by their quads
    bool in_range = true;
    const int64_t tb = row0 / 128;  // the tile's qT block
    if (ctid < 3 * 64) {
      const int o = ctid >> 6, pair = ctid & 63;
      uint32_t m = 0u;
#pragma unroll
      for (int w8 = 0; w8 < 8; ++w8) m = bf16x2_max(m, col_max[(w8 * 3 + o) * 64 + pair]);
      const float s0 = common::fp8_block_scale(bf16x2_lo(m), p.pow2_scales);
      const float s1 = common::fp8_block_scale(bf16x2_hi(m), p.pow2_scales);
      const float r0 = common::fp8_scale_rcp(s0), r1 = common::fp8_scale_rcp(s1);
      in_range = r0 != 0.f && r1 != 0.f;
      col_scale[o * 64 + pair] = make_float4(s0, r0, s1, r1);
      float* dst = o < 2 ? p.dht_s + tb * p.ld_dht_s + o * p.n : p.awt_s + tb * p.ld_awt_s;
      if (!kITail || n0 + 2 * pair < p.n) {
        dst[n0 + 2 * pair] = s0;
        dst[n0 + 2 * pair + 1] = s1;
      }
    }
    float rs[2][2], rr[2][2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
      for (int o = 0; o < 2; ++o) {
        rs[hh][o] = common::fp8_block_scale(amax[hh][o], p.pow2_scales);
        rr[hh][o] = common::fp8_scale_rcp(rs[hh][o]);
        in_range = in_range && rr[hh][o] != 0.f;
      }
      const int row = row0 + frag_row + 8 * hh;
      if constexpr (kITail) {
        if (row < row_end && q == 0) {
#pragma unroll
          for (int o = 0; o < 2; ++o) {
            const int64_t slot = (o * p.n + n0) / 64;
            p.dh_sa[slot * p.ld_dh_sa + row] = rs[hh][o];
            if (!half_tile) p.dh_sa[(slot + 1) * p.ld_dh_sa + row] = rs[hh][o];
          }
        }
      } else if (row < row_end && q == 0) {
        p.dh_sa[static_cast<int64_t>(nb) * p.ld_dh_sa + row] = rs[hh][0];
        p.dh_sa[static_cast<int64_t>(p.n / 128 + nb) * p.ld_dh_sa + row] = rs[hh][1];
      }
    }
    const bool all_in_range = ptx::named_bar_sync_and(kBarConsumers, kNumConsumerThreads, in_range);

    // ---- 3. quantize into the staging tiles
    if (all_in_range)
      stage<true>(v, rs, rr, frag_row);
    else
      stage<false>(v, rs, rr, frag_row);
    ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);

    // ---- 4. copy out: the tile's rows before row_end (a tile that ends early is the pool's last: tokens past it
    // do not exist, so the token-contiguous outputs get byte stores there)
    const int rows = min(128, row_end - row0);
    for (int idx = ctid; idx < rows * 16; idx += kNumConsumerThreads) {
      const int r = idx >> 4, ch = idx & 15;
      if (kITail && half_tile && (ch & 7) >= 4) continue;  // columns past I
      const int64_t col = (ch < 8 ? n0 : p.n + n0) + 16 * (ch & 7);
      *reinterpret_cast<uint4*>(p.dh_q + static_cast<int64_t>(row0 + r) * p.ld_dh_q + col) =
          *reinterpret_cast<const uint4*>(qk + r * 256 + ((ch ^ (r & 7)) << 4));
    }
    auto qt_dst = [&](int cc) -> uint8_t* {
      return cc < 256 ? p.dht_q + static_cast<int64_t>((cc < 128 ? 0 : p.n - 128) + n0 + cc) * p.ld_dht_q
                      : p.awt_q + static_cast<int64_t>(n0 + cc - 256) * p.ld_awt_q;
    };
    if (rows == 128) {
      for (int idx = ctid; idx < 384 * 8; idx += kNumConsumerThreads) {
        const int cc = idx >> 3, ch = idx & 7;
        if (kITail && half_tile && (cc & 127) >= 64) continue;  // columns past I
        const uint4 s = *reinterpret_cast<const uint4*>(qt + cc * 128 + ((ch ^ ((cc >> 1) & 7)) << 4));
        // staged order r, r + 8 (r < 8) -> token order: the even bytes, then the odd ones
        const uint4 out = make_uint4(__byte_perm(s.x, s.y, 0x6420), __byte_perm(s.z, s.w, 0x6420),
                                     __byte_perm(s.x, s.y, 0x7531), __byte_perm(s.z, s.w, 0x7531));
        *reinterpret_cast<uint4*>(qt_dst(cc) + row0 + 16 * ch) = out;
      }
    } else {
      for (int idx = ctid; idx < 384 * rows; idx += kNumConsumerThreads) {
        const int cc = idx / rows, r = idx - cc * rows;
        if (kITail && half_tile && (cc & 127) >= 64) continue;
        const int k = r & 15, pos = k < 8 ? 2 * k : 2 * k - 15;
        qt_dst(cc)[row0 + r] = qt[cc * 128 + (((r >> 4) ^ ((cc >> 1) & 7)) << 4) + pos];
      }
    }
  }
};

// The kernels' whole body (kITail: SwigluBwdFp8Epilogue::run's).
template <int kNumStages, bool kITail>
__device__ __forceinline__ void swiglu_bwd_fp8_kernel_body(uint8_t* smem_raw, const CUtensorMap* tmap_a,
                                                           const CUtensorMap* tmap_b, const CUtensorMap* tmap_sa,
                                                           const SwigluBwdFp8Params& p) {
  using L = SwigluBwdFp8Layout<kNumStages>;
  // 128-row starts: each tile's rows are one qT block of the pool's grid. One partial: the ring has 3 stages (the
  // epilogue's staging takes the rest of shared memory), and holding two of them measured slower (docs/performance.md)
  m_grouped_fp8_kernel_body<L, kNumStages, false, false, kITail>(
      smem_raw, tmap_a, tmap_b, tmap_sa, static_cast<const CUtensorMap*>(nullptr), p,
      common::kCheckSwigluBwdFp8Offsets, L::kBlockM,
      [&](const float (&acc)[L::kBlockN / 2], const MGroupedWork& w, bool, int, int, int frag_row) {
        // (derived here, not before the roles split: a value live across setmaxnreg is spilled)
        uint8_t* smem = align_smem_1024(smem_raw);
        const int tid = threadIdx.x;
        const SwigluBwdFp8Epilogue epi{tid - 128,
                                       tid & 31,
                                       (tid >> 5) - 4,
                                       smem + L::kQkOff,
                                       smem + L::kQtOff,
                                       reinterpret_cast<uint32_t*>(smem + L::kColMaxOff),
                                       reinterpret_cast<float4*>(smem + L::kColScaleOff)};
        if constexpr (kITail) {
          const bool half = w.n0 + 128 > p.n;
          if (p.clamp > 0.f) {
            if (half)
              epi.run<kClampOn, true, true>(p, acc, w.row0, w.row_end, w.n0, frag_row);
            else
              epi.run<kClampOn, true, false>(p, acc, w.row0, w.row_end, w.n0, frag_row);
          } else if (half) {
            epi.run<kClampOff, true, true>(p, acc, w.row0, w.row_end, w.n0, frag_row);
          } else {
            epi.run<kClampOff, true, false>(p, acc, w.row0, w.row_end, w.n0, frag_row);
          }
        } else if (p.clamp > 0.f) {
          epi.run<kClampOn, false, false>(p, acc, w.row0, w.row_end, w.n0, frag_row);
        } else {
          epi.run<kClampOff, false, false>(p, acc, w.row0, w.row_end, w.n0, frag_row);
        }
      },
      [](int) {});  // every store is a generic one, complete before the threads exit
}

// I a multiple of 128.
template <int kNumStages>
__global__ void __launch_bounds__(kNumThreads, 1)
    m_grouped_fp8_swiglu_bwd_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                                    const __grid_constant__ CUtensorMap tmap_sa, const SwigluBwdFp8Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  extern __shared__ uint8_t smem_raw[];
  swiglu_bwd_fp8_kernel_body<kNumStages, false>(smem_raw, &tmap_a, &tmap_b, &tmap_sa, p);
#endif
}

// I = 64 (mod 128): its own instantiation, so that the kernel for multiples of 128 keeps its code.
template <int kNumStages>
__global__ void __launch_bounds__(kNumThreads, 1)
    m_grouped_fp8_swiglu_bwd_tail_kernel(const __grid_constant__ CUtensorMap tmap_a,
                                         const __grid_constant__ CUtensorMap tmap_b,
                                         const __grid_constant__ CUtensorMap tmap_sa, const SwigluBwdFp8Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  extern __shared__ uint8_t smem_raw[];
  swiglu_bwd_fp8_kernel_body<kNumStages, true>(smem_raw, &tmap_a, &tmap_b, &tmap_sa, p);
#endif
}

}  // namespace sm90
}  // namespace prime_kernels
