// proto192: m-grouped BF16 "nt" GEMM with larger CTA tiles than our 128 x 256 cooperative tile (prototype).
//
//   D[m, :] = A[m, :] @ B_g^T  for m in [offs[g], offs[g+1]);  A [M, K], B [G, N, K] (both K contiguous),
//   D [M, N] bf16, fp32 accumulation. Rows outside every group are not written.
//
// One template (BigTileCfg), three instantiations (see CfgV3 / CfgV3s / CfgV2 below for why there are three).
// Everything else follows csrc/sm90/m_grouped_gemm.cuh (plain nt mode): persistent grid, one TMA-issuing thread, a
// kNumStages-deep mbarrier ring of (A kBlockM x 64 | B kBlockN x 64) bf16 stages, 128-byte swizzle, tile order
// group-major / n-block / m-block in bands (band_tile), every role walking the same static tile sequence; the
// k-loop keeps one wgmma group in flight and releases a stage once the group that read it has completed.
// Epilogue: each consumer warpgroup writes its 64-row fragments box by box (64 x 64 bf16, stmatrix into a
// 128B-swizzled box of a kRingBoxes-deep ring) and one thread TMA-stores each box; a 64-row fragment that crosses
// the group's end is copied out by the warpgroup's threads (rows < row_end only).
//
// Debug: -DPROTO_DEBUG bounds every mbarrier spin-wait (PROTO_SPIN_BOUND polls) and traps.
#pragma once

#include <cuda.h>

#include "sm90/gemm_common.cuh"
#include "wgmma_n192.cuh"

namespace proto192 {

namespace ptx = deep_gemm::sm90::ptx;
using deep_gemm::sm90::align_smem_1024;
using deep_gemm::sm90::band_tile;
using deep_gemm::sm90::ceil_div;
using deep_gemm::sm90::kMaxGroups;
using deep_gemm::sm90::warp_exclusive_scan_groups;

#ifndef PROTO_SPIN_BOUND
#define PROTO_SPIN_BOUND 20000000u
#endif

#ifdef PROTO_DEBUG
// Set by a bounded wait that ran out (debug builds); the kernel traps at its end if it is set.
__device__ int g_spin_timeout = 0;
#endif

// mbarrier parity wait. Release builds: try_wait with a 10 ms suspend hint (as ptx::mbar_wait). PROTO_DEBUG:
// plain try_wait polls, at most PROTO_SPIN_BOUND of them; then the wait gives up (sets g_spin_timeout and returns,
// so every later wait gives up too and the kernel runs to its end, where it executes __trap()). A __trap() right
// here would be simpler, but a trap inside a setmaxnreg region makes ptxas drop the region's register budget
// (V2 and V3s then spill ~1 KB per thread).
__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
#ifdef PROTO_DEBUG
  uint32_t polls = 0;
  while (!ptx::mbar_try_wait(bar, parity)) {
    if (++polls > (uint32_t)(PROTO_SPIN_BOUND)) {
      atomicExch(&g_spin_timeout, 1);
      break;
    }
  }
#else
  while (!ptx::mbar_try_wait_hint(bar, parity, 0x989680u)) {
  }
#endif
}

template <int N>
struct MmaN;
template <>
struct MmaN<256> {
  using T = ptx::WgmmaBf16<256, 0, 0>;
};
template <>
struct MmaN<128> {
  using T = ptx::WgmmaBf16<128, 0, 0>;
};
template <>
struct MmaN<192> {
  using T = WgmmaBf16N192<0, 0>;
};

