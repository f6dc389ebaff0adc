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

#include "common/device_check.hpp"
#include "common/watchdog.cuh"
#include "dispatch_rows.cuh"
#include "epilogue.cuh"
#include "kernel_common.cuh"
#include "mainloop.cuh"
#include "pipeline.cuh"
#include "swiglu_math.cuh"

namespace prime_kernels {
namespace sm90 {

constexpr int kMegaMaxRanks = 8;
constexpr int kMegaMaxExperts = 512;
constexpr int kDispatchSlotBytes = 4096;
constexpr uint32_t kMegaProducerRegs = kDispatchProducerRegs;
constexpr uint32_t kMegaConsumerRegs = kDispatchConsumerRegs;

struct MegaFwdParams {
  // Source token rows: rank r's x [*, hidden] bf16 (row stride ld_x elements) at x_ranks[r].
  const __nv_bfloat16* x_ranks[kMegaMaxRanks];
  int32_t num_ranks;
  int64_t ld_x;
  // Routing plan (pool order): token * top_k + k and source rank per pool row.
  const int32_t* pool_src_route;
  const int32_t* pool_src_rank;  // may be null (every row from rank 0)
  int32_t top_k;
  const int32_t* expert_offsets;  // [num_experts + 1]
  int32_t num_experts;
  int32_t m_total;  // pool rows allocated (x_pool, s, h, o have this many rows)
  int32_t hidden;
  int32_t inter;
  __nv_bfloat16* x_pool;  // [m_total, hidden]
  __nv_bfloat16* s;       // [m_total, inter]
  __nv_bfloat16* h;       // [m_total, 2 * inter] or null
  __nv_bfloat16* o;       // [m_total, hidden]: L2 output per pool row (may alias x_pool, see mega_moe.hpp)
  // Expert parallelism over peer memory: when o_slots[0] is set, o is not written; each L2 row goes to its source
  // rank's combine slots instead, o_slots[pool_src_rank[m]] + pool_src_route[m] * ld_slots (generic 16-byte stores
  // from the staging tile: the rows of a tile go to scattered routes, maybe on several GPUs). Padding rows go nowhere.
  __nv_bfloat16* o_slots[kMegaMaxRanks];
  int64_t ld_slots;
  float clamp;
  float clamp_below;  // the largest bf16 value < clamp and the smallest > clamp (F6 rounding of the saved h)
  float clamp_above;
  // Counters, zero before the launch: [max_m_blocks] dispatch, [max_m_blocks] L1, then kMegaFwdNumClaims claim
  // counters (MegaFwdClaim).
  int32_t* counters;
  int32_t max_m_blocks;  // length of each counter array (>= the plan's m-blocks)
  // The plan's pool row per route, [num_tokens * top_k] (< 0: none), or null. Read by the token-major part of
  // the dispatch (disp_split_row).
  const int32_t* route_to_pool;
  int32_t num_tokens;  // rows of x (every rank's x has at least this many); pool_src_route < num_tokens * top_k
  // Epilogue hand-offs to the dispatch warps once this CTA's dispatch is done (mega_moe_heuristics.hpp): bit 0: the L1
  // epilogue of a whole 128-row tile hands the bf16 gate | up tile over, and they compute s and issue the h and s
  // stores; bit 1: an L2 tile of 128 rows hands its bf16 o tile over, and they issue the o stores.
  int32_t handoff;
  // Token-major dispatch of the pool rows >= disp_split_row through route_to_pool (mega_dispatch_tokens); the
  // host sets it past the pool (every row in pool order) when route_to_pool is null or the rows come from several
  // ranks.
  int32_t disp_split_row;
  // L2 cache hints (mega_moe_heuristics.hpp): bit 0, 1, 2: the h, s, o stores evict_first; bit 3: the w13 / w2 loads
  // evict_last. A clear bit: no hint.
  int32_t l2_hints;
  // The bound on every wait for another CTA's work (common/watchdog.cuh).
  WaitGuard wait_guard;
  // Where the kernel notes invalid plan values (common/device_check.hpp; may be null): expert_offsets that are not
  // a plan (offsets[0] != 0, decreasing, or past m_total: the kernel then writes nothing), and pool rows naming a
  // route >= num_tokens * top_k (dispatched as zeros).
  common::DeviceCheckRecord* check;
};
// The claim counters after the dispatch and L1 counters (see the file comment): tasks, pool-order dispatch runs,
// virtual warps of the token-major dispatch, 32-row blocks of its second pass.
enum MegaFwdClaim : int { kClaimTask = 0, kClaimDispatchRun = 1, kClaimTokenWarp = 2, kClaimOrphanRows = 3 };
constexpr int kMegaFwdNumClaims = 4;

template <int kNumStages, int kDispatchSlots>
struct MegaFwdLayout : StageRingLayout<128, 256, 64, kNumStages> {
  using Ring = StageRingLayout<128, 256, 64, kNumStages>;
  static constexpr int kCOff = Ring::kRingEnd;
  static constexpr int kStageCols = 128;  // epilogue staging: half the tile's columns per pass
  // The dispatch slots: once this CTA's dispatch warps are done, the epilogues use them as a second staging
  // tile (kStageBOff), so that consecutive passes need not wait for each other's TMA store.
  static constexpr int kDispOff = kCOff + TmaStaging<kStageCols>::kBytes;
  static constexpr int kStageBOff = kDispOff;
  static constexpr int kBarOff = kDispOff + kDispatchSlots * kDispatchSlotBytes;
  static constexpr int kDispDoneOff = kBarOff + 2 * kNumStages * 8;  // mbarrier: the dispatch warps are done
  // L1 epilogue hand-off (MegaFwdParams::handoff): mbarriers "tile staged" (one arrival per consumer warpgroup)
  // and "staging free again" (one arrival by the helper), and the staged tile's MegaHandoff record.
  static constexpr int kHoFullOff = kDispDoneOff + 8;
  static constexpr int kHoFreeOff = kHoFullOff + 8;
  static constexpr int kHoInfoOff = kHoFreeOff + 8;
  // The task index of each stage's tile (written by the producer with the tile's first stage; -1: no more tasks).
  static constexpr int kTaskOff = kHoInfoOff + 16;
  static constexpr int kOffsOff = kTaskOff + 4 * kNumStages;
  static constexpr int kMbOff = kOffsOff + (kMegaMaxExperts + 1) * 4;
  static constexpr int kEnd = kMbOff + (kMegaMaxExperts + 1) * 4;
  static constexpr int kSmemBytes = kEnd + 1024;
  static_assert(kOffsOff % 4 == 0, "int32 offsets");
  static_assert(kSmemBytes <= Ring::kSmemLimit, "shared memory budget exceeded");
  static_assert(kDispatchSlots * kDispatchSlotBytes >= TmaStaging<kStageCols>::kBytes, "second staging tile");
  static_assert(kDispOff % 1024 == 0, "a 128B-swizzled staging tile is 1024-byte aligned");
};

// The token-major part of the dispatch (MegaFwdParams::disp_split_row): pool rows [split_row, num_rows) are
// written by walking the tokens: each x row is read once and stored to every row of its routes in that range,
// where walking the pool rows reads it once per route (x is larger than L2 at the layer shapes, so most of those
// reads went to HBM). A route's row r counts only if pool_src_route[r] names that route back; the rows that fail
// this (in a plan's pool: only a padded plan's padding rows, route -1) are written afterwards from pool_src_route
// as the pool-order dispatch would (zeros for route -1), so every row in the range is written and counted exactly
// once whatever the inputs. The second pass claims 32 rows at a time (claims[kClaimOrphanRows]).
// Single rank only (the host sets disp_split_row past the pool otherwise). Counters gain one per (row, piece).
template <int kBlockM, int kSlotsPerWarp, int kSlotBytes>
__device__ __forceinline__ void mega_dispatch_tokens(const MegaFwdParams& p, uint32_t slots_addr, int dwarp, int lane,
                                                     const int32_t* s_offs, const int32_t* s_mb, int num_experts,
                                                     int32_t* disp_ctr, int32_t* claims, int split_row, int num_rows) {
  const int top_k = p.top_k;
  const int num_tokens = p.num_tokens;
  const int row_bytes = p.hidden * 2;
  const int chunks = dispatch_pieces_per_row<kSlotBytes>(row_bytes);
  uint8_t* dst = reinterpret_cast<uint8_t*>(p.x_pool);
  const uint8_t* x = reinterpret_cast<const uint8_t*>(p.x_ranks[0]);
  const int64_t x_row_bytes = p.ld_x * 2;
  const uint32_t slot0 = slots_addr + dwarp * kSlotsPerWarp * kSlotBytes;
  auto mblock_of = [&](int row) {
    const int e = pool_row_group(row, s_offs, num_experts);
    return s_mb[e] + (row - s_offs[e]) / kBlockM;
  };
  // the route's row of this lane (lanes < top_k) for token t, if it is in range and names the route back
  auto my_row = [&](int t) {
    if (lane >= top_k) return -1;
    const int route = t * top_k + lane;
    const int r = __ldg(p.route_to_pool + route);
    return (r >= split_row && r < num_rows && __ldg(p.pool_src_route + r) == route) ? r : -1;
  };
  // The tokens are dealt to kDispatchWarps * gridDim.x virtual warps, virtual warp v taking tokens v, v + step, ...
  // (so that, with every CTA running, the warps sweep the tokens in order and the m-blocks of the range fill from
  // their first rows). The virtual warps are claimed (claims[kClaimTokenWarp]) until none is left: a warp whose
  // CTA never runs holds none.
  const int step = (int)gridDim.x * kDispatchWarps;
  for (int v = warp_claim(claims + kClaimTokenWarp, lane); v < step; v = warp_claim(claims + kClaimTokenWarp, lane)) {
    // this virtual warp's tokens t = v + j * step; items i = j * chunks + c
    const int my_tokens = num_tokens > v ? (num_tokens - v + step - 1) / step : 0;
    const int items = my_tokens * chunks;
    auto issue = [&](int i) {  // every lane; one commit per item, empty past the end
      if (i < items) {
        const int j = i / chunks, c = i - j * chunks;
        const uint8_t* src = x + static_cast<int64_t>(v + j * step) * x_row_bytes + c * kSlotBytes;
        dispatch_load_piece<kSlotBytes>(slot0 + (i % kSlotsPerWarp) * kSlotBytes, src, src,
                                        min(kSlotBytes, row_bytes - c * kSlotBytes), lane);
      }
      ptx::cp_async_commit();
    };
    for (int i = 0; i < kSlotsPerWarp - 1; ++i) issue(i);
    int row = -1, row_mb = -1;
    for (int i = 0; i < items; ++i) {
      issue(i + kSlotsPerWarp - 1);
      const int j = i / chunks, c = i - j * chunks;
      if (c == 0) {
        row = my_row(v + j * step);
        row_mb = row >= 0 ? mblock_of(row) : -1;
      }
      ptx::cp_async_wait<kSlotsPerWarp - 1>();  // this lane's parts of item i have landed (it stores only those)
      const int bytes = min(kSlotBytes, row_bytes - c * kSlotBytes);
      const uint32_t slot = slot0 + (i % kSlotsPerWarp) * kSlotBytes;
      for (uint32_t dests = __ballot_sync(0xffffffffu, row >= 0); dests != 0; dests &= dests - 1) {
        const int r = __shfl_sync(0xffffffffu, row, __ffs(dests) - 1);
        dispatch_store_piece<kSlotBytes>(dst + static_cast<int64_t>(r) * row_bytes + c * kSlotBytes, slot, bytes,
                                         lane);
      }
      ptx::fence_proxy_async_global();
      __syncwarp();
      if (row >= 0) ptx::red_release_gpu_add(disp_ctr + row_mb, 1);
    }
    ptx::cp_async_wait<0>();
  }
  ptx::cp_async_wait<0>();
  // Rows of the range that no route named back: copied from their pool_src_route (token row of route / top_k;
  // a negative route, a plan's padding row, is a row of zeros, as in the pool-order dispatch), lane per row, 16
  // bytes at a time.
  for (int base = split_row + 32 * warp_claim(claims + kClaimOrphanRows, lane); base < num_rows;
       base = split_row + 32 * warp_claim(claims + kClaimOrphanRows, lane)) {
    const int r = base + lane;
    bool orphan = false;
    int route = 0;
    if (r < num_rows) {
      route = __ldg(p.pool_src_route + r);
      orphan = !(route >= 0 && route < num_tokens * top_k && __ldg(p.route_to_pool + route) == r);
    }
    for (uint32_t rows = __ballot_sync(0xffffffffu, orphan); rows != 0; rows &= rows - 1) {
      const int src_lane = __ffs(rows) - 1;
      const int orow = __shfl_sync(0xffffffffu, r, src_lane);
      const int oroute = __shfl_sync(0xffffffffu, route, src_lane);
      // a route past the tokens is not one of theirs: zeros, and the host is told
      const bool valid = oroute >= 0 && oroute < num_tokens * top_k;
      if (oroute >= num_tokens * top_k && lane == 0)
        common::report_device_check(p.check, common::kCheckMegaFwdRoute, oroute, num_tokens * top_k);
      const uint8_t* src = x + static_cast<int64_t>(valid ? oroute / top_k : 0) * x_row_bytes;
      uint8_t* out = dst + static_cast<int64_t>(orow) * row_bytes;
      for (int off = lane * 16; off < row_bytes; off += 32 * 16)
        ptx::st_global_v4(out + off, valid ? __ldg(reinterpret_cast<const uint4*>(src + off)) : make_uint4(0, 0, 0, 0));
    }
    ptx::fence_proxy_async_global();
    __syncwarp();
    if (orphan) ptx::red_release_gpu_add(disp_ctr + mblock_of(r), chunks);
  }
}

// The dispatch role of the forward kernel (producer warps 1-3 of every CTA; dwarp = 0..2): copies the pool's
// x rows (token route / top_k of its source rank's x; zeros for a route < 0, a padded plan's padding rows, so
// that their h, s and o rows are zeros too) into x_pool and releases the per-m-block dispatch counters: rows
// below disp_split_row in pool order (the first tiles' rows land first), the rest token by token.
template <int kBlockM, int kDispatchSlots>
__device__ __forceinline__ void mega_dispatch_role(const MegaFwdParams& p, uint32_t slots_addr, int dwarp, int lane,
                                                   const int32_t* s_offs, const int32_t* s_mb, int num_experts) {
  auto src_of = [&](int row) -> const __nv_bfloat16* {
    const int route = __ldg(p.pool_src_route + row);
    if (route < 0) return nullptr;  // a row of zeros
    if (route >= p.num_tokens * p.top_k) {  // not a route of these tokens: zeros, and the host is told
      common::note_device_check(p.check, common::kCheckMegaFwdRoute);
      return nullptr;
    }
    const int rank = p.pool_src_rank != nullptr ? min(max(__ldg(p.pool_src_rank + row), 0), p.num_ranks - 1) : 0;
    return p.x_ranks[rank] + static_cast<int64_t>(route / p.top_k) * p.ld_x;
  };
  int32_t* disp_ctr = p.counters;
  int32_t* claims = p.counters + 2 * p.max_m_blocks;
  const int num_rows = s_offs[num_experts];
  const int split_row = min(max(p.disp_split_row, 0), num_rows);
  dispatch_rows_role<kBlockM, kDispatchSlots / kDispatchWarps, kDispatchSlotBytes>(
      src_of, reinterpret_cast<uint8_t*>(p.x_pool), p.hidden * 2, slots_addr, dwarp, lane, s_offs, s_mb, num_experts,
      disp_ctr, claims + kClaimDispatchRun, split_row);
  if (split_row < num_rows)
    mega_dispatch_tokens<kBlockM, kDispatchSlots / kDispatchWarps, kDispatchSlotBytes>(
        p, slots_addr, dwarp, lane, s_offs, s_mb, num_experts, disp_ctr, claims, split_row, num_rows);
}

// The forward's task sequence (see the file comment), shared by all roles of the kernel: all L1 tiles (kBlockN / 2
// s columns each), then all L2 tiles (kBlockN o columns each); within an expert the grouped GEMM's order
// (band_tile: n-block major, m-block fastest within bands of kMBand m-blocks), so the CTAs of one wave share B
// panels (m-block major / n fastest measured the same within noise at both layer shapes).
template <int kBlockM, int kBlockN, int kBlockK>
struct MegaTileSequence {
  static constexpr int kL1Cols = kBlockN / 2;  // s columns per L1 n-block
  struct Tile {
    bool l1;
    int mb;     // global m-block
    int e;      // expert
    int row0;   // first pool row
    int row_end;
    int n0;     // first output column (s columns for L1, o columns for L2)
  };
  const int32_t* s_offs;  // shared: pool row offsets per expert, clamped to [0, m_total]
  const int32_t* s_mb;    // shared: first m-block of each expert
  int n1, n2;             // L1 / L2 n-blocks per m-block
  int kb1, kb2;           // L1 / L2 k-blocks per tile
  int num_l1, num_tasks;
  int32_t* disp_ctr;      // per m-block: dispatched 4 KB pieces
  int32_t* l1_ctr;        // per m-block: finished L1 tile arrivals
  int32_t* task_claim;    // the next unclaimed task

