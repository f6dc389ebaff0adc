// prime-kernels: sm90a L2 dgrad with the SwiGLU backward in its epilogue, ping-pong consumers (the kernel of
// m_grouped_bf16_gemm_swiglu_bwd; I a multiple of 64). Measured on the H200: 0.80 ms at 30B, T=16384 (2.84 ms at
// 235B) against 0.94 (3.35) for the nn GEMM plus the pool-row kernel, and ahead of a cooperative variant with the
// same epilogue in one warpgroup pair (removed; docs/performance.md keeps its figures).
//
// da = dy_pool @ w2_g for 128 columns of I, then the SwiGLU backward; each consumer warpgroup owns whole 128 x 128
// tiles and the two take the tensor cores in turn (named barriers), so one's epilogue runs while the other's
// mainloop does. B = w2 [E, H, I] read MN-major (two 64-column TMA boxes per stage, wgmma's transpose bit).
// Epilogue through shared memory: a first version (1.46 ms at 30B, T=16384,
// against 0.97 ms for the nn GEMM plus the pool-row kernel) lost its time to 4-byte h loads and dh / w*s
// stores in the accumulator's fragment layout. Now the tile's h comes in four 64 x 64 pieces (gate and up
// boxes) by TMA into a two-slot ring per warpgroup, the first two issued before the mainloop; each thread
// reads its fragment's g, u from the swizzled boxes, writes dg, du over them in place and w*s into a third
// box, and one thread TMA-stores the three boxes (generic 16-byte stores for an m-block's last partial rows).
// It runs at ~81% of L2 throughput (B and A re-read per 128 x 128 tile), but 2-CTA clusters that multicast B
// measured slower (30B 0.84 vs 0.82 ms, 235B 3.30 vs 2.86). A variant that gathered
// the dy rows itself while its tiles ran was slower than the separate gather plus this kernel (1.17 vs 1.08 ms at
// 30B, 4.10 vs 3.43 at 235B) and was removed.
//
// group_offsets: non-decreasing within [0, m_total]; every CTA checks that in its prologue, before any store, and
// the whole kernel writes nothing when they break it (noted in the device-check record, common/device_check.hpp).
//
// Forward progress: a CTA never waits on another CTA. Its tiles are a fixed stride of the static tile list, each
// computed start to end by that CTA, so any grid size (the num_sms cap) gives the same bits, whichever CTAs are
// resident at a time.
#pragma once

#include <cuda.h>

#include "common/device_check.hpp"
#include "epilogue.cuh"
#include "kernel_common.cuh"
#include "m_grouped_gemm.cuh"
#include "mainloop.cuh"
#include "pipeline.cuh"
#include "swiglu_math.cuh"

