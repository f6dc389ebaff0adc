// prime-kernels: sm90a fused Mega MoE forward (BF16): dispatch, L1 + SwiGLU and L2 in one persistent kernel
// (both consumer warpgroups on one 128 x 256 tile).
//
// Per pool row m of expert e (rows grouped by expert through offsets; the routing plan's order):
//   x_pool[m] = x_{rank(m)}[token(m)]                                   (dispatch: cp.async + stores per 4 KB piece)
//   h[m]      = [x_pool[m] @ w13_e[0:I]^T | x_pool[m] @ w13_e[I:2I]^T]  (fp32 accumulation; stored as bf16 when asked)
//   s[m]      = silu(h~_gate) * h~_up                                   (h~: h rounded as saved; fp32 math, bf16 out;
//                                                                       optional clamp)
//   o[m]      = s[m] @ w2_e^T                                           (bf16 out)
// and the deterministic combine (a second launch) sums o over each token's routes. Under expert parallelism over peer
// memory x_{rank} is a peer's staged rows, and o[m] goes instead to its source rank's combine slot for its route
// (MegaFwdParams::o_slots); mega_moe_fwd_ranks_kernel runs several ranks' forwards in one launch (the one-GPU
// emulator); mega_moe_fwd_second_b_kernel runs a one-rank forward whose last groups are shared experts' chunks, their
// B tiles read from the shared weights (MegaFwdSecondB).
// The parameters, the shared-memory layout, the dispatch role, the task sequence and the TMA producer, which the FP8
// kernel shares, are in mega_moe_fwd_roles.cuh; the consumers and the epilogue hand-off are here.
//
// Work: one task sequence (the scheduling of DeepGEMM's Mega MoE, rewritten for Hopper's register-resident
// accumulators): all L1 tiles (per expert: the I/128 n-blocks, each pairing gate rows c.. and up rows I + c.. of
// the natural w13 layout, m-blocks fastest within bands of 16), then all L2 tiles (per expert: H/256 n-blocks, the
// same order). A tile waits only for tasks earlier in the sequence (an L2 tile for its m-block's L1 tiles) and for
// the dispatch of its m-block's rows.
//
// Forward progress, without assuming that the grid is resident: beside NCCL, another stream's kernels or a second
// forward of ours, some CTAs may not start until others exit. So no work is tied to a CTA index:
//   * each CTA's TMA thread claims tasks from a global counter (atomicAdd), so tasks are handed out in sequence
//     order, and only to CTAs that are running. A claimed task waits only for lower tasks, all of which are
//     claimed already by running CTAs, and every CTA finishes its tasks in the order it claimed them. By
//     induction on the task index the lowest unfinished task can always proceed: its dependencies are finished,
//     and everything its CTA claimed before it is finished (the consumers' deferred L1 arrival is made before
//     they block on the next task, see arrive_pending), so the producer and the consumers of its CTA are on it
//     (that CTA may hold one more claimed task, a higher one, which changes none of this).
//   * the dispatch warps of every running CTA claim pieces of the dispatch the same way (dispatch_rows.cuh) until
//     none are left; the dispatch waits for nothing, so every claimed piece lands and every piece is claimed.
//   * within a CTA, the dispatch warps (the hand-off helpers once their dispatch is done) wait only for their own
//     CTA's consumers and their own stores, and the consumers only for them, for their producer and for the
//     dispatch being done; none of those waits for anything unfinished in another CTA.
// A grid of any size therefore completes with any subset of its CTAs running, and the result is bitwise the
// same (a task's output does not depend on which CTA ran it). Each wait on another CTA is still bounded
// (common/watchdog.cuh): past the timeout it records what it waited for and traps.
//   * dispatch (producer warps 1-3 of every CTA): copy x rows into x_pool, the first rows in pool order, the
//     rest token by token (see the roles below); per-m-block dispatch counters count the 4 KB pieces that have
//     landed.
//   * L1 tile: the TMA thread waits (ld.acquire) until its m-block's dispatch counter is complete, then
//     streams x_pool and w13 like the grouped GEMM. Epilogue: h (when asked) and s go out through the staging
//     tile by TMA stores; each consumer warpgroup then adds one to the m-block's L1 counter (release) once its
//     stores are complete, which it checks only after the next tile's first MMAs are queued, or before that
//     tile's first wait if the wait cannot be passed yet: an arrival is never held behind a blocking wait.
//     Once the CTA's dispatch is done, a tile whose 128 rows all belong to the expert is instead handed to the
//     dispatch warps (MegaHandoff below): the consumers stage bf16 gate | up and go on; the helpers store h and
//     s and give the L1 counter both arrivals.
//   * L2 tile: waits until the m-block's L1 counter reaches 2 * (I/128 n-blocks) (every s column of the rows
//     it reads), then streams s and w2; its epilogue TMA-stores o (pool order) for the combine. Once the CTA's
//     dispatch is done, a tile of 128 rows stages bf16 o for the dispatch warps instead, which issue the stores
//     (the issue of a TMA store holds its thread for hundreds of cycles; the consumers go on at once).
//   * the producer hands each claimed task to its consumers with the tile's first stage (MegaFwdLayout::kTaskOff);
//     -1 there, with no loads, ends them.
// Writes read later by TMA in another CTA: generic-proxy ones (x_pool; s rows of an expert's last m-block) get
// a writer fence.proxy.async.global, then a release; TMA-stored s is waited for (bulk wait_group) and fenced
// the same way; the reader acquires, then fence.proxy.async.global before its TMA loads.
#pragma once