  template <typename P>  // MegaFwdParams or MegaFwdFp8Params (the fields named below)
  __device__ __forceinline__ MegaTileSequence(const P& p, const int32_t* offs, const int32_t* mb)
      : s_offs(offs), s_mb(mb) {
    n1 = ceil_div(p.inter, kL1Cols);
    n2 = ceil_div(p.hidden, kBlockN);
    kb1 = ceil_div(p.hidden, kBlockK);
    kb2 = ceil_div(p.inter, kBlockK);
    // The plan's m-blocks beyond the counters' length cannot be signalled: the host sizes the counters from
    // the pool capacity (ceil(m_total / 128) + num_experts bounds every plan), so this only guards misuse.
    const int num_mb = min(s_mb[p.num_experts], p.max_m_blocks);
    num_l1 = num_mb * n1;
    num_tasks = num_l1 + num_mb * n2;
    disp_ctr = p.counters;
    l1_ctr = p.counters + p.max_m_blocks;
    task_claim = p.counters + 2 * p.max_m_blocks + kClaimTask;
  }
  // Each role sees its CTA's tasks in increasing order; the expert cursor e restarts at the L1 -> L2 switch.
  __device__ __forceinline__ Tile locate(int u, int& e, bool& in_l2) const {
    Tile t;
    t.l1 = u < num_l1;
    int local = u, n = n1;
    if (!t.l1) {
      if (!in_l2) {
        in_l2 = true;
        e = 0;
      }
      local = u - num_l1;
      n = n2;
    }
    while (s_mb[e + 1] * n <= local) ++e;
    int nb, mb_in_e;
    band_tile(local - s_mb[e] * n, s_mb[e + 1] - s_mb[e], n, nb, mb_in_e);
    t.mb = s_mb[e] + mb_in_e;
    t.e = e;
    t.row0 = s_offs[e] + (t.mb - s_mb[e]) * kBlockM;
    t.row_end = max(s_offs[e + 1], s_offs[e]);
    t.n0 = nb * (t.l1 ? kL1Cols : kBlockN);
    return t;
  }
  __device__ __forceinline__ static int rows(const Tile& t) { return min(t.row_end - t.row0, kBlockM); }
};

// Start of the kernel: stage barriers (empty_arrivals consumer warps release a stage), the tensor maps prefetched,
// the experts' pool offsets and first m-blocks in shared memory (ends with __syncthreads). False, in every thread
// of every CTA alike, when expert_offsets is not a plan (offsets[0] != 0, decreasing, or past m_total): the
// dispatch would count rows to the wrong m-blocks and the tiles would wait for counts that never come, so the
// kernel then writes nothing and flags it (MegaFwdParams::bad_offsets).
// P: MegaFwdParams or MegaFwdFp8Params (expert_offsets, num_experts, m_total, check); reporter: the one CTA of the
// launch (of its rank, in a launch over several ranks) that reports bad offsets; maps: the kernel's tensor maps for
// kernel_prologue to prefetch.
template <int kNumStages, int kBlockM, typename P, typename... TensorMaps>
__device__ __forceinline__ bool mega_fwd_prologue(const P& p, uint64_t* full_bar, uint64_t* empty_bar,
                                                  uint32_t empty_arrivals, int32_t* s_offs, int32_t* s_mb,
                                                  bool reporter, const TensorMaps&... maps) {
  const int tid = threadIdx.x;
  kernel_prologue<kNumStages>(full_bar, empty_bar, 1, empty_arrivals, maps...);
  bool bad = false;
  int32_t bad_value = 0;
  for (int i = tid; i <= p.num_experts; i += kNumThreads) {
    const int32_t v = __ldg(p.expert_offsets + i);
    if (i == 0 ? v != 0 : (v < __ldg(p.expert_offsets + i - 1) || v > p.m_total)) {
      bad = true;
      bad_value = v;
    }
  }
  if (__syncthreads_or(bad)) {
    if (bad && reporter) common::report_device_check(p.check, common::kCheckMegaFwdOffsets, bad_value, p.m_total);
    return false;
  }
  load_group_offsets_and_mblocks<kBlockM>(p.expert_offsets, p.num_experts, p.m_total, s_offs, s_mb);
  return true;
}

// Shared experts as extra groups of a one-rank forward (mega_moe_fwd_second_b_kernel): groups [num_b_groups,
// num_experts) read B from the shared experts' weights, w13b [slabs, 2 * chunks * I, H] (gate rows, then up rows)
// and w2b [slabs, H, chunks * I], chunk by chunk: group num_b_groups + v is chunk v % chunks of shared expert
// v / chunks (a SwiGLU expert of width m * I is m experts of width I). Boxes as w13's and w2's.
struct MegaFwdSecondB {
  CUtensorMap w13b, w2b;
  int32_t num_b_groups;
  int32_t chunks;
};

// The TMA producer (warp 0, lane 0): claims tasks in sequence order until none is left, through one stage ring.
// An L1 tile first waits until its m-block is dispatched, an L2 tile until its m-block's L1 counter reaches
// l2_ready (every s column of its rows written); then the A rows (x_pool or s) and B (gate and up rows of w13, or
// w2) stream in kBlockK steps. The task index goes to the consumers with the tile's first stage; after the last
// task, a stage with task -1 and no loads ends them.
template <typename L, int kNumStages, bool kSecondB, typename Seq>
__device__ __forceinline__ void mega_tma_producer(const MegaFwdParams& p, const Seq& seq, int l2_ready, uint8_t* smem,
                                                  uint64_t* full_bar, uint64_t* empty_bar,
                                                  const CUtensorMap* tmap_xpool, const CUtensorMap* tmap_w13,
                                                  const CUtensorMap* tmap_s, const CUtensorMap* tmap_w2,
                                                  const MegaFwdSecondB* second) {
  volatile int32_t* stage_task = reinterpret_cast<volatile int32_t*>(smem + L::kTaskOff);
  int stage = 0;
  uint32_t phase = 0;
  int e = 0;
  bool in_l2 = false;
  const int chunks = ceil_div(p.hidden * 2, kDispatchSlotBytes);
  const uint64_t pol_w = l2_policy_reused_loads(p.l2_hints);
  // The next task is claimed as this one starts, so the atomic's round trip hides behind this tile's loads. A CTA
  // then holds one task it has not started: a higher one, which the forward-progress argument allows.
  for (int u = atomicAdd(seq.task_claim, 1), next; u < seq.num_tasks; u = next) {
    next = atomicAdd(seq.task_claim, 1);
    const auto t = seq.locate(u, e, in_l2);
    if (t.l1)
      wait_counter_at_least(seq.disp_ctr + t.mb, Seq::rows(t) * chunks, p.wait_guard, kWaitKernelMegaFwd,
                            kWaitMegaFwdDispatch, t.mb);
    else
      wait_counter_at_least(seq.l1_ctr + t.mb, l2_ready, p.wait_guard, kWaitKernelMegaFwd, kWaitMegaFwdL1, t.mb);
    ptx::fence_proxy_async_global();
    const int kbs = t.l1 ? seq.kb1 : seq.kb2;
    for (int kb = 0; kb < kbs; ++kb) {
      ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
      uint8_t* sa = smem + L::kAOff + stage * L::kABytes;
      uint8_t* sb = smem + L::kBOff + stage * L::kBBytes;
      if (kb == 0) stage_task[stage] = u;  // published by the arrive below (release), read after the consumers' wait
      ptx::mbar_arrive_expect_tx(&full_bar[stage], L::kABytes + L::kBBytes);
      const int k0 = kb * L::kBlockK;
      bool shared_tile = false;  // compiled out without a second B
      if constexpr (kSecondB) shared_tile = t.e >= second->num_b_groups;
      if (shared_tile) {
        // group num_b_groups + v: chunk c = v % chunks of shared expert v / chunks, its gate rows c * I.., up rows
        // chunks * I + c * I.. of w13b, and columns c * I.. of w2b
        const int v = t.e - second->num_b_groups;
        const int c = v % second->chunks, slab = v / second->chunks;
        if (t.l1) {
          ptx::tma_load_2d(sa, tmap_xpool, &full_bar[stage], k0, t.row0);
          ptx::tma_load_3d_hint(sb, &second->w13b, &full_bar[stage], k0, c * p.inter + t.n0, slab, pol_w);
          ptx::tma_load_3d_hint(sb + Seq::kL1Cols * 128, &second->w13b, &full_bar[stage], k0,
                                (second->chunks + c) * p.inter + t.n0, slab, pol_w);
        } else {
          ptx::tma_load_2d(sa, tmap_s, &full_bar[stage], k0, t.row0);
          ptx::tma_load_3d_hint(sb, &second->w2b, &full_bar[stage], c * p.inter + k0, t.n0, slab, pol_w);
        }
      } else if (t.l1) {
        ptx::tma_load_2d(sa, tmap_xpool, &full_bar[stage], k0, t.row0);
        ptx::tma_load_3d_hint(sb, tmap_w13, &full_bar[stage], k0, t.n0, t.e, pol_w);
        ptx::tma_load_3d_hint(sb + Seq::kL1Cols * 128, tmap_w13, &full_bar[stage], k0, p.inter + t.n0, t.e, pol_w);
      } else {
        ptx::tma_load_2d(sa, tmap_s, &full_bar[stage], k0, t.row0);
        ptx::tma_load_3d_hint(sb, tmap_w2, &full_bar[stage], k0, t.n0, t.e, pol_w);
      }
      advance_stage<kNumStages>(stage, phase);
    }
  }
  ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
  stage_task[stage] = -1;
  ptx::mbar_arrive(&full_bar[stage]);
}

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