namespace prime_kernels {
namespace sm90 {

template <int kNumStages>
struct SwigluBwdPPLayout : StageRingLayout<128, 128, 64, kNumStages> {
  using Ring = StageRingLayout<128, 128, 64, kNumStages>;
  static constexpr int kStages = kNumStages;
  static constexpr int kMnBoxBytes = 64 * Ring::kBlockK * 2;  // one 64-column box of B per stage
  static constexpr int kBoxBytes = 64 * 64 * 2;       // one 64 x 64 bf16 piece, 128-byte swizzle
  static constexpr int kSlotBytes = 2 * kBoxBytes;     // gate and up boxes of one piece
  static constexpr int kHOff = Ring::kRingEnd;  // per warpgroup: 2 slots
  static constexpr int kAwOff = kHOff + 2 * 2 * kSlotBytes;   // per warpgroup: 1 w*s box
  static constexpr int kBarOff = kAwOff + 2 * kBoxBytes;
  static constexpr int kHBarOff = kBarOff + 2 * kNumStages * 8;  // per warpgroup: 2 slot barriers
  static constexpr int kOffsOff = kHBarOff + 4 * 8;
  static constexpr int kMbOff = kOffsOff + (kMaxGroups + 1) * 4;  // first m-block of each group
  static constexpr int kEnd = kMbOff + (kMaxGroups + 1) * 4;
  static constexpr int kSmemBytes = kEnd + 1024;
  static_assert(kSmemBytes <= Ring::kSmemLimit, "shared memory budget exceeded");
};

// What the kernels over SwigluBwdPPLayout (or a layout extending it: mega_moe_bwd.cuh) address in shared memory:
// the 1024-byte-aligned base, the stage ring's full and empty barriers, and the groups' first rows and first
// m-blocks (load_group_offsets_and_mblocks).
template <typename L>
struct PingPongSmem {
  uint8_t* base;
  uint64_t* full_bar;
  uint64_t* empty_bar;
  int32_t* s_offs;
  int32_t* s_mb;
  __device__ __forceinline__ explicit PingPongSmem(uint8_t* raw) {
    base = align_smem_1024(raw);
    full_bar = reinterpret_cast<uint64_t*>(base + L::kBarOff);
    empty_bar = full_bar + L::kStages;
    s_offs = reinterpret_cast<int32_t*>(base + L::kOffsOff);
    s_mb = reinterpret_cast<int32_t*>(base + L::kMbOff);
  }
};

// Stage 0's wgmma descriptors (A K-major, B MN-major in 64-column boxes; 128-byte swizzle) as the halves that
// pingpong_tile_mainloop takes, and B's k16 step.
template <typename L>
struct PingPongDescs {
  static constexpr uint32_t kBStepDesc = (16 * 128) >> 4;  // one k16 step of MN-major B
  uint32_t a_lo0, a_hi, b_lo0, b_hi;
  __device__ __forceinline__ explicit PingPongDescs(uint8_t* smem) {
    const uint64_t desc_a0 = ptx::make_desc_sw128(ptx::smem_addr(smem + L::kAOff), 0, 1024);
    const uint64_t desc_b0 = ptx::make_desc_sw128(ptx::smem_addr(smem + L::kBOff), L::kMnBoxBytes, 1024);
    a_lo0 = static_cast<uint32_t>(desc_a0);
    a_hi = static_cast<uint32_t>(desc_a0 >> 32);
    b_lo0 = static_cast<uint32_t>(desc_b0);
    b_hi = static_cast<uint32_t>(desc_b0 >> 32);
  }
};

// The ping-pong kernel's epilogue, one 64 x 64 piece at a time:
// the SwiGLU backward of this thread's fragment rows frag_row and frag_row + 8, accumulator column groups
// [8 q, 8 q + 8) (da, fp32), against g and u in the 128B-swizzled boxes at gb and ub; dg and du overwrite g and u,
// w * s goes to the box at aw, and partial[hh] += da * s in column order (the d topk_weights partials).
template <int kClamp, int kAcc>
__device__ __forceinline__ void swiglu_bwd_piece_impl(const float (&acc)[kAcc], int q, uint32_t gb, uint32_t ub,
                                                      uint32_t aw, int frag_row, int lane, const float (&wgt)[2],
                                                      float (&partial)[2], float clamp) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = frag_row + 8 * hh;
    const float wt = wgt[hh];
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const uint32_t off = r * 128 + ((jj ^ (r & 7)) << 4) + 4 * (lane & 3);
      const uint32_t g2 = ptx::ld_shared_u32(gb + off);
      const uint32_t u2 = ptx::ld_shared_u32(ub + off);
      const float* da = &acc[4 * (8 * q + jj) + 2 * hh];
      const SwigluBwdWords o = swiglu_bwd_pair<kClamp>(g2, u2, da[0], da[1], wt, clamp, partial[hh]);
      ptx::st_shared_u32(gb + off, o.dg);
      ptx::st_shared_u32(ub + off, o.du);
      ptx::st_shared_u32(aw + off, o.aw);
    }
  }
}
template <int kAcc>
__device__ __forceinline__ void swiglu_bwd_piece(const float (&acc)[kAcc], int q, uint32_t gb, uint32_t ub,
                                                 uint32_t aw, int frag_row, int lane, const float (&wgt)[2],
                                                 float (&partial)[2], float clamp) {
  if (clamp > 0.f)
    swiglu_bwd_piece_impl<kClampOn>(acc, q, gb, ub, aw, frag_row, lane, wgt, partial, clamp);
  else
    swiglu_bwd_piece_impl<kClampOff>(acc, q, gb, ub, aw, frag_row, lane, wgt, partial, clamp);
}