#include <cuda.h>

#include "common/watchdog.cuh"
#include "epilogue.cuh"
#include "kernel_common.cuh"
#include "mainloop.cuh"
#include "mega_moe_fwd_roles.cuh"
#include "pipeline.cuh"
#include "swiglu_math.cuh"

namespace prime_kernels {
namespace sm90 {

// The L1 epilogue hand-off (MegaFwdParams::handoff). The consumers' L1 epilogue is mostly SwiGLU (two MUFU
// operations per element: about as long as the h and s stores together, and the tensor cores idle through it),
// while the dispatch warps are idle once this CTA's dispatch is done. From then on, a tile whose 128 rows are all
// inside the expert is staged whole as bf16 (gate boxes in staging tile A, up boxes in tile B, each rounded as h
// is saved) and the consumers go on with the next tile; the helpers (the dispatch warps) store h from there when
// asked, compute s = silu(g) * u in place over the gate boxes (from the same bf16 values the other epilogues
// round first: bit-identical s), store s, hand the tiles back, and once s has landed give the m-block's L1
// counter both warpgroups' arrivals. The consumers write the record before their arrival on ho_full; last = 1
// (after the consumers' last tile) ends the helpers' loop.
struct MegaHandoff {
  int32_t mb, row0, n0, last;  // mb < 0: an L2 tile (o columns n0.. in tile A, n0 + kStageCols.. in tile B)
};
constexpr uint32_t kBarHelpers = 4;  // named barrier of the 96 helper threads (ids 1-3: the consumers')

__device__ __forceinline__ uint32_t swiglu_bf16x2(uint32_t g2, uint32_t u2, float clamp) {
  const float g0 = __uint_as_float(g2 << 16), g1 = __uint_as_float(g2 & 0xffff0000u);
  const float u0 = __uint_as_float(u2 << 16), u1 = __uint_as_float(u2 & 0xffff0000u);
  return ptx::pack_bf16x2(swiglu_value(g0, u0, clamp), swiglu_value(g1, u1, clamp));
}

template <typename L>
__device__ __forceinline__ void mega_handoff_helper(const MegaFwdParams& p, int32_t* l1_ctr, uint8_t* smem, int htid,
                                                    const CUtensorMap* tmap_h, const CUtensorMap* tmap_s_st,
                                                    const CUtensorMap* tmap_o) {
  uint64_t* ho_full = reinterpret_cast<uint64_t*>(smem + L::kHoFullOff);
  uint64_t* ho_free = reinterpret_cast<uint64_t*>(smem + L::kHoFreeOff);
  MegaHandoff* info = reinterpret_cast<MegaHandoff*>(smem + L::kHoInfoOff);
  const uint32_t stg_a = ptx::smem_addr(smem + L::kCOff);
  const uint32_t stg_b = ptx::smem_addr(smem + L::kStageBOff);
  using Stg = TmaStaging<L::kStageCols>;
  constexpr int kChunks = Stg::kBytes / 16;
  constexpr int kHelperThreads = 32 * kDispatchWarps;
  // (thread 0) TMA-stores the staged tile's rows row0.. (both warpgroups' halves): tile A's boxes to columns
  // col_a.., tile B's to col_b.., each box whose first column is below its tile's limit (0: tile B not stored)
  auto store_staged = [&](const CUtensorMap* map, int row0, int col_a, int limit_a, int col_b, int limit_b,
                          int hint_bit) {
    const uint64_t pol = l2_policy_store(p.l2_hints, hint_bit);
#pragma unroll
    for (int w = 0; w < 2; ++w) {
#pragma unroll
      for (int b = 0; b < L::kStageCols / 64; ++b) {
        const uint32_t off = w * Stg::kHalfBytes + b * Stg::kBoxBytes;
        if (col_a + 64 * b < limit_a) ptx::tma_store_2d_hint(map, stg_a + off, col_a + 64 * b, row0 + 64 * w, pol);
        if (col_b + 64 * b < limit_b) ptx::tma_store_2d_hint(map, stg_b + off, col_b + 64 * b, row0 + 64 * w, pol);
      }
    }
    ptx::bulk_commit_group();
  };
  uint32_t phase = 0;
  for (;;) {
    ptx::mbar_wait(ho_full, phase);
    phase ^= 1u;
    if (ptx::ld_shared_handoff(&info->last)) break;
    const int mb = ptx::ld_shared_handoff(&info->mb), row0 = ptx::ld_shared_handoff(&info->row0),
              n0 = ptx::ld_shared_handoff(&info->n0);
    if (mb < 0) {  // an L2 tile: only the stores; the other helpers go on to the next record
      // Thread 0 frees the record with the staging tiles (ho_free): every helper must have read it by then, or a
      // late one would read the consumers' next record in its place (the L1 path's barriers order this already).
      ptx::named_bar_sync(kBarHelpers, kHelperThreads);
      if (htid == 0) {
        store_staged(tmap_o, row0, n0, p.hidden, n0 + L::kStageCols, p.hidden, 2);
        ptx::bulk_wait_group_read<0>();
        ptx::mbar_arrive(ho_free);  // both staging tiles are free for the consumers' next epilogue
      }
      continue;
    }
    if (htid == 0 && p.h != nullptr) {
      store_staged(tmap_h, row0, n0, p.inter, p.inter + n0, 2 * p.inter, 0);  // gate columns, then up columns
      ptx::bulk_wait_group_read<0>();  // s overwrites the gate boxes next
    }
    ptx::named_bar_sync(kBarHelpers, kHelperThreads);
    for (int c = htid; c < kChunks; c += kHelperThreads) {
      uint4 g = ptx::ld_shared_v4(stg_a + 16 * c);
      const uint4 u = ptx::ld_shared_v4(stg_b + 16 * c);
      g.x = swiglu_bf16x2(g.x, u.x, p.clamp);
      g.y = swiglu_bf16x2(g.y, u.y, p.clamp);
      g.z = swiglu_bf16x2(g.z, u.z, p.clamp);
      g.w = swiglu_bf16x2(g.w, u.w, p.clamp);
      ptx::st_shared_v4(stg_a + 16 * c, g);
    }
    ptx::fence_proxy_async_smem();
    ptx::named_bar_sync(kBarHelpers, kHelperThreads);
    if (htid == 0) {
      store_staged(tmap_s_st, row0, n0, p.inter, 0, 0, 1);  // s (tile A only)
      ptx::bulk_wait_group_read<0>();
      ptx::mbar_arrive(ho_free);         // both staging tiles are free for the consumers' next epilogue
      ptx::bulk_wait_group<0>();         // s (and h) are in global memory
      ptx::fence_proxy_async_global();   // async-proxy writes, before the generic release
      ptx::red_release_gpu_add(l1_ctr + mb, 2);
    }
  }
  if (htid == 0) ptx::bulk_wait_group<0>();  // the last L2 tiles' o stores are complete before the CTA exits
}

// The tensor maps of one rank's forward (mega_moe.cu makes them): the dispatched rows, w13, s as L2 reads it, w2,
// h, o, and s as the L1 epilogue stores it (64-row boxes).
struct MegaFwdMaps {
  CUtensorMap xpool, w13, s, w2, h, o, s_st;
};

// One CTA of a rank's forward: the whole kernel but for where its maps and parameters come from. reporter: the CTA
// that reports bad offsets (the rank's first).
template <int kNumStages, int kDispatchSlots, bool kSecondB = false>
__device__ __forceinline__ void mega_moe_fwd_cta(const MegaFwdMaps& maps, const MegaFwdParams& p, bool reporter,
                                                 const MegaFwdSecondB* second = nullptr) {
  const CUtensorMap& tmap_xpool = maps.xpool;
  const CUtensorMap& tmap_w13 = maps.w13;
  const CUtensorMap& tmap_s = maps.s;
  const CUtensorMap& tmap_w2 = maps.w2;
  const CUtensorMap& tmap_h = maps.h;
  const CUtensorMap& tmap_o = maps.o;
  const CUtensorMap& tmap_s_st = maps.s_st;
  using L = MegaFwdLayout<kNumStages, kDispatchSlots>;
  constexpr int kBlockM = L::kBlockM;
  constexpr int kBlockN = L::kBlockN;
  constexpr int kBlockK = L::kBlockK;
  using Mma = ptx::WgmmaBf16<kBlockN, 0, 0>;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + L::kBarOff);
  uint64_t* empty_bar = full_bar + kNumStages;
  int32_t* s_offs = reinterpret_cast<int32_t*>(smem + L::kOffsOff);
  int32_t* s_mb = reinterpret_cast<int32_t*>(smem + L::kMbOff);  // first m-block of each expert

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int num_experts = p.num_experts;
  uint64_t* disp_done = reinterpret_cast<uint64_t*>(smem + L::kDispDoneOff);
  if (tid == 0) {
    ptx::mbar_init(disp_done, kDispatchWarps);
    ptx::mbar_init(reinterpret_cast<uint64_t*>(smem + L::kHoFullOff), 2);
    ptx::mbar_init(reinterpret_cast<uint64_t*>(smem + L::kHoFreeOff), 1);
    ptx::fence_mbar_init();  // published to the CTA by the prologue's __syncthreads
  }
  if (!mega_fwd_prologue<kNumStages, kBlockM>(p, full_bar, empty_bar, kNumConsumerThreads / 32, s_offs, s_mb, reporter,
                                              &tmap_xpool, &tmap_w13, &tmap_s, &tmap_w2, &tmap_o,
                                              [&] { return p.h != nullptr ? &tmap_h : nullptr; }))
    return;
  using Seq = MegaTileSequence<kBlockM, kBlockN, kBlockK>;
  // Each role builds its own Seq after its setmaxnreg: values live across the register reallocation were spilled.

