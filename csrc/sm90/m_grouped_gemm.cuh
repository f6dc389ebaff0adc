// prime-kernels: sm90a m-grouped BF16 GEMM (rows grouped by expert).
//
//   D[m, :] = A[m, :] @ B_g^T   for every row m in [offs[g], offs[g+1]),  g = 0 .. E-1
//
//   A  [M_total, K] bf16, K contiguous (row stride lda).
//   B  K-major  [E, N, K] ("nt", forward passes)   or   MN-major [E, K, N] ("nn", dgrad passes; read
//      through wgmma's transpose bit, no transposed copy).
//   D  [M_total, N] bf16 (row stride ldd). Rows outside every group are not written.
//   offs: device int32 [E+1], non-decreasing, no padding required, empty groups allowed.
//
// Persistent and warp-specialized: one CTA per SM, 384 threads. Warpgroup 0 is the producer (one thread
// issues TMA into a kNumStages-deep mbarrier ring; with kAsyncEpi its warps 1..3 also write finished tiles
// out), warpgroups 1 and 2 are consumers, each owning 64 of the 128 rows of a tile and issuing m64nNk16
// wgmma on the full kBlockN width. The per-group tile starts come from a prologue scan of offs in shared
// memory; every role walks the same static tile sequence, so no tile ids travel between roles.
//
// Tile order: group-major, then n-block, then m-block (m fastest), so CTAs running at the same time share
// the expert's B panel in L2.
//
// kCluster2: CTAs run in clusters of 2 that take adjacent m-blocks (of the global list of m-blocks, in
// group order) for the same n-block. When both m-blocks belong to the same group, each CTA loads half of
// the B tile and multicasts it to both, halving B's L2->SM traffic; a pair that straddles two groups loads
// B per CTA. Both CTAs always run the same number of k-blocks, so their pipelines stay in lockstep (a
// multicast lands at the same stage offset in both). Consumers release a stage in both CTAs.
//
// kGatherA: A is read through a row-index list (a token gather without a materialized copy). The whole
// producer warp copies the tile's A rows with 16-byte cp.async straight into the 128-byte-swizzled layout
// wgmma reads (a 1-D bulk copy could not swizzle), and their completion joins the stage's full barrier
// (cp.async.mbarrier.arrive.noinc); B still comes by TMA.
#pragma once

#include <cuda.h>

#include "gemm_common.cuh"