// kConsumerWGs consumer warpgroups (warps [0, 4 kConsumerWGs)), each owning kMmaM x 64 rows of the tile over the
// full kBlockN width, which it covers with kNSplit wgmma of kBlockN / kNSplit columns (kMmaM x kNSplit accumulator
// arrays). Producer: kProducerWarps = 4: a warpgroup after the consumers (one thread issues TMA; setmaxnreg to
// kProdRegs / kConsRegs); 0: no producer warps, thread 0 (a consumer thread) issues the TMA loads itself, one
// each time its warpgroup releases a stage (its cursor lives in shared memory). kRingBoxes: 64 x 64 staging boxes
// per consumer warpgroup.
template <int kConsumerWGs_, int kMmaM_, int kNSplit_, int kBlockN_, int kNumStages_, int kRingBoxes_,
          int kProducerWarps_, int kProdRegs_, int kConsRegs_>
struct BigTileCfg {
  static constexpr int kConsumerWGs = kConsumerWGs_;
  static constexpr int kMmaM = kMmaM_;
  static constexpr int kNSplit = kNSplit_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kMmaN = kBlockN / kNSplit;
  static constexpr int kNumStages = kNumStages_;
  static constexpr int kRingBoxes = kRingBoxes_;
  static constexpr int kProducerWarps = kProducerWarps_;
  static constexpr bool kSetMaxNReg = kProducerWarps == 4;
  static constexpr int kProdRegs = kProdRegs_;
  static constexpr int kConsRegs = kConsRegs_;
  static constexpr int kBlockM = kConsumerWGs * kMmaM * 64;
  static constexpr int kBlockK = 64;
  static constexpr int kNumConsumerThreads = 128 * kConsumerWGs;
  static constexpr int kThreads = kNumConsumerThreads + 32 * kProducerWarps;
  static constexpr int kAccRegs = kMmaN / 2;
  // launch register cap: __launch_bounds__(kThreads, 1) gives 65536 / kThreads rounded down to a multiple of 8
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8 > 255 ? 255 : (65536 / kThreads) / 8 * 8;
  static constexpr int kABytes = kBlockM * kBlockK * 2;
  static constexpr int kBBytes = kBlockN * kBlockK * 2;
  static constexpr int kAOff = 0;
  static constexpr int kBOff = kAOff + kNumStages * kABytes;
  static constexpr int kBoxBytes = 64 * 128;
  static constexpr int kCOff = kBOff + kNumStages * kBBytes;
  static constexpr int kCBytes = kConsumerWGs * kRingBoxes * kBoxBytes;
  static constexpr int kBarOff = kCOff + kCBytes;
  static constexpr int kOffsOff = kBarOff + 2 * kNumStages * 8;
  static constexpr int kTileOff = kOffsOff + (kMaxGroups + 1) * 4;
  static constexpr int kCurOff = kTileOff + (kMaxGroups + 1) * 4;  // kProducerWarps = 0: load cursor (4 x int32)
  static constexpr int kEnd = kCurOff + 16;
  static constexpr int kSmemBytes = kEnd + 1024;
  static_assert(kSmemBytes <= 232448, "shared memory budget exceeded (227 KB)");
  static_assert(kBlockM <= 256 && kBlockN <= 256, "TMA box dimensions are at most 256");
  static_assert(kMmaN % 64 == 0, "wgmma width: multiple of 64 (staging boxes)");
  static_assert((kRingBoxes & (kRingBoxes - 1)) == 0, "kRingBoxes: power of two");
  static_assert(kProducerWarps == 0 || kProducerWarps == 4, "producer: consumer thread 0 or one warpgroup");
  static_assert(!kSetMaxNReg || (kProdRegs % 8 == 0 && kConsRegs % 8 == 0 && kProdRegs >= 24 && kConsRegs <= 256),
                "setmaxnreg range");
  static_assert(!kSetMaxNReg || 128 * kProdRegs + kNumConsumerThreads * kConsRegs <= kThreads * kLaunchRegs,
                "register split exceeds the launch allocation (setmaxnreg.inc would never return)");
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0, "stages keep 1024-byte swizzle atoms aligned");
};

