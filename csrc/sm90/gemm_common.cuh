// prime-kernels: pieces shared by the sm90 grouped-GEMM kernels (no __global__ here).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "ptx.cuh"

namespace deep_gemm {
namespace sm90 {

// Largest number of groups (experts) one launch accepts: offsets and per-group tile starts live in
// shared memory.
constexpr int kMaxGroups = 1024;

// Thread roles: warpgroup 0 = producer (one elected thread issues TMA), warpgroups 1 and 2 = consumers.
constexpr int kNumThreads = 384;
constexpr int kNumConsumerThreads = 256;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;

// Named barrier ids (0 is __syncthreads).
constexpr uint32_t kBarEpilogueWg0 = 1;  // +wg
constexpr uint32_t kBarConsumers = 3;

// Epilogue staging: each consumer warpgroup owns 64 rows x 64 columns of bf16 with a 16-byte row pad
// (pitch 144 B keeps both the fragment writes and the 16-byte row reads free of bank conflicts).
constexpr int kStagePitchBytes = (64 + 8) * 2;
constexpr int kStageBytesPerWg = 64 * kStagePitchBytes;
// Synchronous epilogue: each warpgroup's staging region starts 1024-byte aligned (it also serves as one
// 128B-swizzled 64 x 64 TMA-store box, see store_acc_bf16_tma_ring).
constexpr int kSyncStageStride = 10240;
static_assert(kSyncStageStride >= kStageBytesPerWg && kSyncStageStride % 1024 == 0, "sync staging stride");

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int align_up(int a, int b) { return ceil_div(a, b) * b; }

// The tile order within one expert of the m-grouped kernels and the fused forward: n-block major, m-block fastest,
// in bands of at most kMBand m-blocks (every n-block of a band runs before the next band). Concurrent tiles share
// the expert's B slice and a band's A rows, and a band's A (16 x 128 rows: 3-16 MB at the layer shapes) stays in
// L2 while each of its n-blocks reads it. Without bands, an expert with far more rows than L2 holds (Zipf routing:
// one expert with ~15K of 16K tokens) had its A rows re-read from HBM once per n-block. An expert of at most
// kMBand m-blocks (every expert under uniform routing at the layer shapes) keeps the plain order.
constexpr int kMBand = 16;
__host__ __device__ __forceinline__ void band_tile(int local, int m_blocks, int n_blocks, int& nb, int& mb) {
  const int band = local / (kMBand * n_blocks);
  const int m0 = band * kMBand;
  const int band_rows = min(kMBand, m_blocks - m0);
  const int rem = local - band * kMBand * n_blocks;
  nb = rem / band_rows;
  mb = m0 + (rem - nb * band_rows);
}

// The start of every sm90 kernel's shared-memory layout here: the mbarrier ring's kNumStages A tiles
// (kBlockM x kBlockK bf16), then its kNumStages B tiles (kBlockN x kBlockK); stage s of each at s times its
// tile's bytes, so the consumers' descriptors step by a constant. A layout continues at kRingEnd and ends
// with kSmemBytes = its end + 1024 (slack for aligning the dynamic base), at most kSmemLimit.
template <int kBlockM_, int kBlockN_, int kBlockK_, int kNumStages>
struct StageRingLayout {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockK = kBlockK_;
  static constexpr int kABytes = kBlockM * kBlockK * 2;
  static constexpr int kBBytes = kBlockN * kBlockK * 2;
  static constexpr int kAOff = 0;
  static constexpr int kBOff = kAOff + kNumStages * kABytes;
  static constexpr int kRingEnd = kBOff + kNumStages * kBBytes;
  static constexpr int kSmemLimit = 232448;  // sm90: 227 KB of dynamic shared memory per block
};

__device__ __forceinline__ uint8_t* align_smem_1024(uint8_t* p) {
  const uint32_t a = ptx::smem_addr(p);
  return p + ((1024 - (a & 1023)) & 1023);
}

// Warp-wide exclusive scan over groups (call from one whole warp): out[g] = sum of count(g') over g' < g for
// g in [0, num_groups), and out[num_groups] = the total. count(g) is evaluated by lane g % 32.
template <typename CountFn>
__device__ __forceinline__ void warp_exclusive_scan_groups(int num_groups, int lane, int32_t* out, CountFn count) {
  int running = 0;
  for (int base = 0; base < num_groups; base += 32) {
    const int g = base + lane;
    const int cnt = g < num_groups ? count(g) : 0;
    int incl = cnt;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int o = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += o;
    }
    if (g < num_groups) out[g] = running + incl - cnt;
    running += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) out[num_groups] = running;
}

// Whole CTA (kNumThreads threads): the groups' first pool rows, clamped to [0, m_total], into s_offs[0..num_groups]
// and each group's first kBlockM-row m-block into s_mb[0..num_groups] (s_mb[num_groups]: all m-blocks), both in
// shared memory; ends with a __syncthreads.
template <int kBlockM>
__device__ __forceinline__ void load_group_offsets_and_mblocks(const int32_t* group_offsets, int num_groups,
                                                               int m_total, int32_t* s_offs, int32_t* s_mb) {
  const int tid = threadIdx.x;
  for (int i = tid; i <= num_groups; i += kNumThreads) s_offs[i] = min(max(__ldg(group_offsets + i), 0), m_total);
  __syncthreads();
  if ((tid >> 5) == 0)
    warp_exclusive_scan_groups(num_groups, tid & 31, s_mb,
                               [&](int g) { return ceil_div(max(s_offs[g + 1] - s_offs[g], 0), kBlockM); });
  __syncthreads();
}

// The position in a kNumStages-deep mbarrier ring shared by a producer and its consumers: the stage index and
// the parity its full / empty barriers are waited with (flips at every wrap).
template <int kNumStages>
__device__ __forceinline__ void advance_stage(int& stage, uint32_t& phase) {
  if (++stage == kNumStages) {
    stage = 0;
    phase ^= 1;
  }
}
template <int kNumStages>
__device__ __forceinline__ void skip_stages(int& stage, uint32_t& phase, int n) {
  stage += n;
  while (stage >= kNumStages) {
    stage -= kNumStages;
    phase ^= 1;
  }
}
// One thread: the ring's full barriers (full_arrivals each: the TMA thread's expect-tx, plus any cp.async
// arrivals) and empty barriers (empty_arrivals: the consumer warps that release a stage), then the fence that
// publishes the inits.
__device__ __forceinline__ void init_stage_barriers(uint64_t* full_bar, uint64_t* empty_bar, int num_stages,
                                                    uint32_t full_arrivals, uint32_t empty_arrivals) {
  for (int s = 0; s < num_stages; ++s) {
    ptx::mbar_init(&full_bar[s], full_arrivals);
    ptx::mbar_init(&empty_bar[s], empty_arrivals);
  }
  ptx::fence_mbar_init();
}

// One tile's k-loop for a consumer warpgroup of the m-grouped kernels: waits for each stage of the mbarrier
// ring, issues its kBlockK / 16 wgmma (one group kept in flight) and releases the stage once the group that
// read it has completed (release(stage)); a warpgroup with no rows (active = false) only releases stages.
// acc is zeroed first and settled on return. Descriptors: stage s, k-step kk adds s * kStageA/BBytes and
// kk * 32 (A) / kBStepBytes (B) bytes (>> 4) to the low halves a_lo0 / b_lo0. kProxyFence: A was written
// through the generic proxy (cp.async gather), fence before wgmma reads it.
// kAStepBytes: A's k16 step (32 bytes for K-major A; 16 rows of 128 bytes for MN-major A).
// hook (optional, NoTileHook shows the interface): before_first_wait(bar, parity) runs before the first
// k-block's wait and after_first_issue() once that k-block's MMAs are issued (an inactive warpgroup: right
// after before_first_wait): work of the previous tile that may wait until this tile's MMAs are queued;
// on_stage(kb, stage) runs once k-block kb's stage has landed, before its MMAs (e.g. to patch the stage).
struct NoTileHook {
  __device__ __forceinline__ void before_first_wait(uint64_t*, uint32_t) const {}
  __device__ __forceinline__ void after_first_issue() const {}
  __device__ __forceinline__ void on_stage(int, int) const {}
};

template <typename Mma, int kNumStages, int kBlockK, int kStageABytes, int kStageBBytes, uint32_t kBStepBytes,
          bool kProxyFence, uint32_t kAStepBytes = 32, int kAccRegs, typename ReleaseFn, typename Hook = NoTileHook>
__device__ __forceinline__ void consumer_tile_mainloop(float (&acc)[kAccRegs], bool active, int num_k_blocks,
                                                       uint64_t* full_bar, int& stage, uint32_t& phase,
                                                       uint32_t a_lo0, uint32_t a_hi, uint32_t b_lo0,
                                                       uint32_t b_hi, ReleaseFn&& release, Hook&& hook = Hook{}) {
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) acc[i] = 0.f;
  int prev_stage = 0;
  hook.before_first_wait(&full_bar[stage], phase);
  if (!active) {
    hook.after_first_issue();
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      ptx::mbar_wait(&full_bar[stage], phase);
      release(stage);
      advance_stage<kNumStages>(stage, phase);
    }
  } else {
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      ptx::mbar_wait(&full_bar[stage], phase);
      hook.on_stage(kb, stage);
      // (compile-time: a runtime test here costs the consumers registers they do not have at 224)
      if constexpr (kProxyFence) ptx::fence_proxy_async_smem();
#pragma unroll
      for (int i = 0; i < kAccRegs; ++i) ptx::reg_fence(acc[i]);
      ptx::wgmma_fence();
      const uint32_t a_lo = a_lo0 + static_cast<uint32_t>(stage) * (kStageABytes >> 4);
      const uint32_t b_lo = b_lo0 + static_cast<uint32_t>(stage) * (kStageBBytes >> 4);
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        const uint64_t da = ptx::desc_from_halves(a_lo + kk * (kAStepBytes >> 4), a_hi);
        const uint64_t db = ptx::desc_from_halves(b_lo + kk * (kBStepBytes >> 4), b_hi);
        Mma::mma(acc, da, db, 1u);
      }
      ptx::wgmma_commit();