namespace deep_gemm {
namespace sm90 {

struct MGroupedParams {
  // Gathered A only (kGatherA): A [a_rows, K] row stride lda; pool row m reads A row a_row_index[m]
  // (indices outside [0, a_rows) read zeros).
  const __nv_bfloat16* a;
  int64_t lda;
  const int32_t* a_row_index;
  int32_t a_rows;
  __nv_bfloat16* d;
  int64_t ldd;
  const int32_t* group_offsets;
  int32_t m_total;
  int32_t n;
  int32_t k;
  int32_t num_groups;
};

template <int kBlockN, int kNumStages, bool kAsyncEpi>
struct MGroupedLayout {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockK = 64;
  static constexpr int kABytes = kBlockM * kBlockK * 2;
  static constexpr int kBBytes = kBlockN * kBlockK * 2;
  static constexpr int kAOff = 0;
  static constexpr int kBOff = kAOff + kNumStages * kABytes;
  static constexpr int kCOff = kBOff + kNumStages * kBBytes;
  static constexpr int kCBytes = kAsyncEpi ? AsyncStaging<kBlockN>::kBytes : 2 * kStageBytesPerWg;
  static constexpr int kBarOff = kCOff + kCBytes;
  static constexpr int kOffsOff = kBarOff + (2 * kNumStages + 2) * 8;
  static constexpr int kTileOff = kOffsOff + (kMaxGroups + 1) * 4;
  static constexpr int kEnd = kTileOff + (kMaxGroups + 1) * 4;
  static constexpr int kSmemBytes = kEnd + 1024;  // slack for aligning the base to 1024 B
  static_assert(kSmemBytes <= 232448, "shared memory budget exceeded");
  static_assert(kBlockN % 128 == 0 && kBlockN <= 256, "kBlockN must be 128 or 256");
};

template <int kBlockN, int kNumStages, bool kBKMajor, bool kAsyncEpi, bool kCluster2, bool kGatherA>
__global__ void __launch_bounds__(kNumThreads, 1)
    m_grouped_bf16_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a,
                               const __grid_constant__ CUtensorMap tmap_b, const MGroupedParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = MGroupedLayout<kBlockN, kNumStages, kAsyncEpi>;
  constexpr int kBlockM = L::kBlockM;
  constexpr int kBlockK = L::kBlockK;
  constexpr int kMnBoxBytes = 64 * kBlockK * 2;  // MN-major B: one 64-column box of one stage
  using Mma = ptx::WgmmaBf16<kBlockN, 0, kBKMajor ? 0 : 1>;
  static_assert(!(kGatherA && kCluster2), "gathered A is implemented for single-CTA launches");
  constexpr uint32_t kFullArrivals = kGatherA ? 1 + 32 : 1;  // + one cp.async arrival per producer lane
  // The gathering producer warp needs more registers; the split keeps 128 * P + 256 * C = 384 * 168.
  constexpr uint32_t kProdRegs = kGatherA ? 56 : kProducerRegs;
  constexpr uint32_t kConsRegs = kGatherA ? 224 : kConsumerRegs;
  static_assert(128 * kProdRegs + 256 * kConsRegs <= 384 * 168, "register split exceeds the launch allocation");

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + L::kBarOff);
  uint64_t* empty_bar = full_bar + kNumStages;
  uint64_t* epi_full_bar = empty_bar + kNumStages;  // async epilogue: staging written by the consumers
  uint64_t* epi_empty_bar = epi_full_bar + 1;       // async epilogue: staging drained by the store warps
  int32_t* s_offs = reinterpret_cast<int32_t*>(smem + L::kOffsOff);
  int32_t* s_tile = reinterpret_cast<int32_t*>(smem + L::kTileOff);  // per-group start (tiles or m-blocks)

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int num_groups = p.num_groups;
  const int n_blocks = ceil_div(p.n, kBlockN);
  const int num_k_blocks = ceil_div(p.k, kBlockK);
  const uint32_t cta_rank = kCluster2 ? ptx::cluster_ctarank() : 0;