  if (warp < 4) {
    ptx::setmaxnreg_dec<kMegaProducerRegs>();
    if (warp == 0 && lane == 0) {
      const Seq seq(p, s_offs, s_mb);
      // an L2 tile waits for both consumer warpgroups of each of its m-block's L1 tiles
      mega_tma_producer<L, kNumStages, kSecondB>(p, seq, 2 * seq.n1, smem, full_bar, empty_bar, &tmap_xpool,
                                                 &tmap_w13, &tmap_s, &tmap_w2, second);
    } else if (warp >= 1) {
      mega_dispatch_role<kBlockM, kDispatchSlots>(p, ptx::smem_addr(smem + L::kDispOff), warp - 1, lane, s_offs, s_mb,
                                                  num_experts);
      // the slots' last reads fed this warp's stores, which have issued: the slots are free (release, CTA scope)
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(disp_done);
      if (p.handoff)
        mega_handoff_helper<L>(p, p.counters + p.max_m_blocks, smem, tid - 32, &tmap_h, &tmap_s_st, &tmap_o);
    }
  } else {
    // ================= consumer warpgroups =================
    ptx::setmaxnreg_inc<kMegaConsumerRegs>();
    const Seq seq(p, s_offs, s_mb);
    const int wg = (warp >> 2) - 1;
    const int wg_tid = tid - 128 * (wg + 1);
    const uint32_t a_base = ptx::smem_addr(smem + L::kAOff) + wg * (64 * 128);
    const uint32_t b_base = ptx::smem_addr(smem + L::kBOff);
    const uint64_t desc_a0 = ptx::make_desc_sw128(a_base, 0, 1024);
    const uint64_t desc_b0 = ptx::make_desc_sw128(b_base, 0, 1024);
    const uint32_t a_lo0 = static_cast<uint32_t>(desc_a0), a_hi = static_cast<uint32_t>(desc_a0 >> 32);
    const uint32_t b_lo0 = static_cast<uint32_t>(desc_b0), b_hi = static_cast<uint32_t>(desc_b0 >> 32);
    constexpr int kStageCols = L::kStageCols;
    const uint32_t stg_half = ptx::smem_addr(smem + L::kCOff) + wg * TmaStaging<kStageCols>::kHalfBytes;
    constexpr uint32_t kToStageB = L::kStageBOff - L::kCOff;  // stg_half + this: the second staging tile
    // bit 0: this CTA's dispatch is done, the second staging tile may be used; bit 1: the latest committed
    // bulk group read the second staging tile; bit 2: the hand-off's phase (tiles handed off, mod 2) (one
    // register: the consumers have none to spare)
    uint32_t stage_b_state = 0;
    uint64_t* ho_full = reinterpret_cast<uint64_t*>(smem + L::kHoFullOff);
    uint64_t* ho_free = reinterpret_cast<uint64_t*>(smem + L::kHoFreeOff);
    MegaHandoff* ho_info = reinterpret_cast<MegaHandoff*>(smem + L::kHoInfoOff);
    // waits until the helpers have handed back the staging tiles of the latest hand-off (at once if none)
    auto wait_handoff_free = [&] { ptx::mbar_wait(ho_free, ((stage_b_state >> 2) & 1u) ^ 1u); };

    float acc[kBlockN / 2];
    int stage = 0;
    uint32_t phase = 0;
    int e = 0;
    bool in_l2 = false;
    // An L1 tile's s leaves by TMA store; its L1-counter arrival (the L2 tiles' go) must wait until that store
    // has landed, which takes a few microseconds. Rather than hold the tensor cores for it, thread 0 of the
    // warpgroup arrives once the next tile's first MMAs are queued, or before that tile's first wait if its
    // stage is not ready yet (the stage may be waiting for this very arrival: an L2 tile of the same m-block).
    int pending_mb = -1;  // meaningful in wg_tid 0 only
    auto arrive_pending = [&] {
      if (wg_tid == 0 && pending_mb >= 0) {
        ptx::bulk_wait_group<0>();         // this thread's TMA stores (s, h) are complete
        ptx::fence_proxy_async_global();   // async-proxy writes, before the generic release
        ptx::red_release_gpu_add(seq.l1_ctr + pending_mb, 1);
        pending_mb = -1;
      }
    };
    struct PendingArrival {
      decltype(arrive_pending)& arrive;
      int wg_tid;
      int pending_mb;
      __device__ __forceinline__ void before_first_wait(uint64_t* bar, uint32_t parity) const {
        if (wg_tid == 0 && pending_mb >= 0 && !ptx::mbar_test_wait(bar, parity)) arrive();
      }
      __device__ __forceinline__ void after_first_issue() const { arrive(); }
      __device__ __forceinline__ void on_stage(int, int) const {}
    };
    const volatile int32_t* stage_task = reinterpret_cast<const volatile int32_t*>(smem + L::kTaskOff);
    for (;;) {
      // The next task, as this CTA's producer claimed it (with the tile's first stage). The pending arrival goes
      // first if that stage is not ready: the producer may be waiting for it.
      if (wg_tid == 0 && pending_mb >= 0 && !ptx::mbar_test_wait(&full_bar[stage], phase)) arrive_pending();
      ptx::mbar_wait(&full_bar[stage], phase);
      // read by the lane that later releases the stage (release below), so that the read is ordered before the
      // producer's next write of this slot by that lane's own program order
      const int u = __shfl_sync(0xffffffffu, lane == 0 ? stage_task[stage] : 0, 0);
      if (u < 0) break;
      const auto t = seq.locate(u, e, in_l2);
      const int kbs = t.l1 ? seq.kb1 : seq.kb2;
      const int hrow0 = t.row0 + 64 * wg;
      const bool active = hrow0 < t.row_end;
      const bool full_half = hrow0 + 64 <= t.row_end;  // all 64 rows inside the expert: TMA stores
      auto release = [&](int s_) {
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(&empty_bar[s_]);
      };
      consumer_tile_mainloop<Mma, kNumStages, kBlockK, L::kABytes, L::kBBytes, 32, false>(
          acc, active, kbs, full_bar, stage, phase, a_lo0, a_hi, b_lo0, b_hi, release,
          PendingArrival{arrive_pending, wg_tid, pending_mb});

      // Epilogue through half-width staging tiles: one pass writes accumulator boxes [box0, box0 + kStageCols
      // / 64) of this warpgroup's 64 rows to a staging tile, then TMA-stores them (full halves) or copies them
      // out (halves crossing the expert's end). Every pass commits one bulk group (empty for a copy) and first
      // waits until the tile it writes has been read. Until this CTA's dispatch is done, every pass uses the
      // first tile and waits for the latest group; after, passes alternate between the two tiles and wait
      // for all but the latest group (which read the other tile).
      // out/ld: destination; c0: its first column; limit: columns >= it are not written; map: its tensor map.
      if (!(stage_b_state & 1u)) {
        // uniform over both consumer warpgroups (a hand-off needs both): every thread saw the dispatch done (an
        // L2 tile waits for it: it is done long before any L2 tile can start, and the dispatch waits for nothing)
        const bool done = t.l1 ? ptx::named_bar_sync_and(kBarConsumers, kNumConsumerThreads,
                                                         ptx::mbar_test_wait(disp_done, 0))
                               : (ptx::mbar_wait(disp_done, 0), true);
        if (done) stage_b_state = 1u;  // the latest group read the first tile
      }
      // L2 rows pushed to their source ranks' combine slots (MegaFwdParams::o_slots; the host turns the L2 hand-off
      // off then)
      const bool push = !t.l1 && p.o_slots[0] != nullptr;
      auto staged_pass = [&](int box0, __nv_bfloat16* out, int64_t ld, int c0, int limit, const CUtensorMap* map,
                             auto pack, int hint_bit) {
        const bool alternate = (stage_b_state & 1u) != 0;
        const bool use_b = alternate && !(stage_b_state & 2u);
        const uint32_t stg = stg_half + (use_b ? kToStageB : 0u);
        if (alternate && p.handoff) wait_handoff_free();
        if (wg_tid == 0) {
          if (alternate) ptx::bulk_wait_group_read<1>(); else ptx::bulk_wait_group_read<0>();
        }
        ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
        write_acc_boxes_to_staging<kBlockN, kStageCols / 64>(acc, stg, wg_tid, box0, pack);
        ptx::fence_proxy_async_smem();
        ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
        if (push) {
          copy_swizzled_half_to_routes<kStageCols>(stg, wg_tid, min(t.row_end - hrow0, 64), p.pool_src_route,
                                                   p.pool_src_rank, p.num_tokens * p.top_k, p.o_slots, p.num_ranks,
                                                   p.ld_slots, hrow0, c0, limit);
        } else if (full_half) {
          if (wg_tid == 0) {
            const uint64_t pol = l2_policy_store(p.l2_hints, hint_bit);
#pragma unroll
            for (int b = 0; b < kStageCols / 64; ++b)
              if (c0 + 64 * b < limit)
                ptx::tma_store_2d_hint(map, stg + b * TmaStaging<kStageCols>::kBoxBytes, c0 + 64 * b, hrow0, pol);
          }
        } else {
          copy_swizzled_half_to_global<kStageCols>(stg, wg_tid, t.row_end - hrow0, out, ld, hrow0, c0, limit);
        }
        if (wg_tid == 0) ptx::bulk_commit_group();
        stage_b_state = (stage_b_state & 5u) | (use_b ? 2u : 0u);
      };
      constexpr int kPassBoxes = kStageCols / 64;
      if ((p.handoff & (t.l1 ? 1 : 2)) && (stage_b_state & 1u) && t.row0 + 2 * 64 <= t.row_end) {
        // hand-off: gate boxes (L2: o columns 0..127) to this warpgroup's half of tile A, up boxes (o columns
        // 128..255) to its half of tile B
        if (wg_tid == 0) ptx::bulk_wait_group_read<0>();  // this warpgroup's own stores have read both tiles
        wait_handoff_free();
        ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
        if (t.l1 && p.clamp > 0.f) {
          write_acc_boxes_to_staging<kBlockN, kPassBoxes>(
              acc, stg_half, wg_tid, 0, PackBf16x2ClampMasks{p.clamp, p.clamp_below, p.clamp_above, false});
          write_acc_boxes_to_staging<kBlockN, kPassBoxes>(
              acc, stg_half + kToStageB, wg_tid, kPassBoxes,
              PackBf16x2ClampMasks{p.clamp, p.clamp_below, p.clamp_above, true});
        } else {
          write_acc_boxes_to_staging<kBlockN, kPassBoxes>(acc, stg_half, wg_tid, 0, PackBf16x2{});
          write_acc_boxes_to_staging<kBlockN, kPassBoxes>(acc, stg_half + kToStageB, wg_tid, kPassBoxes, PackBf16x2{});
        }
        ptx::fence_proxy_async_smem();  // the helper's TMA stores read these
        ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
        if (wg_tid == 0) {
          if (wg == 0) {
            ptx::st_shared_handoff(&ho_info->mb, t.l1 ? t.mb : -1);
            ptx::st_shared_handoff(&ho_info->row0, t.row0);
            ptx::st_shared_handoff(&ho_info->n0, t.n0);
            ptx::st_shared_handoff(&ho_info->last, 0);
          }
          ptx::mbar_arrive(ho_full);
        }
        stage_b_state ^= 4u;
      } else if (t.l1) {
        if (active) {
          // h as saved (F6 rounding with a clamp), in place: the h passes pack it exactly, and s is computed
          // from it (reference F3)
          if (p.clamp > 0.f)
            round_acc_as_saved_h<kBlockN>(acc, RoundHMasks{p.clamp, p.clamp_below, p.clamp_above});
          else
            round_acc_as_saved_h<kBlockN>(acc, RoundHPlain{});
          if (p.h != nullptr) {
            // gate columns n0.. of h, then the matching up columns I + n0..
            staged_pass(0, p.h, 2 * p.inter, t.n0, p.inter, &tmap_h, PackBf16x2Exact{}, 0);
            staged_pass(kPassBoxes, p.h, 2 * p.inter, p.inter + t.n0, 2 * p.inter, &tmap_h, PackBf16x2Exact{}, 0);
          }
          swiglu_in_place<kBlockN>(acc, p.clamp);
          staged_pass(0, p.s, p.inter, t.n0, p.inter, &tmap_s_st, PackBf16x2{}, 1);
        }
        if (full_half) {
          pending_mb = t.mb;  // arrives after the next tile's first MMAs (arrive_pending)
        } else {
          // generic stores (or none): s is read by TMA (async proxy) in whichever CTA runs the L2 tiles
          if (active) ptx::fence_proxy_async_global();
          ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
          if (wg_tid == 0) ptx::red_release_gpu_add(seq.l1_ctr + t.mb, 1);
        }
      } else if (active) {
        staged_pass(0, p.o, p.hidden, t.n0, p.hidden, &tmap_o, PackBf16x2{}, 2);
        staged_pass(kPassBoxes, p.o, p.hidden, t.n0 + kStageCols, p.hidden, &tmap_o, PackBf16x2{}, 2);
      }
    }
    arrive_pending();
    if (wg_tid == 0) ptx::bulk_wait_group<0>();
    if (p.handoff) {  // the helpers' last record
      wait_handoff_free();
      if (wg_tid == 0) {
        if (wg == 0) ptx::st_shared_handoff(&ho_info->last, 1);
        ptx::mbar_arrive(ho_full);
      }
    }
  }
}

template <int kNumStages, int kDispatchSlots>
__global__ void __launch_bounds__(kNumThreads, 1)
    mega_moe_fwd_kernel(const __grid_constant__ MegaFwdMaps maps, const __grid_constant__ MegaFwdParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  mega_moe_fwd_cta<kNumStages, kDispatchSlots>(maps, p, blockIdx.x == 0);
#endif
}

// The one-rank forward with shared experts as its last groups (MegaFwdSecondB): the same kernel but for where B's
// tiles of those groups come from.
template <int kNumStages, int kDispatchSlots>
__global__ void __launch_bounds__(kNumThreads, 1)
    mega_moe_fwd_second_b_kernel(const __grid_constant__ MegaFwdMaps maps, const __grid_constant__ MegaFwdParams p,
                                 const __grid_constant__ MegaFwdSecondB second) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  mega_moe_fwd_cta<kNumStages, kDispatchSlots, true>(maps, p, blockIdx.x == 0, &second);
#endif
}