// V3:  192 x 256, 3 consumer warpgroups each issuing m64n256k16 (128 accumulators), NO producer warps (384
//      threads, launch cap 168 registers, no setmaxnreg): thread 0 issues the TMA loads between its MMAs.
//      Why not the 512-thread form asked for (producer warpgroup, setmaxnreg 32 / 160): ptxas checks every wgmma
//      against the kernel's launch register cap, not the setmaxnreg region's, and m64n256k16 needs >= 154
//      registers: "C7602 Insufficient registers (128) ... Try register target of 154 or higher" (CUDA 13.0).
//      Any CTA of more than 12 warps has a cap of 128 (4 warps on one SM sub-partition), so a separate producer
//      warp does not fit either (416 threads: same error).
// V3s: 192 x 256 as asked (512 threads, producer warpgroup, setmaxnreg 32 / 160), but each consumer covers its 256
//      columns with two m64n128k16 on the same A (compiles; A is read from shared memory twice per k16 step).
// V2:  256 x 192, 2 consumer warpgroups, each two m64n192k16 on the same B (2 x 96 accumulators), producer
//      warpgroup (384 threads, setmaxnreg 24 / 240).
//                        WGs mmaM nsplit  N  stages ring pwarps preg creg
using CfgV3 = BigTileCfg<3, 1, 1, 256, 3, 2, 0, 0, 0>;
using CfgV3s = BigTileCfg<3, 1, 2, 256, 3, 2, 4, 32, 160>;
using CfgV2 = BigTileCfg<2, 2, 1, 192, 3, 2, 4, 24, 240>;

struct BigTileParams {
  const int32_t* group_offsets;  // device int32 [num_groups + 1]
  __nv_bfloat16* d;              // only for rows of partial 64-row fragments (TMA stores do the rest)
  int64_t ldd;
  int32_t m_total;
  int32_t n;
  int32_t k;
  int32_t num_groups;
  int32_t l2_hints;  // bit 0: D stores evict_first, bit 3: B loads evict_last (as MGroupedParams::l2_hints)
  int32_t tile_order;  // vt_gemm_kernel only: 0 = natural, 1 = tall tiles last (see vt_gemm.cuh)
};

// One consumer warpgroup's 64 x kBlockN fp32 fragment -> bf16 D rows [hrow0, hrow0 + 64) (rows < row_end),
// columns [n0, n0 + kBlockN) (< p.n), box by box through the warpgroup's kRingBoxes-deep staging ring.
// `box` counts the boxes this warpgroup has staged in the current tile (ring slot = box % kRingBoxes).
// Only thread wg_tid == 0 issues bulk groups (one per TMA-stored box). Before reusing a slot it waits until at
// most kRingBoxes - 1 of its groups still read shared memory (all of them before a copied-out box).
template <int kBlockN, int kRingBoxes>
__device__ __forceinline__ void store_fragment(const float (&acc)[kBlockN / 2], uint32_t ring, int& box,
                                               uint32_t bar_id, int wg_tid, const CUtensorMap* tmap_d,
                                               const BigTileParams& p, int hrow0, int row_end, int n0) {
  const bool whole = hrow0 + 64 <= row_end;
#pragma unroll
  for (int c = 0; c < kBlockN / 64; ++c) {
    const int col = n0 + 64 * c;
    if (col >= p.n) break;  // uniform across the warpgroup
    const uint32_t slot = ring + static_cast<uint32_t>(box & (kRingBoxes - 1)) * (64 * 128);
    if (wg_tid == 0) {
      if (whole)
        ptx::bulk_wait_group_read<kRingBoxes - 1>();
      else
        ptx::bulk_wait_group_read<0>();
    }
    ptx::named_bar_sync(bar_id, 128);
    deep_gemm::sm90::write_acc_boxes_to_staging<kBlockN, 1>(acc, slot, wg_tid, c);
    if (whole) {
      ptx::fence_proxy_async_smem();  // generic-proxy writes -> visible to the TMA engine
      ptx::named_bar_sync(bar_id, 128);
      if (wg_tid == 0) {
        const uint64_t pol_d = (p.l2_hints & 1) ? ptx::l2_policy_evict_first() : ptx::l2_policy_evict_normal();
        ptx::tma_store_2d_hint(tmap_d, slot, col, hrow0, pol_d);
        ptx::bulk_commit_group();
      }
    } else {
      ptx::named_bar_sync(bar_id, 128);
      // (an opaque copy of the first row keeps ptxas from hoisting the 64-bit row addresses out of the box loop,
      // where they stay live next to the accumulators and spill)
      int r0 = hrow0;
      asm volatile("" : "+r"(r0));
      const int rows = row_end - r0;
#pragma unroll 1
      for (int it = 0; it < 4; ++it) {
        const int idx = it * 128 + wg_tid;
        const int r = idx >> 3;
        const int ch = idx & 7;
        const int gcol = col + ch * 8;
        if (r < rows && gcol < p.n) {
          const uint4 v = ptx::ld_shared_v4(slot + r * 128 + (((ch ^ (r & 7))) << 4));
          *reinterpret_cast<uint4*>(p.d + static_cast<int64_t>(r0 + r) * p.ldd + gcol) = v;
        }
      }
    }
    ++box;
  }
}