// The piece's stores (rows prow0.., columns col0.. of I): one thread TMA-stores the three boxes when all 64 rows
// belong to the expert; otherwise the warpgroup copies its first `rows` rows (a box would also write the next
// group's rows) and meets at bar_id, so that the slot is read before it is refilled.
__device__ __forceinline__ void swiglu_bwd_piece_store(const MGroupedParams& p, const CUtensorMap* tmap_dh,
                                                       const CUtensorMap* tmap_aw, uint32_t gb, uint32_t ub,
                                                       uint32_t aw, int col0, int prow0, int rows, int wg_tid,
                                                       uint32_t bar_id) {
  if (rows == 64) {
    if (wg_tid == 0) {
      const uint64_t pol = l2_policy_store(p.l2_hints, 0);
      ptx::tma_store_2d_hint(tmap_dh, gb, col0, prow0, pol);
      ptx::tma_store_2d_hint(tmap_dh, ub, p.n + col0, prow0, pol);
      ptx::tma_store_2d_hint(tmap_aw, aw, col0, prow0, pol);
      ptx::bulk_commit_group();
    }
  } else if (rows > 0) {
    for (int idx = wg_tid; idx < rows * 8; idx += 128) {
      const int r = idx >> 3, ch = idx & 7;
      const uint32_t off = r * 128 + ((ch ^ (r & 7)) << 4);
      const int64_t row = prow0 + r;
      const int c = col0 + ch * 8;
      *reinterpret_cast<uint4*>(p.dh + row * p.lddh + c) = ptx::ld_shared_v4(gb + off);
      *reinterpret_cast<uint4*>(p.dh + row * p.lddh + p.n + c) = ptx::ld_shared_v4(ub + off);
      *reinterpret_cast<uint4*>(p.aw + row * p.ldaw + c) = ptx::ld_shared_v4(aw + off);
    }
    ptx::named_bar_sync(bar_id, 128);
  }
}

// The d topk_weights partials of this thread's two fragment rows (prow0 + frag_row + 8 hh) for dt_part column
// dt_col: each quad's sum (lanes 1 and 2 apart, a fixed order), 0 for padding rows; rows >= row_end are skipped.
// dt_part: fp32 [rows, dt_ld] (the BF16 and FP8 L2 dgrads write the same partials).
__device__ __forceinline__ void write_dt_partials(float* dt_part, int dt_ld, const float (&partial)[2],
                                                  const bool (&routed)[2], int prow0, int frag_row, int row_end,
                                                  int dt_col, int lane) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float v = partial[hh];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    const int row = prow0 + frag_row + 8 * hh;
    if (row < row_end && (lane & 3) == 0) dt_part[static_cast<int64_t>(row) * dt_ld + dt_col] = routed[hh] ? v : 0.f;
  }
}
__device__ __forceinline__ void write_dt_partials(const MGroupedParams& p, const float (&partial)[2],
                                                  const bool (&routed)[2], int prow0, int frag_row, int row_end,
                                                  int dt_col, int lane) {
  write_dt_partials(p.dt_part, p.dt_ld, partial, routed, prow0, frag_row, row_end, dt_col, lane);
}

// The route weight of pool row `row` (0 and routed = false for a row >= row_end, a padding row (-1) or a route outside
// [0, num_routes), which is also a device-check finding).
__device__ __forceinline__ float pool_row_weight(const int32_t* pool_src_route, const float* route_weights,
                                                 int num_routes, common::DeviceCheckRecord* check, int row,
                                                 int row_end, bool& routed) {
  const int route = row < row_end ? __ldg(pool_src_route + row) : -1;
  routed = route >= 0 && route < num_routes;
  if (route < -1 || route >= num_routes) common::note_device_check(check, common::kCheckPoolRoute);
  return routed ? __ldg(route_weights + route) : 0.f;
}