#pragma unroll
      for (int i = 0; i < kAccRegs; ++i) ptx::reg_fence(acc[i]);
      if (kb == 0) hook.after_first_issue();
      if (kb > 0) {
        ptx::wgmma_wait<1>();
        release(prev_stage);
      }
      prev_stage = stage;
      advance_stage<kNumStages>(stage, phase);
    }
  }
  ptx::wgmma_wait<0>();  // unconditional: lets ptxas see every accumulator settled on all paths
  if (active && num_k_blocks > 0) release(prev_stage);
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) ptx::reg_fence(acc[i]);
}

// One tile's mainloop for a ping-pong consumer warpgroup that owns 128 rows: acc0 gets rows 0..63 and acc1
// rows 64..127 of each A stage (two m64 wgmma per k16 step against the same B). Both wgmma are issued
// unconditionally: a wgmma under a divergent branch makes ptxas serialize every wgmma of the kernel
// (C7520), so rows past an m-block's end compute on whatever the box holds and are never stored. Stages
// are released to the producer (empty_bar, one arrival per warp) as soon as the next k-block's MMAs are
// issued; pass_turn() runs once all of the tile's MMAs are issued (the other warpgroup may then issue its
// own), before the wait for them to finish.
template <typename Mma, int kNumStages, int kBlockK, int kStageABytes, int kStageBBytes, uint32_t kBStepDesc,
          int kAccRegs, typename PassTurn>