template <class C>
__global__ void __launch_bounds__(C::kThreads, 1)
    big_tile_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                         const __grid_constant__ CUtensorMap tmap_d, const BigTileParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  constexpr int kBlockM = C::kBlockM;
  constexpr int kBlockN = C::kBlockN;
  constexpr int kBlockK = C::kBlockK;
  constexpr int kNumStages = C::kNumStages;
  constexpr int kM = C::kMmaM;
  constexpr int kS = C::kNSplit;
  using Mma = typename MmaN<C::kMmaN>::T;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + C::kBarOff);
  uint64_t* empty_bar = full_bar + kNumStages;
  int32_t* s_offs = reinterpret_cast<int32_t*>(smem + C::kOffsOff);
  int32_t* s_tile = reinterpret_cast<int32_t*>(smem + C::kTileOff);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int num_groups = p.num_groups;
  const int n_blocks = ceil_div(p.n, kBlockN);
  const int num_k_blocks = ceil_div(p.k, kBlockK);  // >= 1 (the host asks k >= 8)

  // ---- prologue: barriers, clamped offsets, per-group first tile
  if (tid == 0) {
    deep_gemm::sm90::init_stage_barriers(full_bar, empty_bar, kNumStages, 1, C::kConsumerWGs * 4);
    if constexpr (C::kProducerWarps == 0) {
      int32_t* cur = reinterpret_cast<int32_t*>(smem + C::kCurOff);
      cur[0] = (int)blockIdx.x;  // next tile to load
      cur[1] = 0;                // its next k-block
      cur[2] = 0;                // group cursor
      cur[3] = 0;                // stage loads issued so far
    }
  }
  if (tid == 32) {
    ptx::tma_prefetch_desc(&tmap_a);
    ptx::tma_prefetch_desc(&tmap_b);
    ptx::tma_prefetch_desc(&tmap_d);
  }
  for (int i = tid; i <= num_groups; i += C::kThreads) s_offs[i] = min(max(__ldg(p.group_offsets + i), 0), p.m_total);
  __syncthreads();
  if (warp == 0)
    warp_exclusive_scan_groups(num_groups, lane, s_tile, [&](int g) {
      return ceil_div(max(s_offs[g + 1] - s_offs[g], 0), kBlockM) * n_blocks;
    });
  __syncthreads();
  const int total = s_tile[num_groups];

  struct Work {
    int g;
    int row0;
    int row_end;
    int n0;
  };
  // u increases along each walk, so the group cursor g only moves forward
  auto locate = [&](int u, int& g) -> Work {
    while (s_tile[g + 1] <= u) ++g;
    const int start = s_offs[g];
    const int end = max(s_offs[g + 1], start);
    int nb, mb;
    band_tile(u - s_tile[g], ceil_div(end - start, kBlockM), n_blocks, nb, mb);
    return Work{g, start + mb * kBlockM, end, nb * kBlockN};
  };
  // One stage load (TMA A + B, completing on the stage's full barrier) once the consumers have released it.
  auto load_stage = [&](int stage, uint32_t phase, int kb, const Work& w) {
    bar_wait(&empty_bar[stage], phase ^ 1);
    uint8_t* sa = smem + C::kAOff + stage * C::kABytes;
    uint8_t* sb = smem + C::kBOff + stage * C::kBBytes;
    const uint64_t pol_b = (p.l2_hints & 8) ? ptx::l2_policy_evict_last() : ptx::l2_policy_evict_normal();
    ptx::mbar_arrive_expect_tx(&full_bar[stage], C::kABytes + C::kBBytes);
    ptx::tma_load_2d(sa, &tmap_a, &full_bar[stage], kb * kBlockK, w.row0);
    ptx::tma_load_3d_hint(sb, &tmap_b, &full_bar[stage], kb * kBlockK, w.n0, w.g, pol_b);
  };
  // kProducerWarps = 0, thread 0 only: the next stage load of this CTA's walk, if any. Its cursor is kept in shared
  // memory (volatile accesses), so that it costs the consumer no registers across the mainloop.
  auto load_next = [&]() {
    const uint32_t cur = ptx::smem_addr(smem + C::kCurOff);
    int u = (int)ptx::ld_shared_u32(cur);
    if (u >= total) return;
    int kb = (int)ptx::ld_shared_u32(cur + 4);
    int g = (int)ptx::ld_shared_u32(cur + 8);
    const int cnt = (int)ptx::ld_shared_u32(cur + 12);
    const Work w = locate(u, g);
    load_stage(cnt % kNumStages, static_cast<uint32_t>((cnt / kNumStages) & 1), kb, w);
    if (++kb == num_k_blocks) {
      kb = 0;
      u += (int)gridDim.x;
    }
    ptx::st_shared_u32(cur, (uint32_t)u);
    ptx::st_shared_u32(cur + 4, (uint32_t)kb);
    ptx::st_shared_u32(cur + 8, (uint32_t)g);
    ptx::st_shared_u32(cur + 12, (uint32_t)(cnt + 1));
  };

  if (warp >= C::kConsumerWGs * 4) {
    // ================= producer warpgroup (kProducerWarps = 4): one thread issues TMA
    if constexpr (C::kProducerWarps == 4) {
      if constexpr (C::kSetMaxNReg) ptx::setmaxnreg_dec<C::kProdRegs>();
      if (warp == C::kConsumerWGs * 4 && lane == 0) {
        int stage = 0;
        uint32_t phase = 0;
        int g = 0;
        for (int u = (int)ptx::ctaid_x_volatile(); u < total; u += (int)gridDim.x) {
          const Work w = locate(u, g);
          for (int kb = 0; kb < num_k_blocks; ++kb) {
            load_stage(stage, phase, kb, w);
            deep_gemm::sm90::advance_stage<kNumStages>(stage, phase);
          }
        }
      }
    }
  } else {
    // ================= consumer warpgroups
    if constexpr (C::kSetMaxNReg) ptx::setmaxnreg_inc<C::kConsRegs>();
    if constexpr (C::kProducerWarps == 0) {
      if (tid == 0) {
#pragma unroll 1
        for (int i = 0; i < kNumStages; ++i) load_next();  // fill the ring (fresh stages: no wait)
      }
    }
    const int wg = warp >> 2;
    const int wg_tid = tid & 127;
    const uint32_t smem_base = ptx::smem_addr(smem);
    // Descriptor low halves (start address >> 4) for stage 0 / k-step 0 of this warpgroup's first 64 A rows and
    // of B; high half: SBO 1024 B (8 rows of 128 B), 128-byte swizzle (make_desc_sw128(addr, 0, 1024)).
    const uint32_t a_lo0 = (smem_base + C::kAOff + wg * (kM * 64 * 128)) >> 4;
    const uint32_t b_lo0 = (smem_base + C::kBOff) >> 4;
    constexpr uint32_t kDescHi = (1024u >> 4) | (1u << 30);

    float acc[kM][kS][C::kAccRegs];
    auto fence_acc = [&]() {
#pragma unroll
      for (int m = 0; m < kM; ++m)
#pragma unroll
        for (int s = 0; s < kS; ++s)
#pragma unroll
          for (int i = 0; i < C::kAccRegs; ++i) ptx::reg_fence(acc[m][s][i]);
    };
    // a stage is released by one arrival per consumer warp; with kProducerWarps = 0, thread 0 then loads the
    // next stage of the walk into it (it waits there for the other warpgroups' releases)
    auto release = [&](int s_) {
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(&empty_bar[s_]);
      if constexpr (C::kProducerWarps == 0) {
        if (tid == 0) load_next();
      }
    };
    int stage = 0;
    uint32_t phase = 0;
    int g = 0;
    for (int u = (int)ptx::ctaid_x_volatile(); u < total; u += (int)gridDim.x) {
      // ---- mainloop
#pragma unroll
      for (int m = 0; m < kM; ++m)
#pragma unroll
        for (int s = 0; s < kS; ++s)
#pragma unroll
          for (int i = 0; i < C::kAccRegs; ++i) acc[m][s][i] = 0.f;
      int prev_stage = 0;
      for (int kb = 0; kb < num_k_blocks; ++kb) {
        bar_wait(&full_bar[stage], phase);
        fence_acc();
        ptx::wgmma_fence();
        const uint32_t a_lo = a_lo0 + static_cast<uint32_t>(stage) * (C::kABytes >> 4);
        const uint32_t b_lo = b_lo0 + static_cast<uint32_t>(stage) * (C::kBBytes >> 4);
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) {
#pragma unroll
          for (int s = 0; s < kS; ++s) {
            const uint64_t db = ptx::desc_from_halves(b_lo + s * ((C::kMmaN * 128) >> 4) + kk * (32 >> 4), kDescHi);
#pragma unroll
            for (int m = 0; m < kM; ++m)
              Mma::mma(acc[m][s], ptx::desc_from_halves(a_lo + m * ((64 * 128) >> 4) + kk * (32 >> 4), kDescHi), db,
                       1u);
          }
        }
        ptx::wgmma_commit();
        fence_acc();
        if (kb > 0) {
          ptx::wgmma_wait<1>();
          release(prev_stage);
        }
        prev_stage = stage;
        deep_gemm::sm90::advance_stage<kNumStages>(stage, phase);
      }
      ptx::wgmma_wait<0>();
      release(prev_stage);  // num_k_blocks >= 1
      fence_acc();

      // ---- epilogue
      const Work w = locate(u, g);
      const uint32_t ring = smem_base + C::kCOff + wg * (C::kRingBoxes * C::kBoxBytes);
      int box = 0;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        const int hrow0 = w.row0 + (wg * kM + m) * 64;
        if (hrow0 < w.row_end) {
#pragma unroll
          for (int s = 0; s < kS; ++s)
            store_fragment<C::kMmaN, C::kRingBoxes>(acc[m][s], ring, box, 1 + wg, wg_tid, &tmap_d, p, hrow0,
                                                    w.row_end, w.n0 + s * C::kMmaN);
        }
      }
      // The next tile starts at slot 0: if this one staged a count of boxes that is not a multiple of the ring,
      // slot 0 may still be read by a pending store.
      if (wg_tid == 0 && (box & (C::kRingBoxes - 1)) != 0) ptx::bulk_wait_group_read<0>();
    }
    if (wg_tid == 0) ptx::bulk_wait_group<0>();  // stores done before the CTA's shared memory goes away
  }
#ifdef PROTO_DEBUG
  if (*reinterpret_cast<volatile int*>(&g_spin_timeout) != 0) __trap();
#endif
#endif
}

}  // namespace proto192