constexpr uint32_t kBarSwigluTurnWg0 = 5;  // +wg

// One consumer warpgroup's SwiGLU backward of a 128 x 128 da tile (rows row0.. < row_end, columns n0.. of I), for
// the ping-pong kernel here and the fused backward (mega_moe_bwd.cuh): the tile's h comes in four 64 x 64 pieces
// (gate and up boxes) by TMA into the warpgroup's two slots of L (kHOff, kSlotBytes; barriers at kHBarOff), dh and
// w * s leave through the slots and the w * s box (kAwOff). prepare() before the tile's mainloop: the first two
// pieces in flight (the slots are free once this warpgroup's last stores have read them) and this thread's four
// rows' route weights; finish() after it, with the fp32 da of rows 0..63 (acc0) and 64..127 (acc1).
template <typename L>
struct SwigluBwdTileEpilogue {
  uint8_t* hslots;
  uint32_t hslots_addr;
  uint32_t aw_addr;
  uint64_t* h_full;
  uint32_t h_phase;  // bit q: parity of slot q's next fill
  int wg, wg_tid, lane, frag_row;
  float wgt[2][2];
  bool routed[2][2];
  bool q1;  // the tile's second 64 columns exist (I is a multiple of 64)

  __device__ __forceinline__ SwigluBwdTileEpilogue(uint8_t* smem, int wg_, int wg_tid_, int lane_)
      : wg(wg_), wg_tid(wg_tid_), lane(lane_) {
    hslots = smem + L::kHOff + wg * 2 * L::kSlotBytes;
    hslots_addr = ptx::smem_addr(hslots);
    aw_addr = ptx::smem_addr(smem + L::kAwOff) + wg * L::kBoxBytes;
    h_full = reinterpret_cast<uint64_t*>(smem + L::kHBarOff) + 2 * wg;
    h_phase = 0;
    frag_row = 16 * ((wg_tid >> 5) & 3) + (lane >> 2);  // + 8 * hh: this thread's rows of a 64-row half
    q1 = false;
  }
  // piece = 2 * half + q: rows row0 + 64 * half, columns n0 + 64 * q of I (gate) and I + n0 + 64 * q (up); one thread
  __device__ __forceinline__ void load_piece(const MGroupedParams& p, const CUtensorMap* tmap_h, int row0, int n0,
                                             int piece) {
    const int q = piece & 1;
    uint8_t* dst = hslots + q * L::kSlotBytes;
    ptx::mbar_arrive_expect_tx(&h_full[q], L::kSlotBytes);
    ptx::tma_load_2d(dst, tmap_h, &h_full[q], n0 + 64 * q, row0 + 64 * (piece >> 1));
    ptx::tma_load_2d(dst + L::kBoxBytes, tmap_h, &h_full[q], p.n + n0 + 64 * q, row0 + 64 * (piece >> 1));
  }
  __device__ __forceinline__ void prepare(const MGroupedParams& p, const CUtensorMap* tmap_h, int row0, int row_end,
                                          int n0) {
    q1 = n0 + 64 < p.n;
    if (wg_tid == 0) {
      ptx::bulk_wait_group_read<0>();
      load_piece(p, tmap_h, row0, n0, 0);
      if (q1) load_piece(p, tmap_h, row0, n0, 1);
    }
#pragma unroll
    for (int hm = 0; hm < 2; ++hm)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = row0 + 64 * hm + frag_row + 8 * hh;
        wgt[hm][hh] = pool_row_weight(p.pool_src_route, p.route_weights, p.num_routes, p.check, row, row_end,
                                      routed[hm][hh]);
      }
  }
  template <int kAcc>
  __device__ __forceinline__ void finish(const MGroupedParams& p, const CUtensorMap* tmap_h, const CUtensorMap* tmap_dh,
                                         const CUtensorMap* tmap_aw, const float (&acc0)[kAcc],
                                         const float (&acc1)[kAcc], int row0, int row_end, int n0, int dt_col) {
#pragma unroll
    for (int hm = 0; hm < 2; ++hm) {
      const float(&acc)[kAcc] = hm == 0 ? acc0 : acc1;
      const int prow0 = row0 + 64 * hm;
      const int rows = min(64, row_end - prow0);  // <= 0: no rows in this half (computed, not stored)
      float partial[2] = {0.f, 0.f};
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        if (q == 1 && !q1) break;  // warpgroup-uniform
        const int piece = 2 * hm + q;
        const uint32_t gb = hslots_addr + q * L::kSlotBytes;
        const uint32_t ub = gb + L::kBoxBytes;
        ptx::mbar_wait(&h_full[q], (h_phase >> q) & 1u);
        h_phase ^= 1u << q;
        if (wg_tid == 0) ptx::bulk_wait_group_read<0>();  // the w*s box: the previous piece's store has read it
        ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
        swiglu_bwd_piece(acc, q, gb, ub, aw_addr, frag_row, lane, wgt[hm], partial, p.clamp);
        ptx::fence_proxy_async_smem();
        ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
        swiglu_bwd_piece_store(p, tmap_dh, tmap_aw, gb, ub, aw_addr, n0 + 64 * q, prow0, rows, wg_tid,
                               kBarEpilogueWg0 + wg);
        if (piece < 2 && wg_tid == 0) {  // refill this slot with the second half's piece of the same columns
          ptx::bulk_wait_group_read<0>();
          load_piece(p, tmap_h, row0, n0, piece + 2);
        }
      }
      write_dt_partials(p, partial, routed[hm], prow0, frag_row, row_end, dt_col, lane);
    }
  }
};