__device__ __forceinline__ void pingpong_tile_mainloop(float (&acc0)[kAccRegs], float (&acc1)[kAccRegs],
                                                       int num_k_blocks, uint64_t* full_bar, uint64_t* empty_bar,
                                                       int& stage, uint32_t& phase, uint32_t a_lo0, uint32_t a_hi,
                                                       uint32_t b_lo0, uint32_t b_hi, int lane,
                                                       PassTurn&& pass_turn) {
  constexpr uint32_t kHalfADesc = (64 * 128) >> 4;  // rows 64..127 of a 128-byte-swizzled A stage
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) {
    acc0[i] = 0.f;
    acc1[i] = 0.f;
  }
  int prev_stage = 0;
  for (int kb = 0; kb < num_k_blocks; ++kb) {
    ptx::mbar_wait(&full_bar[stage], phase);
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) {
      ptx::reg_fence(acc0[i]);
      ptx::reg_fence(acc1[i]);
    }
    ptx::wgmma_fence();
    const uint32_t a_lo = a_lo0 + static_cast<uint32_t>(stage) * (kStageABytes >> 4);
    const uint32_t b_lo = b_lo0 + static_cast<uint32_t>(stage) * (kStageBBytes >> 4);
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      const uint64_t db = ptx::desc_from_halves(b_lo + kk * kBStepDesc, b_hi);
      Mma::mma(acc0, ptx::desc_from_halves(a_lo + kk * (32 >> 4), a_hi), db, 1u);
      Mma::mma(acc1, ptx::desc_from_halves(a_lo + kHalfADesc + kk * (32 >> 4), a_hi), db, 1u);
    }
    ptx::wgmma_commit();
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) {
      ptx::reg_fence(acc0[i]);
      ptx::reg_fence(acc1[i]);
    }
    if (kb > 0) {
      ptx::wgmma_wait<1>();
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(&empty_bar[prev_stage]);
    }
    prev_stage = stage;
    advance_stage<kNumStages>(stage, phase);
  }
  pass_turn();
  ptx::wgmma_wait<0>();
  __syncwarp();
  if (lane == 0 && num_k_blocks > 0) ptx::mbar_arrive(&empty_bar[prev_stage]);
}