  // ---- prologue: barriers, offsets (clamped to [0, m_total]), per-group starts
  if (tid == 0) {
    for (int s = 0; s < kNumStages; ++s) {
      ptx::mbar_init(&full_bar[s], kFullArrivals);
      ptx::mbar_init(&empty_bar[s], (kCluster2 ? 2 : 1) * kNumConsumerThreads / 32);
    }
    ptx::mbar_init(epi_full_bar, kNumConsumerThreads / 32);
    ptx::mbar_init(epi_empty_bar, kNumStoreWarps);
    ptx::fence_mbar_init();
  }
  if (tid == 32) {
    ptx::tma_prefetch_desc(&tmap_a);
    ptx::tma_prefetch_desc(&tmap_b);
  }
  for (int i = tid; i <= num_groups; i += kNumThreads) {
    const int v = __ldg(p.group_offsets + i);
    s_offs[i] = min(max(v, 0), p.m_total);
  }
  __syncthreads();
  if (warp == 0) {
    // s_tile[g] = sum over g' < g of (m-blocks of g') * (kCluster2 ? 1 : n_blocks)
    int running = 0;
    for (int base = 0; base < num_groups; base += 32) {
      const int g = base + lane;
      int cnt = 0;
      if (g < num_groups) {
        const int rows = max(s_offs[g + 1] - s_offs[g], 0);
        cnt = ceil_div(rows, kBlockM) * (kCluster2 ? 1 : n_blocks);
      }
      int incl = cnt;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int o = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += o;
      }
      if (g < num_groups) s_tile[g] = running + incl - cnt;
      running += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) s_tile[num_groups] = running;
  }
  if constexpr (kCluster2) {
    ptx::cluster_sync();  // also publishes the barrier inits to the peer CTA
  } else {
    __syncthreads();
  }

  // Work units: tiles (single CTA) or (m-block pair, n-block) units (cluster of 2).
  const int total = s_tile[num_groups];
  const int num_units = kCluster2 ? ceil_div(total, 2) * n_blocks : total;
  const int unit_begin = kCluster2 ? (int)(blockIdx.x >> 1) : (int)blockIdx.x;
  const int unit_step = kCluster2 ? (int)(gridDim.x >> 1) : (int)gridDim.x;

  struct Work {
    int b_group;  // group whose B tile is loaded
    int row0;     // first A row loaded (and stored)
    int row_end;  // rows >= row_end are not stored
    int n0;
    bool mcast;   // B halves multicast within the cluster
  };
  // Each role walks units in increasing order, so the group cursor g only moves forward.
  auto locate = [&](int u, int& g) -> Work {
    Work w;
    if constexpr (!kCluster2) {
      while (s_tile[g + 1] <= u) ++g;
      const int start = s_offs[g];
      const int end = max(s_offs[g + 1], start);
      const int m_blocks = ceil_div(end - start, kBlockM);
      const int local = u - s_tile[g];
      const int nb = local / m_blocks;
      const int mb = local - nb * m_blocks;
      w = Work{g, start + mb * kBlockM, end, nb * kBlockN, false};
    } else {
      const int pair = u / n_blocks;
      const int nb = u - pair * n_blocks;
      const int mb0 = 2 * pair;
      while (s_tile[g + 1] <= mb0) ++g;
      const int mb1 = mb0 + 1;
      const bool has1 = mb1 < total;
      const bool same = !has1 || mb1 < s_tile[g + 1];
      w.n0 = nb * kBlockN;
      w.mcast = same;
      if (cta_rank == 0 || !has1) {
        // rank 0, or rank 1 of the very last (odd) m-block: the latter recomputes rank 0's rows, stores none
        w.b_group = g;
        w.row0 = s_offs[g] + (mb0 - s_tile[g]) * kBlockM;
        w.row_end = cta_rank == 0 ? max(s_offs[g + 1], s_offs[g]) : w.row0;
      } else {
        int g1 = g;
        while (s_tile[g1 + 1] <= mb1) ++g1;
        w.b_group = g1;
        w.row0 = s_offs[g1] + (mb1 - s_tile[g1]) * kBlockM;
        w.row_end = max(s_offs[g1 + 1], s_offs[g1]);
      }
    }
    return w;
  };

  if (warp < 4) {
    // ================= producer warpgroup =================
    ptx::setmaxnreg_dec<kProdRegs>();
    if (warp == 0 && (kGatherA || lane == 0)) {
      int stage = 0;
      uint32_t phase = 0;
      int g = 0;
      for (int u = unit_begin; u < num_units; u += unit_step) {
        const Work w = locate(u, g);
        for (int kb = 0; kb < num_k_blocks; ++kb) {
          ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
          uint8_t* sa = smem + L::kAOff + stage * L::kABytes;
          uint8_t* sb = smem + L::kBOff + stage * L::kBBytes;
          if constexpr (kGatherA) {
            // Lane l copies tile rows l, l + 32, l + 64, l + 96 (eight 16-byte chunks each). The row index is
            // re-read per k-block (an L1 hit) to keep the producer's registers low. (Measured: 8 lanes per
            // row with a per-round index load was 1.7x slower; see bench/NOTES.md.)
            const uint32_t sa_addr = ptx::smem_addr(sa);
            const int k0 = kb * kBlockK;
#pragma unroll 1
            for (int i = 0; i < 4; ++i) {
              const int r = lane + 32 * i;
              const int prow = w.row0 + r;
              const int sr = prow < p.m_total ? __ldg(p.a_row_index + prow) : -1;
              const bool row_ok = sr >= 0 && sr < p.a_rows;
              const __nv_bfloat16* src_row = p.a + (row_ok ? static_cast<int64_t>(sr) * p.lda + k0 : 0);
              const uint32_t dst_row = sa_addr + r * 128;
#pragma unroll
              for (int c = 0; c < 8; ++c) {
                const bool ok = row_ok && k0 + c * 8 < p.k;
                ptx::cp_async_16(dst_row + ((c ^ (r & 7)) << 4), ok ? src_row + c * 8 : p.a, ok ? 16u : 0u);
              }
            }
            ptx::cp_async_mbar_arrive_noinc(&full_bar[stage]);
            if (lane != 0) {
              if (++stage == kNumStages) {
                stage = 0;
                phase ^= 1;
              }
              continue;  // lane 0 issues the B tile below
            }
            ptx::mbar_arrive_expect_tx(&full_bar[stage], L::kBBytes);
          } else {
            ptx::mbar_arrive_expect_tx(&full_bar[stage], L::kABytes + L::kBBytes);
            ptx::tma_load_2d(sa, &tmap_a, &full_bar[stage], kb * kBlockK, w.row0);
          }
          if constexpr (kCluster2) {
            // B is loaded as 2 (K-major: kBlockN/2 rows each) or kBlockN/64 (MN-major) boxes; with multicast
            // this CTA loads its half of them for both CTAs.
            constexpr int kBoxes = kBKMajor ? 2 : kBlockN / 64;
            constexpr int kBoxBytes = kBKMajor ? (kBlockN / 2) * kBlockK * 2 : kMnBoxBytes;
            const int j0 = w.mcast ? (int)cta_rank * (kBoxes / 2) : 0;
            const int j1 = w.mcast ? j0 + kBoxes / 2 : kBoxes;
            for (int j = j0; j < j1; ++j) {
              const int c0 = kBKMajor ? kb * kBlockK : w.n0 + 64 * j;
              const int c1 = kBKMajor ? w.n0 + j * (kBlockN / 2) : kb * kBlockK;
              if (w.mcast)
                ptx::tma_load_3d_multicast(sb + j * kBoxBytes, &tmap_b, &full_bar[stage], c0, c1, w.b_group, 0x3);
              else
                ptx::tma_load_3d(sb + j * kBoxBytes, &tmap_b, &full_bar[stage], c0, c1, w.b_group);
            }
          } else if constexpr (kBKMajor) {
            ptx::tma_load_3d(sb, &tmap_b, &full_bar[stage], kb * kBlockK, w.n0, w.b_group);
          } else {
#pragma unroll
            for (int j = 0; j < kBlockN / 64; ++j)
              ptx::tma_load_3d(sb + j * kMnBoxBytes, &tmap_b, &full_bar[stage], w.n0 + 64 * j, kb * kBlockK,
                               w.b_group);
          }
          if (++stage == kNumStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    } else if (kAsyncEpi && warp >= 1) {
      // store warps: drain the staging tile of every tile of this CTA, in the consumers' order
      const uint32_t staging = ptx::smem_addr(smem + L::kCOff);
      uint32_t epi_phase = 0;
      int g = 0;
      for (int u = unit_begin; u < num_units; u += unit_step) {
        const Work w = locate(u, g);
        ptx::mbar_wait(epi_full_bar, epi_phase);
        copy_staging_to_global<kBlockN>(staging, tid - 32, p.d, p.ldd, w.row0, w.row_end, w.n0, p.n);
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(epi_empty_bar);
        epi_phase ^= 1;
      }
    }
  } else {
    // ================= consumer warpgroups =================
    ptx::setmaxnreg_inc<kConsRegs>();
    const int wg = (warp >> 2) - 1;  // 0 or 1: rows [64*wg, 64*wg + 64) of the tile
    const int wg_tid = tid - 128 * (wg + 1);
    const uint32_t stage_c = ptx::smem_addr(smem + L::kCOff + wg * kStageBytesPerWg);
    const uint32_t a_base = ptx::smem_addr(smem + L::kAOff) + wg * (64 * 128);
    const uint32_t b_base = ptx::smem_addr(smem + L::kBOff);
    // Descriptors for stage 0 / k-step 0; other stages and k-steps add a byte offset >> 4 to the low bits.
    const uint64_t desc_a0 = ptx::make_desc_sw128(a_base, 0, 1024);
    const uint64_t desc_b0 =
        kBKMajor ? ptx::make_desc_sw128(b_base, 0, 1024) : ptx::make_desc_sw128(b_base, kMnBoxBytes, 1024);
    constexpr uint32_t kBStepBytes = kBKMajor ? 32 : 16 * 128;  // one k16 step inside a stage

    float acc[kBlockN / 2];
    int stage = 0;
    uint32_t phase = 0;
    uint32_t epi_phase = 0;
    int g = 0;
    for (int u = unit_begin; u < num_units; u += unit_step) {
      const Work w = locate(u, g);
      // A warpgroup whose 64 rows all lie past the group's end (tail m-block, or the idle half of a cluster
      // pair) only keeps the pipeline moving; the other warpgroup then has the tensor cores to itself.
      const bool active = w.row0 + 64 * wg < w.row_end;
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) acc[i] = 0.f;

      auto release = [&](int s_) {
        __syncwarp();
        if (lane == 0) {
          ptx::mbar_arrive(&empty_bar[s_]);
          if constexpr (kCluster2) ptx::mbar_arrive_cluster(&empty_bar[s_], cta_rank ^ 1);
        }
      };
      int prev_stage = 0;
      if (!active) {
        // no rows to compute: only keep the pipeline moving
        for (int kb = 0; kb < num_k_blocks; ++kb) {
          ptx::mbar_wait(&full_bar[stage], phase);
          release(stage);
          if (++stage == kNumStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      } else {
        for (int kb = 0; kb < num_k_blocks; ++kb) {
          ptx::mbar_wait(&full_bar[stage], phase);
          if constexpr (kGatherA) ptx::fence_proxy_async_smem();  // cp.async wrote A through the generic proxy
#pragma unroll
          for (int i = 0; i < kBlockN / 2; ++i) ptx::reg_fence(acc[i]);
          ptx::wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kBlockK / 16; ++kk) {
            const uint64_t da = desc_a0 + ((stage * L::kABytes + kk * 32) >> 4);
            const uint64_t db = desc_b0 + ((stage * L::kBBytes + kk * kBStepBytes) >> 4);
            Mma::mma(acc, da, db, 1u);
          }
          ptx::wgmma_commit();
#pragma unroll
          for (int i = 0; i < kBlockN / 2; ++i) ptx::reg_fence(acc[i]);
          if (kb > 0) {
            ptx::wgmma_wait<1>();
            release(prev_stage);
          }
          prev_stage = stage;
          if (++stage == kNumStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
      ptx::wgmma_wait<0>();  // unconditional: lets ptxas see every accumulator settled on all paths
      if (active && num_k_blocks > 0) release(prev_stage);
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) ptx::reg_fence(acc[i]);

      if constexpr (kAsyncEpi) {
        ptx::mbar_wait(epi_empty_bar, epi_phase ^ 1);
        write_acc_to_staging<kBlockN>(acc, ptx::smem_addr(smem + L::kCOff), wg, wg_tid);
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(epi_full_bar);
        epi_phase ^= 1;
      } else {
        store_acc_bf16_staged<kBlockN>(acc, stage_c, kBarEpilogueWg0 + wg, wg_tid, p.d, p.ldd, w.row0 + 64 * wg,
                                       w.row_end, w.n0, p.n);
      }
    }
  }
  if constexpr (kCluster2) {
    // Neither CTA may exit while the other can still multicast into it or arrive on its barriers.
    __syncwarp();
    ptx::cluster_sync();
  }
#endif
}

}  // namespace sm90
}  // namespace deep_gemm
