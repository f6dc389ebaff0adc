// prime-kernels: sm90a L2 dgrad with the SwiGLU backward handed to helper warps (PK_SWIGLU_BWD_KERNEL=handoff).
//
// The work of swiglu_bwd_pp.cuh (da = dy_pool @ w2_e for 256 columns of I per tile, then the SwiGLU backward),
// but with the cooperative 128 x 256 tile (both consumer warpgroups on one tile, m64n256 each): it moves 20 KB of
// shared-memory operands per MFLOP against the ping-pong 128 x 128 tiles' 24 KB (bench/NOTES.md, session 8), and
// its epilogue is short: the consumers round da to bf16 (reference rounding point B2) into a 64 KB hand-off tile
// and go on with the next tile, while the three idle warps of the producer warpgroup (the helpers) read g, u from
// h, apply the SwiGLU backward and write dh, w * s and the d topk_weights partials straight from registers.
//
// Shared memory: 3 x 48 KB stages + the hand-off tile (two 64-row halves of four 64 x 64 boxes, 128-byte
// swizzle, written by stmatrix) = 208 KB. mbarriers ho_full (8 consumer warps arrive once their stores to the
// tile are done) and ho_free (3 helper warps arrive once their reads of it are done). Helpers and consumers walk
// the same static tile sequence, so no tile record travels between them.
//
// Helper work per tile: 128 rows x 2 halves of 128 columns = 256 (row, half) pairs; a warp takes two pairs per
// step (one per 16 lanes: lane = 16-byte chunk of 8 columns), warp hw takes rows hw, hw + 3, ...; the h loads of
// kHelperBatch steps are issued before any of their math. The d topk_weights partial of a pair (one per 128
// columns of I, as the ping-pong kernel writes) is each lane's 8 terms in column order, then a shuffle tree over
// the 16 lanes (xor 8, 4, 2, 1): deterministic. The next tile's h rows are prefetched into L2 (bulk prefetch)
// as soon as the helpers finish a tile, about one mainloop ahead of their reads.
#pragma once

#include <cuda.h>

#include "gemm_common.cuh"
#include "m_grouped_gemm.cuh"