// Writes the 64 x kBlockN fp32 accumulator fragment of one consumer warpgroup (wgmma m64nN layout) as
// bf16 to global memory, through a 64-column shared-memory staging tile, with 16-byte coalesced stores.
// Rows >= row_limit and columns >= col_limit are not written.
//   out:        pointer to element (row 0, col 0) of the output matrix, row stride ldo elements.
//   row0/col0:  first row/column of this warpgroup's 64 x kBlockN block.
template <int kBlockN>
__device__ __forceinline__ void store_acc_bf16_staged(const float (&acc)[kBlockN / 2], uint32_t stage_addr,
                                                      uint32_t bar_id, int wg_tid, __nv_bfloat16* out,
                                                      int64_t ldo, int row0, int row_limit, int col0,
                                                      int col_limit) {
  const int warp_in_wg = wg_tid >> 5;
  const int lane = wg_tid & 31;
  const int frag_row = warp_in_wg * 16 + (lane >> 2);
  const int frag_col = (lane & 3) * 2;
#pragma unroll
  for (int c = 0; c < kBlockN / 64; ++c) {
    if (col0 + c * 64 >= col_limit) break;  // uniform across the warpgroup
    ptx::named_bar_sync(bar_id, 128);       // earlier reads of the staging tile are done
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const int j = c * 8 + jj;
      const uint32_t a0 = stage_addr + frag_row * kStagePitchBytes + (jj * 8 + frag_col) * 2;
      ptx::st_shared_b32(a0, ptx::pack_bf16x2(acc[4 * j + 0], acc[4 * j + 1]));
      ptx::st_shared_b32(a0 + 8 * kStagePitchBytes, ptx::pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]));
    }
    ptx::named_bar_sync(bar_id, 128);
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const int idx = it * 128 + wg_tid;
      const int r = idx >> 3;
      const int ch = idx & 7;
      const int grow = row0 + r;
      const int gcol = col0 + c * 64 + ch * 8;
      if (grow < row_limit && gcol < col_limit) {
        const uint4 v = ptx::ld_shared_v4(stage_addr + r * kStagePitchBytes + ch * 16);
        *reinterpret_cast<uint4*>(out + static_cast<int64_t>(grow) * ldo + gcol) = v;
      }
    }
  }
}


// ---- asynchronous epilogue: TMA stores from a 128B-swizzled staging tile ---------------------------
// Each consumer warpgroup owns a 64-row half of a full-tile staging buffer, laid out as kBlockN / 64 boxes
// of 64 rows x 64 columns (8 KB each, 128-byte rows, 16-byte chunks XOR-swizzled by row % 8: the layout a
// 128B-swizzled tensor map reads). The warpgroup writes its fp32 fragment there as bf16 with stmatrix, and
// one elected thread issues one TMA store per box and goes on with the next tile's mainloop; the store's
// shared-memory read is waited for only before the next tile's epilogue rewrites the half. Halves whose
// rows are not all inside the group (a group's tail m-block: the rows after it belong to the next group,
// and a TMA store writes whole boxes) are copied out by the warpgroup's threads instead.
template <int kBlockN>
struct TmaStaging {
  static constexpr int kBoxBytes = 64 * 128;               // 64 rows x 64 bf16 columns
  static constexpr int kHalfBytes = (kBlockN / 64) * kBoxBytes;  // one warpgroup's 64 rows
  static constexpr int kBytes = 2 * kHalfBytes;
};

// Plain bf16 rounding (round to nearest even) of two fp32 values into one bf16x2 word.
struct PackBf16x2 {
  __device__ __forceinline__ uint32_t operator()(float lo, float hi) const { return ptx::pack_bf16x2(lo, hi); }
};

template <int kBlockN, int kBoxes, typename Pack = PackBf16x2>
__device__ __forceinline__ void write_acc_boxes_to_staging(const float (&acc)[kBlockN / 2], uint32_t stg_half,
                                                           int wg_tid, int box0, const Pack& pack = Pack{}) {
  const int lane = wg_tid & 31;
  const int mi = lane >> 3;
  const int ri = lane & 7;
  const int row = (wg_tid >> 5) * 16 + ((mi & 1) << 3) + ri;
  const uint32_t base = stg_half + row * 128;
  const uint32_t x = static_cast<uint32_t>(((mi >> 1) ^ ri) << 4);
#pragma unroll
  for (int jq = 0; jq < kBoxes * 4; ++jq) {
    const int jp = box0 * 4 + jq;  // 16-column group of the fragment
    const int j0 = 2 * jp;
    const uint32_t addr = base + (jq >> 2) * TmaStaging<64 * kBoxes>::kBoxBytes +
                          ((static_cast<uint32_t>((jq & 3) * 2) << 4) ^ x);
    ptx::stmatrix_x4(addr, pack(acc[4 * j0 + 0], acc[4 * j0 + 1]), pack(acc[4 * j0 + 2], acc[4 * j0 + 3]),
                     pack(acc[4 * j0 + 4], acc[4 * j0 + 5]), pack(acc[4 * j0 + 6], acc[4 * j0 + 7]));
  }
}

// One warpgroup's 64 x kBlockN fp32 fragment (wgmma m64nN layout) -> bf16 into its swizzled staging half.
template <int kBlockN>
__device__ __forceinline__ void write_acc_to_swizzled_staging(const float (&acc)[kBlockN / 2], uint32_t stg_half,
                                                              int wg_tid) {
  write_acc_boxes_to_staging<kBlockN, kBlockN / 64>(acc, stg_half, wg_tid, 0);
}

