// prime-kernels: sm90a fused Mega MoE forward (BF16), ping-pong consumers: run with PK_MEGA_FWD_KERNEL=pingpong
// or the in-kernel combine (mega_moe.cu); the default is the cooperative kernel of mega_moe_fwd.cuh.
//
// Same work, sequence, dispatch and readiness counters as mega_moe_fwd.cuh, but each consumer warpgroup owns
// whole 128 x 128 tiles (two m64n128 wgmma per k-step, 2 x 64 accumulator registers) and the two warpgroups
// take this CTA's tiles in turn: while one runs its mainloop the other runs its epilogue. A pair of named
// barriers passes the tensor cores from one warpgroup to the other once a warpgroup has issued all of its
// tile's MMAs. Why: with one 128 x 256 tile shared by both warpgroups, the tensor cores idle during every
// epilogue (~250 us per CTA at 30B, T=16384: bench/NOTES.md); here the epilogue hides behind the other
// warpgroup's mainloop as long as it is shorter. Cost: 128-column tiles load B once per 128 x 128 instead of
// 128 x 256 outputs (a third more shared-memory fill per FLOP). Measured on the H200 (bench/NOTES.md,
// session 4): kernel with h 2.21 vs 2.44 ms at 30B, T=16384.
//   * L1 tile: 64 s columns: gate rows n0.. and up rows I + n0.. of w13 (two 64-row TMA boxes per stage).
//     Each L1 tile adds one to its m-block's L1 counter; an L2 tile waits for I / 64 of them.
//   * L2 tile: 128 o columns. With MegaFwdParams::y set, the tile also does its part of the combine
//     (mega_combine_rows); otherwise the combine is a separate launch.
//   * The stage ring is shared: the producer fills it in tile order; a warpgroup skips (without waiting) the
//     stages of the other's tiles, and releases its own (the empty barriers count one warpgroup's 4 warps).
#pragma once

#include "mega_moe_fwd.cuh"