namespace deep_gemm {
namespace sm90 {

template <int kNumStages>
struct SwigluBwdHoLayout : StageRingLayout<128, 256, 64, kNumStages> {
  using Ring = StageRingLayout<128, 256, 64, kNumStages>;
  using Stg = TmaStaging<256>;
  static constexpr int kDaOff = Ring::kRingEnd;  // the bf16 da hand-off tile
  static constexpr int kBarOff = kDaOff + Stg::kBytes;
  static constexpr int kHoFullOff = kBarOff + 2 * kNumStages * 8;
  static constexpr int kHoFreeOff = kHoFullOff + 8;
  static constexpr int kOffsOff = kHoFreeOff + 8;
  static constexpr int kMbOff = kOffsOff + (kMaxGroups + 1) * 4;  // first m-block of each group
  static constexpr int kEnd = kMbOff + (kMaxGroups + 1) * 4;
  static constexpr int kSmemBytes = kEnd + 1024;
  static_assert(kSmemBytes <= Ring::kSmemLimit, "shared memory budget exceeded");
  static_assert(kDaOff % 1024 == 0, "the hand-off tile is 128B-swizzled");
};

constexpr int kSwigluHelperWarps = 3;
constexpr int kHelperBatch = 4;
// The helpers hold two batches of kHelperBatch steps of h (64 registers) plus their math: 128 * 136 + 256 * 184 =
// 384 * 168.
constexpr uint32_t kSwigluHelperRegs = 136;
constexpr uint32_t kSwigluHoConsumerRegs = 184;
static_assert(128 * kSwigluHelperRegs + 256 * kSwigluHoConsumerRegs <= 384 * 168, "register split");

// The route weights of a worker's rows r_first + kWorkers * i of a tile (lane l holds i = l and i = l + 32) and
// their routed bits (route >= 0; a padding row's partial is written as 0).
template <int kWorkers>
struct RowWeights {
  float lo = 0.f, hi = 0.f;
  uint32_t routed_lo = 0u, routed_hi = 0u;
  __device__ __forceinline__ void load(const MGroupedParams& p, int row0, int r_first, int r_end, int lane) {
    const int r_lo = r_first + kWorkers * lane, r_hi = r_lo + 32 * kWorkers;
    const int route_lo = r_lo < r_end ? __ldg(p.pool_src_route + row0 + r_lo) : -1;
    const int route_hi = r_hi < r_end ? __ldg(p.pool_src_route + row0 + r_hi) : -1;
    lo = route_lo >= 0 ? __ldg(p.route_weights + route_lo) : 0.f;
    hi = route_hi >= 0 ? __ldg(p.route_weights + route_hi) : 0.f;
    routed_lo = __ballot_sync(0xffffffffu, route_lo >= 0);
    routed_hi = __ballot_sync(0xffffffffu, route_hi >= 0);
  }
};

// The SwiGLU backward of tile rows r_first, r_first + kWorkers, ... (< r_end) by one warp (see the file comment):
// a step is one row, lanes 0-15 its first 128 columns and lanes 16-31 the other 128, 16 bytes each. The h loads are
// double-buffered: batch i + 1's loads are in flight while batch i is computed.
template <bool kClamp, int kWorkers, typename Stg>
__device__ __forceinline__ void swiglu_bwd_rows(const MGroupedParams& p, int row0, int n0, int r_first, int r_end,
                                                int lane, uint32_t da_addr, const RowWeights<kWorkers>& wts) {
  constexpr int kB = kHelperBatch;
  const int steps = ceil_div(max(r_end - r_first, 0), kWorkers);
  const int half = lane >> 4;  // which 128 columns of the tile this lane covers
  const int cl = lane & 15;    // its 16-byte chunk within them
  const int inter = p.n;
  const float clamp = kClamp ? p.clamp : 0.f;  // 0: swiglu_bwd_value's clamp code folds away
  const int col = n0 + 128 * half + 8 * cl;
  const bool col_ok = col < inter;  // inter is a multiple of 8: a chunk is whole or absent
  const int dt_col = n0 / 128 + half;
  const bool dt_ok = 128 * dt_col < inter;
  const int64_t first = row0 + r_first;
  const __nv_bfloat16* hp0 = p.h + first * p.ldh + col;
  __nv_bfloat16* const dhp0 = p.dh + first * p.lddh + col;
  __nv_bfloat16* const awp0 = p.aw + first * p.ldaw + col;
  float* const dtp0 = p.dt_part + first * p.dt_ld + dt_col;
  const bool loads = col_ok && !(p.ho_dev & 2);
  auto load = [&](int s0, uint4(&g4)[kB], uint4(&u4)[kB]) {
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      g4[b] = make_uint4(0u, 0u, 0u, 0u);
      u4[b] = g4[b];
      if (s0 + b < steps && loads) {
        const __nv_bfloat16* hp = hp0 + (s0 + b) * (kWorkers * p.ldh);
        g4[b] = ptx::ld_global_nc_v4(hp);
        u4[b] = ptx::ld_global_nc_v4(hp + inter);
      }
    }
  };
  auto compute = [&](int s0, const uint4(&g4)[kB], const uint4(&u4)[kB]) {
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int step = s0 + b;
      const float wt = __shfl_sync(0xffffffffu, step < 32 ? wts.lo : wts.hi, step & 31);
      const bool routed = (((step < 32 ? wts.routed_lo : wts.routed_hi) >> (step & 31)) & 1u) != 0;
      if (step >= steps) continue;  // warp-uniform
      const int r = r_first + kWorkers * step;
      float partial = 0.f;
      if (col_ok) {
        // chunk (16 * half + cl) of tile row r in the swizzled hand-off tile
        const int rr = r & 63, chunk = 16 * half + cl;
        const uint32_t off = (r >> 6) * Stg::kHalfBytes + (chunk >> 3) * Stg::kBoxBytes + rr * 128 +
                             (static_cast<uint32_t>((chunk & 7) ^ (rr & 7)) << 4);
        const uint4 d4 = ptx::ld_shared_v4(da_addr + off);
        const uint32_t gw[4] = {g4[b].x, g4[b].y, g4[b].z, g4[b].w};
        const uint32_t uw[4] = {u4[b].x, u4[b].y, u4[b].z, u4[b].w};
        const uint32_t dw[4] = {d4.x, d4.y, d4.z, d4.w};
        uint32_t dg2[4], du2[4], av2[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const SwigluBwdValue lo = swiglu_bwd_value(__uint_as_float(gw[q] << 16), __uint_as_float(uw[q] << 16),
                                                     __uint_as_float(dw[q] << 16), wt, clamp);
          const SwigluBwdValue hi =
              swiglu_bwd_value(__uint_as_float(gw[q] & 0xffff0000u), __uint_as_float(uw[q] & 0xffff0000u),
                               __uint_as_float(dw[q] & 0xffff0000u), wt, clamp);
          partial += lo.prod;
          partial += hi.prod;
          dg2[q] = ptx::pack_bf16x2(lo.dg, hi.dg);
          du2[q] = ptx::pack_bf16x2(lo.du, hi.du);
          av2[q] = ptx::pack_bf16x2(lo.av, hi.av);
        }
        if (!(p.ho_dev & 4)) {
          __nv_bfloat16* dhp = dhp0 + step * (kWorkers * p.lddh);
          ptx::st_global_v4(dhp, make_uint4(dg2[0], dg2[1], dg2[2], dg2[3]));
          ptx::st_global_v4(dhp + inter, make_uint4(du2[0], du2[1], du2[2], du2[3]));
          ptx::st_global_v4(awp0 + step * (kWorkers * p.ldaw), make_uint4(av2[0], av2[1], av2[2], av2[3]));
        }
      }
#pragma unroll
      for (int x = 8; x >= 1; x >>= 1) partial += __shfl_xor_sync(0xffffffffu, partial, x);
      if (cl == 0 && dt_ok) dtp0[step * (kWorkers * p.dt_ld)] = routed ? partial : 0.f;
    }
  };
  uint4 ga[kB], ua[kB], gb[kB], ub[kB];
  load(0, ga, ua);
#pragma unroll 1
  for (int s0 = 0; s0 < steps; s0 += 2 * kB) {
    load(s0 + kB, gb, ub);
    compute(s0, ga, ua);
    load(s0 + 2 * kB, ga, ua);
    compute(s0 + kB, gb, ub);
  }
}

