// prime-kernels: the parts of the sm90a fused Mega MoE forward that its BF16 kernel (mega_moe_fwd.cuh) and its FP8
// kernel (mega_moe_fwd_fp8.cuh) share: the parameters and their limits, the shared-memory layout, the dispatch role
// (pool order, then token-major), the task sequence, the prologue and the TMA producer. Why no wait here can hang is
// argued once, in mega_moe_fwd.cuh's header: every wait below is one of the waits that argument covers.
#pragma once

#include <cuda.h>

#include "common/device_check.hpp"
#include "common/watchdog.cuh"
#include "dispatch_rows.cuh"
#include "epilogue.cuh"
#include "kernel_common.cuh"
#include "mainloop.cuh"
#include "pipeline.cuh"

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

// The TMA producer's task loop (warp 0, lane 0), which both forwards' producers run: claims tasks in sequence order
// until none is left, through one stage ring. An L1 tile first waits until its m-block is dispatched (disp_per_row
// counter units a row), an L2 tile until its m-block's L1 counter reaches l2_ready (every s column of its rows
// written); then load_stage(t, kb, stage) arms the stage's full barrier and issues its loads, one kBlockK step at a
// time. The task index goes to the consumers with the tile's first stage; after the last task, a stage with task -1
// and no loads ends them.
template <typename L, int kNumStages, typename Seq, typename LoadStage>
__device__ __forceinline__ void mega_producer_task_loop(const Seq& seq, int disp_per_row, int l2_ready,
                                                        const WaitGuard& guard, int32_t wait_kernel, uint8_t* smem,
                                                        uint64_t* full_bar, uint64_t* empty_bar,
                                                        LoadStage&& load_stage) {
  volatile int32_t* stage_task = reinterpret_cast<volatile int32_t*>(smem + L::kTaskOff);
  int stage = 0;
  uint32_t phase = 0;
  int e = 0;
  bool in_l2 = false;
  // The next task is claimed as this one starts, so the atomic's round trip hides behind this tile's loads. A CTA
  // then holds one task it has not started: a higher one, which the forward-progress argument allows.
  for (int u = atomicAdd(seq.task_claim, 1), next; u < seq.num_tasks; u = next) {
    next = atomicAdd(seq.task_claim, 1);
    const auto t = seq.locate(u, e, in_l2);
    if (t.l1)
      wait_counter_at_least(seq.disp_ctr + t.mb, Seq::rows(t) * disp_per_row, guard, wait_kernel,
                            kWaitMegaFwdDispatch, t.mb);
    else
      wait_counter_at_least(seq.l1_ctr + t.mb, l2_ready, guard, wait_kernel, kWaitMegaFwdL1, t.mb);
    ptx::fence_proxy_async_global();
    const int kbs = t.l1 ? seq.kb1 : seq.kb2;
    for (int kb = 0; kb < kbs; ++kb) {
      ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
      if (kb == 0) stage_task[stage] = u;  // published by the arrive below (release), read after the consumers' wait
      load_stage(t, kb, stage);
      advance_stage<kNumStages>(stage, phase);
    }
  }
  ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
  stage_task[stage] = -1;
  ptx::mbar_arrive(&full_bar[stage]);
}

// The BF16 forward's TMA producer: A rows (x_pool or s) and B (gate and up rows of w13, or w2; a shared expert's
// from the second B) per stage.
template <typename L, int kNumStages, bool kSecondB, typename Seq>
__device__ __forceinline__ void mega_tma_producer(const MegaFwdParams& p, const Seq& seq, int l2_ready, uint8_t* smem,
                                                  uint64_t* full_bar, uint64_t* empty_bar,
                                                  const CUtensorMap* tmap_xpool, const CUtensorMap* tmap_w13,
                                                  const CUtensorMap* tmap_s, const CUtensorMap* tmap_w2,
                                                  const MegaFwdSecondB* second) {
  const int chunks = ceil_div(p.hidden * 2, kDispatchSlotBytes);
  const uint64_t pol_w = l2_policy_reused_loads(p.l2_hints);
  mega_producer_task_loop<L, kNumStages>(
      seq, chunks, l2_ready, p.wait_guard, kWaitKernelMegaFwd, smem, full_bar, empty_bar,
      [&](const auto& t, int kb, int stage) {
        uint8_t* sa = smem + L::kAOff + stage * L::kABytes;
        uint8_t* sb = smem + L::kBOff + stage * L::kBBytes;
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
          ptx::tma_load_3d_hint(sb + Seq::kL1Cols * 128, tmap_w13, &full_bar[stage], k0, p.inter + t.n0, t.e,
                                pol_w);
        } else {
          ptx::tma_load_2d(sa, tmap_s, &full_bar[stage], k0, t.row0);
          ptx::tma_load_3d_hint(sb, tmap_w2, &full_bar[stage], k0, t.n0, t.e, pol_w);
        }
      });
}

}  // namespace sm90
}  // namespace prime_kernels