namespace deep_gemm {
namespace sm90 {

template <int kNumStages, int kDispatchSlots>
struct MegaFwdPPLayout : StageRingLayout<128, 128, 64, kNumStages> {
  using Ring = StageRingLayout<128, 128, 64, kNumStages>;
  static constexpr int kCOff = Ring::kRingEnd;  // per warpgroup: 64 rows x 128 columns
  static constexpr int kDispOff = kCOff + TmaStaging<Ring::kBlockN>::kBytes;
  static constexpr int kBarOff = kDispOff + kDispatchSlots * kDispatchSlotBytes;
  static constexpr int kOffsOff = kBarOff + 2 * kNumStages * 8;
  static constexpr int kMbOff = kOffsOff + (kMegaMaxExperts + 1) * 4;
  static constexpr int kEnd = kMbOff + (kMegaMaxExperts + 1) * 4;
  static constexpr int kSmemBytes = kEnd + 1024;
  static_assert(kSmemBytes <= Ring::kSmemLimit, "shared memory budget exceeded");
};

// Combine columns per arrival counter: one L2 tile's width.
constexpr int kCombineCols = 128;

// Called by one consumer warpgroup (wg_tid = 0..127, one pool row each) after its L2 tile's o rows
// [row0, row0 + rows) x [n0, n0 + 128) are stored (generic stores) and fenced by every thread of the
// warpgroup and a named barrier has passed. Each row counts itself in (token, column block); the row that
// completes its token's count reduces the token's 128 columns over its routes in k order, with the same
// arithmetic as the standalone combine kernel (common/combine.cuh), so y is bit-identical to it.
__device__ __forceinline__ void mega_combine_rows(const MegaFwdParams& p, int wg_tid, int row0, int rows, int n0) {
  const int lane = wg_tid & 31;
  const int K = p.top_k;
  const int col_blocks = (p.hidden + kCombineCols - 1) / kCombineCols;
  int token = -1;
  bool last = false;
  if (wg_tid < rows) {
    const int route = __ldg(p.pool_src_route + row0 + wg_tid);
    if (route >= 0 && route / K < p.num_tokens) {
      token = route / K;  // one rank: route ids are token * top_k + k
      // the arrival first: its round trip overlaps the loads of the token's route count
      const int before = atomicAdd(p.token_ctr + static_cast<int64_t>(token) * col_blocks + n0 / kCombineCols, 1);
      const int32_t* r2p = p.route_to_pool + static_cast<int64_t>(token) * K;
      int routed = 0;
#pragma unroll 8
      for (int k = 0; k < K; ++k) routed += __ldg(r2p + k) >= 0;
      last = before == routed - 1;
    }
  }
  uint32_t pending = __ballot_sync(0xffffffffu, last);
  if (pending == 0) return;
  // acquire: the other tiles' o rows of these tokens were fenced before their arrivals; the lanes that saw
  // the last arrival fence, and the warp barrier orders the other lanes' loads after them
  __threadfence();
  __syncwarp();
  // A half-warp per token (16 lanes x 8 columns). Routes go in batches of 8: lanes 0-7 of the half load the
  // batch's pool rows and weights, then every lane issues its 8 row loads before the first fma, so a batch
  // costs two memory latencies instead of two per route.
  const int half = lane >> 4;
  const int hl = lane & 15;
  const int col = n0 + hl * 8;
  const uint32_t all = 0xffffffffu;
  while (pending != 0) {  // warp-uniform
    const int la = __ffs(pending) - 1;
    pending &= pending - 1;
    int lb = -1;
    if (pending != 0) {
      lb = __ffs(pending) - 1;
      pending &= pending - 1;
    }
    const int ta = __shfl_sync(all, token, la);
    const int tb = __shfl_sync(all, token, lb < 0 ? la : lb);
    const bool active = (half == 0 || lb >= 0) && col < p.hidden;
    const int64_t route0 = static_cast<int64_t>(half == 0 ? ta : tb) * K;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int kb = 0; kb < K; kb += 8) {
      int my_row = -1;
      float my_w = 0.f;
      if (hl < 8 && kb + hl < K) {
        my_row = __ldg(p.route_to_pool + route0 + kb + hl);
        if (my_row >= p.m_total) my_row = -1;
        my_w = p.topk_weights != nullptr ? __ldg(p.topk_weights + route0 + kb + hl) : 1.0f;
      }
      uint4 v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int row = __shfl_sync(all, my_row, (half << 4) + j);
        v[j] = active && row >= 0 ? ptx::ld_global_cg_v4(p.o + static_cast<int64_t>(row) * p.hidden + col)
                                  : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int row = __shfl_sync(all, my_row, (half << 4) + j);
        const float w = __shfl_sync(all, my_w, (half << 4) + j);
        if (row >= 0) common::add_bf16x8(acc, v[j], w);  // k order; skipped routes add nothing
      }
    }
    if (active) {
      uint4 packed;
      __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
      for (int i = 0; i < 4; ++i) o2[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
      *reinterpret_cast<uint4*>(p.y + route0 / K * p.hidden + col) = packed;
    }
  }
}

// Tokens with no route get no arrival: their y rows are zeroed here (dispatch warps, once dispatch is done).
__device__ __forceinline__ void mega_zero_unrouted_tokens(const MegaFwdParams& p, int dwarp, int lane) {
  const int K = p.top_k;
  for (int t = blockIdx.x * 3 + dwarp; t < p.num_tokens; t += gridDim.x * 3) {
    bool routed = false;
    for (int k = lane; k < K; k += 32) routed |= __ldg(p.route_to_pool + static_cast<int64_t>(t) * K + k) >= 0;
    if (__any_sync(0xffffffffu, routed)) continue;
    for (int c = lane * 8; c < p.hidden; c += 256)
      *reinterpret_cast<uint4*>(p.y + static_cast<int64_t>(t) * p.hidden + c) = make_uint4(0, 0, 0, 0);
  }
}

constexpr uint32_t kBarTurnWg0 = 5;  // +wg: "the tensor cores are this warpgroup's"

template <int kNumStages, int kDispatchSlots>
__global__ void __launch_bounds__(kNumThreads, 1)
    mega_moe_fwd_pp_kernel(const __grid_constant__ CUtensorMap tmap_xpool, const __grid_constant__ CUtensorMap tmap_w13,
                           const __grid_constant__ CUtensorMap tmap_s, const __grid_constant__ CUtensorMap tmap_w2,
                           const __grid_constant__ CUtensorMap tmap_h, const __grid_constant__ CUtensorMap tmap_o,
                           const __grid_constant__ MegaFwdParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = MegaFwdPPLayout<kNumStages, kDispatchSlots>;
  static_assert(L::kBlockN == kCombineCols, "one arrival counter per L2 tile width");
  constexpr int kBlockM = L::kBlockM;
  constexpr int kBlockN = L::kBlockN;
  constexpr int kBlockK = L::kBlockK;
  using Mma = ptx::WgmmaBf16<kBlockN, 0, 0>;
  constexpr int kAcc = kBlockN / 2;  // accumulator registers per 64-row half

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + L::kBarOff);
  uint64_t* empty_bar = full_bar + kNumStages;
  int32_t* s_offs = reinterpret_cast<int32_t*>(smem + L::kOffsOff);
  int32_t* s_mb = reinterpret_cast<int32_t*>(smem + L::kMbOff);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int num_experts = p.num_experts;
  // an empty barrier counts the 4 warps of the warpgroup that consumed the stage
  mega_fwd_prologue<kNumStages, kBlockM>(p, full_bar, empty_bar, 4, s_offs, s_mb, &tmap_xpool, &tmap_w13, &tmap_s,
                                         &tmap_w2, &tmap_h, &tmap_o);
  using Seq = MegaTileSequence<kBlockM, kBlockN, kBlockK>;
  const Seq seq(p, s_offs, s_mb);