// The forwards of several ranks in one launch (the one-GPU emulation of expert parallelism: each virtual rank's
// buffers are its own, its peers' rows are read and its L2 rows pushed through the pointer tables of its
// parameters). CTAs [r * ctas_per_rank, (r + 1) * ctas_per_rank) run rank r's forward. A rank's forward waits
// only for its own CTAs' work (the argument above, per rank): no CTA waits for another rank's, so the launch
// completes with any subset of its CTAs running, as one rank's does.
struct MegaFwdRanksLaunch {
  MegaFwdMaps maps[kMegaMaxRanks];
  MegaFwdParams p[kMegaMaxRanks];
  int32_t num_ranks;
  int32_t ctas_per_rank;
};

template <int kNumStages, int kDispatchSlots>
__global__ void __launch_bounds__(kNumThreads, 1)
    mega_moe_fwd_ranks_kernel(const __grid_constant__ MegaFwdRanksLaunch l) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  const int r = static_cast<int>(blockIdx.x) / l.ctas_per_rank;
  if (r < l.num_ranks)
    mega_moe_fwd_cta<kNumStages, kDispatchSlots>(l.maps[r], l.p[r],
                                                 static_cast<int>(blockIdx.x) % l.ctas_per_rank == 0);
#endif
}

}  // namespace sm90
}  // namespace prime_kernels