template <int kNumStages>
__global__ void __launch_bounds__(kNumThreads, 1)
    m_grouped_swiglu_bwd_pp_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                                   const __grid_constant__ CUtensorMap tmap_h, const __grid_constant__ CUtensorMap tmap_dh,
                                   const __grid_constant__ CUtensorMap tmap_aw, const MGroupedParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = SwigluBwdPPLayout<kNumStages>;
  constexpr int kBlockM = L::kBlockM;
  constexpr int kBlockN = L::kBlockN;
  constexpr int kBlockK = L::kBlockK;
  using Mma = ptx::WgmmaBf16<kBlockN, 0, 1>;  // B MN-major
  constexpr int kAcc = kBlockN / 2;

  extern __shared__ uint8_t smem_raw[];
  const PingPongSmem<L> sm(smem_raw);
  uint8_t* smem = sm.base;
  uint64_t* full_bar = sm.full_bar;
  uint64_t* empty_bar = sm.empty_bar;
  int32_t* s_offs = sm.s_offs;
  int32_t* s_mb = sm.s_mb;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int num_groups = p.num_groups;
  const int n_blocks = ceil_div(p.n, kBlockN);
  const int num_k_blocks = ceil_div(p.k, kBlockK);

  // offsets check first: bad offsets write nothing
  if (common::group_offsets_invalid(p.group_offsets, num_groups, p.m_total, p.check, common::kCheckMGroupedOffsets))
    return;
  // the h-slot barriers; the stage barriers' init fence (same thread, next) publishes them too
  if (tid == 0)
    for (int s = 0; s < 4; ++s) ptx::mbar_init(reinterpret_cast<uint64_t*>(smem + L::kHBarOff) + s, 1);
  // empty: the 4 warps of the consuming warpgroup
  kernel_prologue<kNumStages>(full_bar, empty_bar, 1, 4, &tmap_a, &tmap_b, &tmap_h, &tmap_dh, &tmap_aw);
  load_group_offsets_and_mblocks<kBlockM>(p.group_offsets, num_groups, p.m_total, s_offs, s_mb);
  // read by each role after its setmaxnreg (a volatile shared load): one copy live across the register
  // reconfiguration gets spilled
  auto num_tiles_now = [&]() -> int {
    return static_cast<int>(ptx::ld_shared_u32(ptx::smem_addr(s_mb + num_groups))) * n_blocks;
  };

  struct Work {
    int g;
    int row0;
    int row_end;
    int n0;
  };
  auto locate = [&](int u, int& g) -> Work {  // group-major, then band_tile's order
    while (s_mb[g + 1] * n_blocks <= u) ++g;
    const int start = s_offs[g];
    const int end = max(s_offs[g + 1], start);
    int nb, mb;
    band_tile(u - s_mb[g] * n_blocks, s_mb[g + 1] - s_mb[g], n_blocks, nb, mb);
    return Work{g, start + mb * kBlockM, end, nb * kBlockN};
  };

  if (warp < 4) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (warp == 0 && lane == 0) {
      const uint64_t pol_b = l2_policy_reused_loads(p.l2_hints);
      int stage = 0;
      uint32_t phase = 0;
      int g = 0;
      const int num_tiles = num_tiles_now();
      for (int u = (int)ptx::ctaid_x_volatile(); u < num_tiles; u += (int)gridDim.x) {
        const Work w = locate(u, g);
        for (int kb = 0; kb < num_k_blocks; ++kb) {
          ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
          uint8_t* sa = smem + L::kAOff + stage * L::kABytes;
          uint8_t* sb = smem + L::kBOff + stage * L::kBBytes;
          ptx::mbar_arrive_expect_tx(&full_bar[stage], L::kABytes + L::kBBytes);
          ptx::tma_load_2d(sa, &tmap_a, &full_bar[stage], kb * kBlockK, w.row0);
#pragma unroll
          for (int j = 0; j < kBlockN / 64; ++j)
            ptx::tma_load_3d_hint(sb + j * L::kMnBoxBytes, &tmap_b, &full_bar[stage], w.n0 + 64 * j, kb * kBlockK, w.g,
                                  pol_b);
          advance_stage<kNumStages>(stage, phase);
        }
      }
    }
  } else {
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const int wg = (warp >> 2) - 1;
    const int wg_tid = tid - 128 * (wg + 1);
    const PingPongDescs<L> d(smem);
    SwigluBwdTileEpilogue<L> epi(smem, wg, wg_tid, lane);

    const int cta = (int)ptx::ctaid_x_volatile();
    const int step = (int)gridDim.x;
    const int num_tiles = num_tiles_now();
    const int ntiles = cta < num_tiles ? ceil_div(num_tiles - cta, step) : 0;
    if (wg == 1 && ntiles > 0) ptx::named_bar_arrive(kBarSwigluTurnWg0, 256);

    float acc0[kAcc], acc1[kAcc];
    int stage = 0;
    uint32_t phase = 0;
    int g = 0;
    int k = 0;
    for (int u = cta; u < num_tiles; u += step, ++k) {
      const Work w = locate(u, g);
      if ((k & 1) != wg) {
        skip_stages<kNumStages>(stage, phase, num_k_blocks);
        continue;
      }
      epi.prepare(p, &tmap_h, w.row0, w.row_end, w.n0);
      ptx::named_bar_sync(kBarSwigluTurnWg0 + wg, 256);
      pingpong_tile_mainloop<Mma, kNumStages, kBlockK, L::kABytes, L::kBBytes, PingPongDescs<L>::kBStepDesc>(
          acc0, acc1, num_k_blocks, full_bar, empty_bar, stage, phase, d.a_lo0, d.a_hi, d.b_lo0, d.b_hi, lane, [&] {
            if (k + 1 < ntiles) ptx::named_bar_arrive(kBarSwigluTurnWg0 + (wg ^ 1), 256);
          });
      epi.finish(p, &tmap_h, &tmap_dh, &tmap_aw, acc0, acc1, w.row0, w.row_end, w.n0, w.n0 / kBlockN);
    }
  }
#endif
}

}  // namespace sm90
}  // namespace prime_kernels