// The saved pre-activation's rounding with a clamp (deep_gemm.mega.reference, rounding point F6): round to
// nearest even, except that a value strictly on one side of a bound never lands on or across it (it takes
// the nearest bf16 on its own side), so the backward's clamp masks evaluated on the bf16 h equal the
// forward's on the fp32 h. Gate columns have the bound c (min(g, c)); up columns also -c. below / above:
// the largest bf16 value < c and the smallest > c (so -above / -below are those of -c).
struct PackBf16x2ClampMasks {
  float c, below, above;
  bool up;
  __device__ __forceinline__ float round1(float v) const {
    const float r = __bfloat162float(__float2bfloat16_rn(v));
    if (v < c && r >= c) return below;
    if (v > c && r <= c) return above;
    if (up) {
      if (v < -c && r >= -c) return -above;
      if (v > -c && r <= -c) return -below;
    }
    return r;
  }
  __device__ __forceinline__ uint32_t operator()(float lo, float hi) const {
    return ptx::pack_bf16x2(round1(lo), round1(hi));  // exact: both are bf16 values already
  }
};

// Copies rows [0, rows) of a swizzled staging half to out (row stride ldo), columns col0.. below col_limit,
// with the warpgroup's 128 threads (16-byte loads and stores). kSplit (SwiGLU h): the left half of the
// tile's columns goes to out columns col0.., the right half to col_limit + col0.., each below col_limit.
template <int kBlockN, bool kSplit = false>
__device__ __forceinline__ void copy_swizzled_half_to_global(uint32_t stg_half, int wg_tid, int rows,
                                                             __nv_bfloat16* out, int64_t ldo, int row0,
                                                             int col0, int col_limit) {
  constexpr int kChunksPerRow = kBlockN / 8;
  const int total = rows * kChunksPerRow;
#pragma unroll 2
  for (int idx = wg_tid; idx < total; idx += 128) {
    const int r = idx / kChunksPerRow;
    const int ch = idx - r * kChunksPerRow;
    const bool right = kSplit && ch >= kChunksPerRow / 2;
    const int c = col0 + (right ? ch - kChunksPerRow / 2 : ch) * 8;
    const int gcol = c + (right ? col_limit : 0);
    if (c < col_limit) {
      const uint32_t a = stg_half + (ch >> 3) * TmaStaging<kBlockN>::kBoxBytes + r * 128 + (((ch & 7) ^ (r & 7)) << 4);
      const uint4 v = ptx::ld_shared_v4(a);
      *reinterpret_cast<uint4*>(out + static_cast<int64_t>(row0 + r) * ldo + gcol) = v;
    }
  }
}

// Synchronous epilogue through TMA stores: one warpgroup's 64 x kBlockN fragment goes out as kBlockN / 64 boxes of
// 64 x 64 through a single 8 KB 128B-swizzled staging box (box_addr, 1024-byte aligned): write a box with
// stmatrix, one elected thread TMA-stores it (issue(box_addr, column)), and the next box waits only for that
// store's shared-memory read. The last store's read overlaps the next tile's mainloop. Boxes at or past
// col_limit are skipped (the tensor map clips the rest).
template <int kBlockN, typename IssueFn>
__device__ __forceinline__ void store_acc_bf16_tma_ring(const float (&acc)[kBlockN / 2], uint32_t box_addr,
                                                        uint32_t bar_id, int wg_tid, int col0, int col_limit,
                                                        IssueFn&& issue) {
#pragma unroll
  for (int c = 0; c < kBlockN / 64; ++c) {
    if (col0 + c * 64 >= col_limit) break;  // uniform across the warpgroup
    if (wg_tid == 0) ptx::bulk_wait_group_read<0>();
    ptx::named_bar_sync(bar_id, 128);
    write_acc_boxes_to_staging<kBlockN, 1>(acc, box_addr, wg_tid, c);
    ptx::fence_proxy_async_smem();
    ptx::named_bar_sync(bar_id, 128);
    if (wg_tid == 0) {
      issue(box_addr, col0 + c * 64);
      ptx::bulk_commit_group();
    }
  }
}

// L2 cache policies for the kernels' hint bits (MegaFwdParams, MGroupedParams, KGroupedParams::l2_hints): bit 3
// asks evict_last for the loads that many tiles read again (the weights; the k-grouped GEMM's operands); bit `bit`
// (0-2) evict_first for one kind of output store. A clear bit gives evict_normal, i.e. no preference.
__device__ __forceinline__ uint64_t l2_policy_reused_loads(int32_t hints) {
  return (hints & 8) ? ptx::l2_policy_evict_last() : ptx::l2_policy_evict_normal();
}
__device__ __forceinline__ uint64_t l2_policy_store(int32_t hints, int bit) {
  return ((hints >> bit) & 1) ? ptx::l2_policy_evict_first() : ptx::l2_policy_evict_normal();
}