  if (warp < 4) {
    ptx::setmaxnreg_dec<kMegaProducerRegs>();
    if (warp == 0 && lane == 0) {
      // tile order, one shared ring; an L2 tile waits for each of its m-block's L1 tiles (one arrival each)
      mega_tma_producer<L, kNumStages>(p, seq, seq.n1, smem, full_bar, empty_bar, &tmap_xpool, &tmap_w13, &tmap_s,
                                       &tmap_w2);
    } else if (warp >= 1) {
      mega_dispatch_role<kBlockM, kDispatchSlots>(p, ptx::smem_addr(smem + L::kDispOff), warp - 1, lane, s_offs, s_mb,
                                                  num_experts, seq.disp_ctr);
      if (p.y != nullptr) mega_zero_unrouted_tokens(p, warp - 1, lane);
    }
  } else {
    // ================= consumer warpgroups: alternate tiles =================
    ptx::setmaxnreg_inc<kMegaConsumerRegs>();
    const int wg = (warp >> 2) - 1;
    const int wg_tid = tid - 128 * (wg + 1);
    const uint64_t desc_a0 = ptx::make_desc_sw128(ptx::smem_addr(smem + L::kAOff), 0, 1024);
    const uint64_t desc_b0 = ptx::make_desc_sw128(ptx::smem_addr(smem + L::kBOff), 0, 1024);
    const uint32_t a_lo0 = static_cast<uint32_t>(desc_a0), a_hi = static_cast<uint32_t>(desc_a0 >> 32);
    const uint32_t b_lo0 = static_cast<uint32_t>(desc_b0), b_hi = static_cast<uint32_t>(desc_b0 >> 32);
    const uint32_t stg = ptx::smem_addr(smem + L::kCOff) + wg * TmaStaging<kBlockN>::kHalfBytes;
    constexpr int kBox = TmaStaging<kBlockN>::kBoxBytes;
    const bool f6 = p.clamp > 0.f;

    const int cta = (int)ptx::ctaid_x_volatile();
    const int step = (int)gridDim.x;
    const int ntiles = cta < seq.num_tasks ? ceil_div(seq.num_tasks - cta, step) : 0;
    // Turn passing, balanced: before each of its tiles a warpgroup waits for its turn; after issuing a tile's
    // MMAs it passes the turn on only if the other warpgroup has a next tile (no arrival is left pending).
    if (wg == 1 && ntiles > 0) ptx::named_bar_arrive(kBarTurnWg0, 256);

    const long long t_start = clock64();
    // development stats (p.stats): per warpgroup, clocks waiting for the turn, in the mainloop, in epilogues
    long long st_turn = 0, st_main = 0, st_epi_l1 = 0, st_epi_l2 = 0;
    float acc0[kAcc], acc1[kAcc];
    int stage = 0;
    uint32_t phase = 0;
    int e = 0;
    bool in_l2 = false;
    int k = 0;
    for (int u = cta; u < seq.num_tasks; u += step, ++k) {
      const auto t = seq.locate(u, e, in_l2);
      const int kbs = t.l1 ? seq.kb1 : seq.kb2;
      if ((k & 1) != wg) {  // the other warpgroup's tile: its stages pass by
        skip_stages<kNumStages>(stage, phase, kbs);
        continue;
      }
      const bool half1 = t.row0 + 64 < t.row_end;  // rows 64..127 exist (uniform over the warpgroup)
      const long long t_turn0 = p.stats != nullptr ? clock64() : 0;
      ptx::named_bar_sync(kBarTurnWg0 + wg, 256);
      const long long t_turn1 = p.stats != nullptr ? clock64() : 0;

      pingpong_tile_mainloop<Mma, kNumStages, kBlockK, L::kABytes, L::kBBytes, (32 >> 4)>(
          acc0, acc1, kbs, full_bar, empty_bar, stage, phase, a_lo0, a_hi, b_lo0, b_hi, lane, [&] {
            if (k + 1 < ntiles) ptx::named_bar_arrive(kBarTurnWg0 + (wg ^ 1), 256);
          });
      const long long t_main = p.stats != nullptr ? clock64() : 0;

      // Epilogue, one 64-row half at a time through this warpgroup's 64 x 128 staging tile.
      // Boxes (64 columns each): L1 h = gate box -> h column n0, up box -> I + n0; L2 o = columns n0, n0 + 64.
      // (L1's h is rounded as saved before it gets here, so plain rounding packs it exactly.)
      auto staged_store = [&](const float (&acc)[kAcc], int hrow0, __nv_bfloat16* out, int64_t ld, int col_a,
                              int col_b, int limit, const CUtensorMap* map, bool split) {
        if (wg_tid == 0) ptx::bulk_wait_group_read<0>();
        ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
        write_acc_to_swizzled_staging<kBlockN>(acc, stg, wg_tid);
        ptx::fence_proxy_async_smem();
        ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
        if (hrow0 + 64 <= t.row_end) {
          if (wg_tid == 0) {
            if (col_a < limit) ptx::tma_store_2d(map, stg, col_a, hrow0);
            if (col_b < (split ? 2 * limit : limit)) ptx::tma_store_2d(map, stg + kBox, col_b, hrow0);
            ptx::bulk_commit_group();
          }
        } else if (split) {
          copy_swizzled_half_to_global<kBlockN, true>(stg, wg_tid, t.row_end - hrow0, out, ld, hrow0, col_a, limit);
        } else {
          copy_swizzled_half_to_global<kBlockN, false>(stg, wg_tid, t.row_end - hrow0, out, ld, hrow0, col_a, limit);
        }
      };
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        if (hh == 1 && !half1) break;
        float(&acc)[kAcc] = hh == 0 ? acc0 : acc1;
        const int hrow0 = t.row0 + 64 * hh;
        if (t.l1) {
          // h as saved (F6), in place: the h store packs it exactly and s is computed from it (reference F3)
          if (f6)
            round_acc_as_saved_h<kBlockN>(acc, RoundHMasks{p.clamp, p.clamp_below, p.clamp_above});
          else
            round_acc_as_saved_h<kBlockN>(acc, RoundHPlain{});
          if (p.h != nullptr)
            staged_store(acc, hrow0, p.h, 2 * p.inter, t.n0, p.inter + t.n0, p.inter, &tmap_h, true);
          store_swiglu_from_acc<kBlockN>(acc, wg_tid, p.s, p.inter, hrow0, t.row_end, t.n0, p.inter, p.clamp);
        } else if (p.y != nullptr) {
          // generic stores (not TMA): the reducing warp, in any CTA, reads them after one fence/atomic pair
          if (wg_tid == 0) ptx::bulk_wait_group_read<0>();
          ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
          write_acc_to_swizzled_staging<kBlockN>(acc, stg, wg_tid);
          ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
          copy_swizzled_half_to_global<kBlockN, false>(stg, wg_tid, min(64, t.row_end - hrow0), p.o, p.hidden,
                                                       hrow0, t.n0, p.hidden);
        } else {
          staged_store(acc, hrow0, p.o, p.hidden, t.n0, t.n0 + 64, p.hidden, &tmap_o, false);
        }
      }
      if (!t.l1 && p.y != nullptr) {
        __threadfence();  // release: this thread's o stores, before the warpgroup's arrivals
        ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
        mega_combine_rows(p, wg_tid, t.row0, Seq::rows(t), t.n0);
      }
      if (p.stats != nullptr) {
        const long long t_end = clock64();
        st_turn += t_turn1 - t_turn0;
        st_main += t_main - t_turn1;
        (t.l1 ? st_epi_l1 : st_epi_l2) += t_end - t_main;
      }
      if (t.l1) {
        // s is read by TMA (async proxy) in whichever CTA runs the L2 tiles of this m-block
        ptx::fence_proxy_async_global();
        ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
        if (wg_tid == 0) ptx::red_release_gpu_add(seq.l1_ctr + t.mb, 1);
      }
    }
    if (wg_tid == 0) ptx::bulk_wait_group<0>();
    if (p.stats != nullptr && wg_tid == 0) {
      long long* st = p.stats + blockIdx.x * kStatsPerCta;
      st[4 + wg] = clock64() - t_start;
      st[8 + wg] = st_turn;
      st[10 + wg] = st_main;
      st[12 + wg] = st_epi_l1;
      st[14 + wg] = st_epi_l2;
    }
  }
#endif
}

}  // namespace sm90
}  // namespace deep_gemm