template <int kWorkers, typename Stg>
__device__ __forceinline__ void swiglu_bwd_rows_any_clamp(const MGroupedParams& p, int row0, int n0, int r_first,
                                                          int r_end, int lane, uint32_t da_addr,
                                                          const RowWeights<kWorkers>& wts) {
  if (p.clamp > 0.f)
    swiglu_bwd_rows<true, kWorkers, Stg>(p, row0, n0, r_first, r_end, lane, da_addr, wts);
  else
    swiglu_bwd_rows<false, kWorkers, Stg>(p, row0, n0, r_first, r_end, lane, da_addr, wts);
}

template <int kNumStages>
__global__ void __launch_bounds__(kNumThreads, 1)
    m_grouped_swiglu_bwd_ho_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                                   const MGroupedParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = SwigluBwdHoLayout<kNumStages>;
  constexpr int kBlockM = L::kBlockM;
  constexpr int kBlockN = L::kBlockN;
  constexpr int kBlockK = L::kBlockK;
  using Mma = ptx::WgmmaBf16<kBlockN, 0, 1>;  // B MN-major
  constexpr int kMnBoxBytes = 64 * kBlockK * 2;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + L::kBarOff);
  uint64_t* empty_bar = full_bar + kNumStages;
  uint64_t* ho_full = reinterpret_cast<uint64_t*>(smem + L::kHoFullOff);
  uint64_t* ho_free = reinterpret_cast<uint64_t*>(smem + L::kHoFreeOff);
  int32_t* s_offs = reinterpret_cast<int32_t*>(smem + L::kOffsOff);
  int32_t* s_mb = reinterpret_cast<int32_t*>(smem + L::kMbOff);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int num_groups = p.num_groups;

  if (tid == 0) {
    ptx::mbar_init(ho_full, kNumConsumerThreads / 32);
    ptx::mbar_init(ho_free, kSwigluHelperWarps);
    // empty: the 8 consumer warps (the fence also publishes the hand-off barriers above)
    init_stage_barriers(full_bar, empty_bar, kNumStages, 1, kNumConsumerThreads / 32);
  }
  if (tid == 32) {
    ptx::tma_prefetch_desc(&tmap_a);
    ptx::tma_prefetch_desc(&tmap_b);
  }
  load_group_offsets_and_mblocks<kBlockM>(p.group_offsets, num_groups, p.m_total, s_offs, s_mb);
  // computed by each role after its setmaxnreg (a value live across the register reconfiguration gets spilled)
  auto num_tiles_now = [&](int n_blocks) -> int {
    return static_cast<int>(ptx::ld_shared_u32(ptx::smem_addr(s_mb + p.num_groups))) * n_blocks;
  };
  struct Work {
    int g;
    int row0;
    int rows;  // rows of the tile inside the group (1..128)
    int n0;
  };
  // Tile order: group-major, then m-block, n-block fastest: the n-blocks of an m-block run at about the same time
  // in neighbouring CTAs, so its dy rows come from DRAM once (the ping-pong kernel's m-fastest order re-read them:
  // with 256-column tiles a wave spans twice as many experts, and their dy and w2 panels no longer fit in L2).
  auto locate = [&](int u, int& g, int n_blocks) -> Work {
    while (s_mb[g + 1] * n_blocks <= u) ++g;
    const int start = s_offs[g];
    const int end = max(s_offs[g + 1], start);
    const int local = u - s_mb[g] * n_blocks;
    const int mb = local / n_blocks;
    const int nb = local - mb * n_blocks;
    const int row0 = start + mb * kBlockM;
    return Work{g, row0, min(end - row0, kBlockM), nb * kBlockN};
  };

  if (warp < 4) {
    ptx::setmaxnreg_dec<kSwigluHelperRegs>();
    if (warp == 0) {
      if (lane == 0) {
        int stage = 0;
        uint32_t phase = 0;
        int g = 0;
        const int n_blocks = ceil_div(p.n, kBlockN);
        const int num_k_blocks = ceil_div(p.k, kBlockK);
        const int num_tiles = num_tiles_now(n_blocks);
        for (int u = (int)ptx::ctaid_x_volatile(); u < num_tiles; u += (int)gridDim.x) {
          const Work w = locate(u, g, n_blocks);
          for (int kb = 0; kb < num_k_blocks; ++kb) {
            ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
            uint8_t* sa = smem + L::kAOff + stage * L::kABytes;
            uint8_t* sb = smem + L::kBOff + stage * L::kBBytes;
            ptx::mbar_arrive_expect_tx(&full_bar[stage], L::kABytes + L::kBBytes);
            ptx::tma_load_2d(sa, &tmap_a, &full_bar[stage], kb * kBlockK, w.row0);
#pragma unroll
            for (int j = 0; j < kBlockN / 64; ++j)
              ptx::tma_load_3d(sb + j * kMnBoxBytes, &tmap_b, &full_bar[stage], w.n0 + 64 * j, kb * kBlockK, w.g);
            advance_stage<kNumStages>(stage, phase);
          }
        }
      }
    } else {
      // ================= helpers: the SwiGLU backward of each handed-off tile =================
      const int hw = warp - 1;
      const int inter = p.n;
      const uint32_t da_addr = ptx::smem_addr(smem + L::kDaOff);
      const int n_blocks = ceil_div(p.n, kBlockN);
      const int num_tiles = num_tiles_now(n_blocks);
      auto prefetch_h = [&](const Work& w) {  // the tile's gate and up pieces into L2, one piece per thread
        const int cols = min(kBlockN, inter - w.n0);
        for (int i = tid - 32; i < 2 * w.rows; i += 32 * kSwigluHelperWarps) {
          const __nv_bfloat16* src = p.h + static_cast<int64_t>(w.row0 + (i >> 1)) * p.ldh + (i & 1) * inter + w.n0;
          ptx::bulk_prefetch_l2(src, static_cast<uint32_t>(cols) * 2);
        }
      };
      uint32_t ho_phase = 0;
      int g = 0;
      int u = (int)ptx::ctaid_x_volatile();
      Work w{};
      if (u < num_tiles) {
        w = locate(u, g, n_blocks);
        if (p.ho_dev & 8) prefetch_h(w);
      }
      for (; u < num_tiles; u += (int)gridDim.x) {
        // rows [share, 128) of the tile; the consumers take [0, share) (MGroupedParams::ho_share)
        RowWeights<kSwigluHelperWarps> wts;
        wts.load(p, w.row0, p.ho_share + hw, w.rows, lane);
        const long long t_w0 = clock64();
        ptx::mbar_wait(ho_full, ho_phase);
        const long long t_w1 = clock64();
        ho_phase ^= 1u;
        if (!(p.ho_dev & 1))
          swiglu_bwd_rows_any_clamp<kSwigluHelperWarps, typename L::Stg>(p, w.row0, w.n0, p.ho_share + hw, w.rows,
                                                                         lane, da_addr, wts);
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(ho_free);  // this warp's reads of the hand-off tile are done
        if (p.ho_stats != nullptr && lane == 0) {
          atomicAdd(reinterpret_cast<unsigned long long*>(p.ho_stats + blockIdx.x * 8 + 3 + hw), t_w1 - t_w0);
          if (hw == 0) atomicAdd(reinterpret_cast<unsigned long long*>(p.ho_stats + blockIdx.x * 8 + 6), clock64() - t_w1);
        }
        if (u + (int)gridDim.x < num_tiles) {
          w = locate(u + (int)gridDim.x, g, n_blocks);
          if (p.ho_dev & 8) prefetch_h(w);
        }
      }
    }
  } else {
    // ================= consumer warpgroups: 64 rows x 256 columns each =================
    ptx::setmaxnreg_inc<kSwigluHoConsumerRegs>();
    const int wg = (warp >> 2) - 1;
    const int wg_tid = tid - 128 * (wg + 1);
    const uint32_t a_base = ptx::smem_addr(smem + L::kAOff) + wg * (64 * 128);
    const uint64_t desc_a0 = ptx::make_desc_sw128(a_base, 0, 1024);
    const uint64_t desc_b0 = ptx::make_desc_sw128(ptx::smem_addr(smem + L::kBOff), kMnBoxBytes, 1024);
    const uint32_t a_lo0 = static_cast<uint32_t>(desc_a0), a_hi = static_cast<uint32_t>(desc_a0 >> 32);
    const uint32_t b_lo0 = static_cast<uint32_t>(desc_b0), b_hi = static_cast<uint32_t>(desc_b0 >> 32);
    constexpr uint32_t kBStepBytes = 16 * 128;  // one k16 step of MN-major B
    const uint32_t da_addr = ptx::smem_addr(smem + L::kDaOff);
    const uint32_t da_half = da_addr + wg * L::Stg::kHalfBytes;
    const int n_blocks = ceil_div(p.n, kBlockN);
    const int num_k_blocks = ceil_div(p.k, kBlockK);
    const int num_tiles = num_tiles_now(n_blocks);
    float acc[kBlockN / 2];
    int stage = 0;
    uint32_t phase = 0;
    uint32_t ho_phase = 0;  // hand-offs so far, mod 2
    int g = 0;
    for (int u = (int)ptx::ctaid_x_volatile(); u < num_tiles; u += (int)gridDim.x) {
      const Work w = locate(u, g, n_blocks);
      const bool active = 64 * wg < w.rows;
      auto release = [&](int s_) {
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(&empty_bar[s_]);
      };
      const long long t0 = clock64();
      consumer_tile_mainloop<Mma, kNumStages, kBlockK, L::kABytes, L::kBBytes, kBStepBytes, false>(
          acc, active, num_k_blocks, full_bar, stage, phase, a_lo0, a_hi, b_lo0, b_hi, release);
      const long long t1 = clock64();
      ptx::mbar_wait(ho_free, ho_phase ^ 1u);  // the helpers are done with the previous tile's da
      // ... and the other consumer warpgroup with its share (it may still be at it with few k-blocks per tile)
      if (p.ho_share > 0) ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);
      const long long t2 = clock64();
      if (active) write_acc_to_swizzled_staging<kBlockN>(acc, da_half, wg_tid);  // da rounded to bf16 (B2)
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(ho_full);
      ho_phase ^= 1u;
      if (p.ho_share > 0) {
        // the consumers' share of the tile just handed off: its first rows, before the next mainloop (whose first
        // stages are already loading), so that the helpers' part fits in one mainloop
        const int cw = warp - 4;
        RowWeights<kNumConsumerThreads / 32> wts;
        const int r_end = min(p.ho_share, w.rows);
        wts.load(p, w.row0, cw, r_end, lane);
        swiglu_bwd_rows_any_clamp<kNumConsumerThreads / 32, typename L::Stg>(p, w.row0, w.n0, cw, r_end, lane,
                                                                            da_addr, wts);
      }
      if (p.ho_stats != nullptr && wg_tid == 0 && wg == 0) {
        p.ho_stats[blockIdx.x * 8 + 0] += t1 - t0;
        p.ho_stats[blockIdx.x * 8 + 1] += t2 - t1;
        p.ho_stats[blockIdx.x * 8 + 2] += clock64() - t2;
      }
    }
  }
#endif
}

}  // namespace sm90
}  // namespace deep_gemm