// 1 / (1 + e^-x) from 2^x and 1/x on the SFU (ptx::ex2_approx_ftz, rcp_approx_ftz: the values __expf and
// __fdividef give here, without their denormal-range checks), the sigmoid of every SwiGLU epilogue.
__device__ __forceinline__ float sigmoid_sfu(float x) {
  constexpr float kLog2e = 1.4426950408889634f;  // the factor __expf applies before its 2^x
  return ptx::rcp_approx_ftz(1.f + ptx::ex2_approx_ftz(-x * kLog2e));
}

// s = silu(g) * u in fp32 (clamp > 0: g <= clamp and -clamp <= u <= clamp first), the one formula of every
// forward epilogue, so that all of them round s identically. Its g and u are the pre-activations as the
// backward sees them (reference F3): h rounded to bf16 the way it is saved (round_acc_as_saved_h), so that s is
// exactly the bf16 rounding of the backward's s, and an epilogue that only holds bf16 h (the cooperative
// forward's hand-off) computes the same s as one that holds the fp32 accumulators.
__device__ __forceinline__ float swiglu_value(float g, float u, float clamp) {
  if (clamp > 0.f) {
    g = fminf(g, clamp);
    u = fmaxf(fminf(u, clamp), -clamp);
  }
  return g * sigmoid_sfu(g) * u;  // an IEEE division would cost a slow-path check per element
}

// The saved h's rounding (round to nearest even) of a pair of values, in place: one conversion instruction for
// both (conversions issue at a quarter of the FMA rate: one per value cost the cooperative forward's L1 epilogue
// ~45 us per CTA at 30B).
__device__ __forceinline__ void round_bf16_pair(float& a, float& b) {
  const uint32_t p = ptx::pack_bf16x2(a, b);
  a = __uint_as_float(p << 16);
  b = __uint_as_float(p & 0xffff0000u);
}

// Packs two values that are already bf16 values (their low 16 bits are zero) into one bf16x2 word, exactly and
// without a conversion instruction.
struct PackBf16x2Exact {
  __device__ __forceinline__ uint32_t operator()(float lo, float hi) const {
    return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);
  }
};

// The saved h's rounding of a pair of gate (gate()) or up (up()) values, in place: with a clamp (c > 0), rounding
// point F6 (PackBf16x2ClampMasks); without one, or where h is saved plainly (the grouped pipeline), RoundHPlain.
struct RoundHMasks {
  float c, below, above;
  __device__ __forceinline__ void gate(float& a, float& b) const {
    const PackBf16x2ClampMasks r{c, below, above, false};
    a = r.round1(a);
    b = r.round1(b);
  }
  __device__ __forceinline__ void up(float& a, float& b) const {
    const PackBf16x2ClampMasks r{c, below, above, true};
    a = r.round1(a);
    b = r.round1(b);
  }
};
struct RoundHPlain {
  __device__ __forceinline__ void gate(float& a, float& b) const { round_bf16_pair(a, b); }
  __device__ __forceinline__ void up(float& a, float& b) const { round_bf16_pair(a, b); }
};

// In place: a warpgroup's 64 x kBlockN fragment (left half gate columns, right half up columns) rounded to the
// bf16 values h is saved as (Round); then PackBf16x2Exact stages them and swiglu_in_place needs no rounding.
// Adjacent registers 2i, 2i + 1 are adjacent columns of one row (the wgmma accumulator layout).
template <int kBlockN, typename Round>
__device__ __forceinline__ void round_acc_as_saved_h(float (&acc)[kBlockN / 2], const Round& round) {
#pragma unroll
  for (int i = 0; i < kBlockN / 4; i += 2) {
    round.gate(acc[i], acc[i + 1]);
    round.up(acc[kBlockN / 4 + i], acc[kBlockN / 4 + i + 1]);
  }
}

// In place: the left kBlockN / 4 accumulator registers (the gate half's fragment) become s of the fragment's
// 64 x kBlockN / 2 columns, in the same fragment layout, so write_acc_boxes_to_staging can stage them. The
// fragment holds h as saved already (round_acc_as_saved_h).
template <int kBlockN>
__device__ __forceinline__ void swiglu_in_place(float (&acc)[kBlockN / 2], float clamp) {
#pragma unroll
  for (int i = 0; i < kBlockN / 4; ++i) acc[i] = swiglu_value(acc[i], acc[i + kBlockN / 4], clamp);
}

// SwiGLU epilogue: s[row, c] = silu(gate) * up for one warpgroup's 64 x kBlockN fragment whose left kBlockN / 2
// columns are gate columns col0.. and right ones the matching up columns, already rounded as the kernel saves h
// (round_acc_as_saved_h); fp32 math, bf16x2 stores straight from registers (s is a third of the tile's output
// bytes; L2 merges the 16-byte row pieces). Rows >= row_end and columns >= col_limit are not written.
template <int kBlockN>
__device__ __forceinline__ void store_swiglu_from_acc(const float (&acc)[kBlockN / 2], int wg_tid, __nv_bfloat16* s,
                                                      int64_t lds, int row0, int row_end, int col0, int col_limit,
                                                      float clamp) {
  constexpr int kUp = kBlockN / 16;  // accumulator column group of the up half
  const int lane = wg_tid & 31;
  const int r0 = row0 + (wg_tid >> 5) * 16 + (lane >> 2);
  const int cbase = col0 + 2 * (lane & 3);
  auto f = [&](float g, float u) -> float { return swiglu_value(g, u, clamp); };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + 8 * h;
    if (row < row_end) {
      __nv_bfloat16* srow = s + static_cast<int64_t>(row) * lds;
#pragma unroll
      for (int j = 0; j < kBlockN / 16; ++j) {
        const int col = cbase + 8 * j;
        if (col < col_limit) {
          const uint32_t v = ptx::pack_bf16x2(f(acc[4 * j + 2 * h], acc[4 * (j + kUp) + 2 * h]),
                                              f(acc[4 * j + 2 * h + 1], acc[4 * (j + kUp) + 2 * h + 1]));
          *reinterpret_cast<uint32_t*>(srow + col) = v;
        }
      }
    }
  }
}

// The SwiGLU backward of one column pair (the per-element math of both L2-dgrad epilogues): g2 / u2 hold the
// pair's gate and up values as saved (bf16x2, first column in the low half), da0 / da1 its fp32 accumulators, w
// the route's weight. Returns dg, du and w * s as bf16x2 words and adds da * s to partial in column order.
struct SwigluBwdWords {
  uint32_t dg, du, aw;
};
// kClamp: kClampOff / kClampOn (clamp > 0) decide at compile time (the clamp's min / max / masks, computed and
// discarded at run time, were 8 of the ~33 instructions per element); kClampRuntime tests clamp > 0 per element
// (one copy of the code, for an epilogue that cannot spare the registers of two).
constexpr int kClampOff = 0, kClampOn = 1, kClampRuntime = 2;
template <int kClamp>
__device__ __forceinline__ SwigluBwdWords swiglu_bwd_pair(uint32_t g2, uint32_t u2, float da0, float da1, float w,
                                                          float clamp, float& partial) {
  const bool has_clamp = kClamp == kClampOn || (kClamp == kClampRuntime && clamp > 0.f);
  float dg[2], du[2], av[2];
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const float g = ptx::bf16_bits_to_float(static_cast<uint16_t>(t ? g2 >> 16 : g2 & 0xffffu));
    const float u = ptx::bf16_bits_to_float(static_cast<uint16_t>(t ? u2 >> 16 : u2 & 0xffffu));
    const float gc = has_clamp ? fminf(g, clamp) : g;
    const float uc = has_clamp ? fminf(fmaxf(u, -clamp), clamp) : u;
    const float sig = sigmoid_sfu(gc);
    const float silu = gc * sig;
    const float sv = silu * uc;
    const float da = t ? da1 : da0;
    partial = fmaf(da, sv, partial);
    const float ds = w * da;
    dg[t] = ds * uc * sig * (1.f + gc * (1.f - sig));
    du[t] = ds * silu;
    if (has_clamp) {
      dg[t] = g < clamp ? dg[t] : 0.f;
      du[t] = (u > -clamp && u < clamp) ? du[t] : 0.f;
    }
    av[t] = w * sv;
  }
  return SwigluBwdWords{ptx::pack_bf16x2(dg[0], dg[1]), ptx::pack_bf16x2(du[0], du[1]), ptx::pack_bf16x2(av[0], av[1])};
}

// SwiGLU backward epilogue of L2's dgrad (B3-B6, B9 of deep_gemm.mega.reference, on the fp32 da in registers:
// no bf16 rounding of da, unlike the separate pool-row kernel). One warpgroup's 64 x kBlockN fragment holds
// da[row, c] for columns col0.. of I. Per pool row (route r, weight w = topk_weights[r]; w = 0 for padding
// rows), with g = h[row, c], u = h[row, I + c] (bf16) and gc, uc their clamped values:
//   sig = sigmoid(gc), silu = gc * sig, s = silu * uc
//   dh[row, c] = w * da * uc * sig * (1 + gc * (1 - sig)) * [g < clamp],  dh[row, I + c] = w * da * silu * [|u| < clamp]
//   aw[row, c] = w * s;   dt_part[row, col0 / 128] = sum over the n-block's columns of da * s (a fixed
//   shuffle tree: per-thread sums in column order, then lanes 1 and 2 apart); dt_part has one column per
//   128 columns of I, a 256-column tile zeroes the second column of its pair
// Loads and stores go straight from registers (bf16x2 per column pair; L2 merges a row's 16-byte pieces).
// The h loads of kChunk column groups are issued together before any of their stores: one load-store
// round trip per group (measured ~30 us per tile when every group waited for the previous group's stores).
template <int kBlockN>
__device__ __forceinline__ void swiglu_bwd_epilogue(const float (&acc)[kBlockN / 2], int wg_tid, int row0, int row_end,
                                                    int col0, int inter, const __nv_bfloat16* __restrict__ h,
                                                    int64_t ldh, const int32_t* __restrict__ pool_src_route,
                                                    const float* __restrict__ route_weights,
                                                    __nv_bfloat16* __restrict__ dh, int64_t lddh,
                                                    __nv_bfloat16* __restrict__ aw, int64_t ldaw,
                                                    float* __restrict__ dt_part, int dt_ld, float clamp) {
  constexpr int kGroups = kBlockN / 8;  // column groups of 8 per row fragment (2 columns per lane)
  constexpr int kChunk = 16;
  const int lane = wg_tid & 31;
  const int r0 = row0 + (wg_tid >> 5) * 16 + (lane >> 2);
  const int cbase = col0 + 2 * (lane & 3);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = r0 + 8 * hh;
    const bool valid = row < row_end;
    const int route = valid ? __ldg(pool_src_route + row) : -1;
    const float w = route >= 0 ? __ldg(route_weights + route) : 0.f;
    float partial = 0.f;
    if (valid) {
      const __nv_bfloat16* hrow = h + static_cast<int64_t>(row) * ldh;
      __nv_bfloat16* dhrow = dh + static_cast<int64_t>(row) * lddh;
      __nv_bfloat16* awrow = aw + static_cast<int64_t>(row) * ldaw;
#pragma unroll
      for (int j0 = 0; j0 < kGroups; j0 += kChunk) {
        uint32_t g2[kChunk], u2[kChunk];
#pragma unroll
        for (int jj = 0; jj < kChunk; ++jj) {
          const int col = cbase + 8 * (j0 + jj);
          g2[jj] = col < inter ? __ldg(reinterpret_cast<const unsigned int*>(hrow + col)) : 0u;
          u2[jj] = col < inter ? __ldg(reinterpret_cast<const unsigned int*>(hrow + inter + col)) : 0u;
        }
#pragma unroll
        for (int jj = 0; jj < kChunk; ++jj) {
          const int j = j0 + jj;  // constant after unrolling: acc is indexed by constants only
          const int col = cbase + 8 * j;
          if (col < inter) {
            const SwigluBwdWords o = swiglu_bwd_pair<kClampRuntime>(g2[jj], u2[jj], acc[4 * j + 2 * hh],
                                                                    acc[4 * j + 2 * hh + 1], w, clamp, partial);
            *reinterpret_cast<uint32_t*>(dhrow + col) = o.dg;
            *reinterpret_cast<uint32_t*>(dhrow + inter + col) = o.du;
            *reinterpret_cast<uint32_t*>(awrow + col) = o.aw;
          }
        }
      }
    }
    partial += __shfl_xor_sync(0xffffffffu, partial, 1);
    partial += __shfl_xor_sync(0xffffffffu, partial, 2);
    if (valid && (lane & 3) == 0) {
      // one column per 128 columns of I; a 256-column tile fills its pair's first column and zeroes the second
      float* dst = dt_part + static_cast<int64_t>(row) * dt_ld + col0 / 128;
      dst[0] = route >= 0 ? partial : 0.f;
      if (kBlockN == 256 && col0 / 128 + 1 < dt_ld) dst[1] = 0.f;
    }
  }
}

// Pulls the h rows a swiglu_bwd_epilogue will read into L2 while the tile's mainloop runs: the four lanes
// of a row fragment each take one 128-byte line of the gate and of the up columns (kBlockN = 256 columns =
// 4 lines per half).
template <int kBlockN>
__device__ __forceinline__ void prefetch_swiglu_bwd_rows(int wg_tid, int row0, int row_end, int col0, int inter,
                                                         const __nv_bfloat16* h, int64_t ldh) {
  static_assert(kBlockN == 256, "one 128-byte line per lane and half");
  const int lane = wg_tid & 31;
  const int r0 = row0 + (wg_tid >> 5) * 16 + (lane >> 2);
  const int col = col0 + 64 * (lane & 3);
  if (col >= inter) return;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = r0 + 8 * hh;
    if (row < row_end) {
      const __nv_bfloat16* hrow = h + static_cast<int64_t>(row) * ldh;
      ptx::prefetch_l2(hrow + col);
      ptx::prefetch_l2(hrow + inter + col);
    }
  }
}

}  // namespace sm90
}  // namespace deep_gemm
