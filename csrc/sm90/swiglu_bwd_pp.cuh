// prime-kernels: sm90a L2 dgrad with the SwiGLU backward in its epilogue, ping-pong consumers. WORK IN
// PROGRESS: compiled, not yet run on a GPU (selected only with PK_SWIGLU_BWD_PP=1, see grouped_gemm.cu).
//
// The work of m_grouped_bf16_gemm_kernel's kSwiGLUBwd mode (da = dy_pool @ w2_g for 128 columns of I, then
// swiglu_bwd_epilogue), but each consumer warpgroup owns whole 128 x 128 tiles and the two take the tensor
// cores in turn (named barriers), so the epilogue (64 KB of h read, 96 KB written per 128 x 128 tile)
// runs while the other warpgroup's mainloop does. Why: in the cooperative kernel that epilogue made the
// fused GEMM slower (1.22 ms at 30B, T=16384) than the nn GEMM plus the separate pool-row kernel (0.95 ms).
// B = w2 [E, H, I] read MN-major (two 64-column TMA boxes per stage, wgmma's transpose bit).
#pragma once

#include <cuda.h>

#include "gemm_common.cuh"
#include "m_grouped_gemm.cuh"

namespace deep_gemm {
namespace sm90 {

template <int kNumStages>
struct SwigluBwdPPLayout {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 128;
  static constexpr int kBlockK = 64;
  static constexpr int kABytes = kBlockM * kBlockK * 2;
  static constexpr int kBBytes = kBlockN * kBlockK * 2;
  static constexpr int kMnBoxBytes = 64 * kBlockK * 2;  // one 64-column box of B per stage
  static constexpr int kAOff = 0;
  static constexpr int kBOff = kAOff + kNumStages * kABytes;
  static constexpr int kBarOff = kBOff + kNumStages * kBBytes;
  static constexpr int kOffsOff = kBarOff + 2 * kNumStages * 8;
  static constexpr int kTileOff = kOffsOff + (kMaxGroups + 1) * 4;
  static constexpr int kEnd = kTileOff + (kMaxGroups + 1) * 4;
  static constexpr int kSmemBytes = kEnd + 1024;
  static_assert(kSmemBytes <= 232448, "shared memory budget exceeded");
};

constexpr uint32_t kBarSwigluTurnWg0 = 5;  // +wg

template <int kNumStages>
__global__ void __launch_bounds__(kNumThreads, 1)
    m_grouped_swiglu_bwd_pp_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                                   const MGroupedParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = SwigluBwdPPLayout<kNumStages>;
  constexpr int kBlockM = L::kBlockM;
  constexpr int kBlockN = L::kBlockN;
  constexpr int kBlockK = L::kBlockK;
  using Mma = ptx::WgmmaBf16<kBlockN, 0, 1>;  // B MN-major
  constexpr int kAcc = kBlockN / 2;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + L::kBarOff);
  uint64_t* empty_bar = full_bar + kNumStages;
  int32_t* s_offs = reinterpret_cast<int32_t*>(smem + L::kOffsOff);
  int32_t* s_tile = reinterpret_cast<int32_t*>(smem + L::kTileOff);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int num_groups = p.num_groups;
  const int n_blocks = ceil_div(p.n, kBlockN);
  const int num_k_blocks = ceil_div(p.k, kBlockK);

  if (tid == 0) {
    for (int s = 0; s < kNumStages; ++s) {
      ptx::mbar_init(&full_bar[s], 1);
      ptx::mbar_init(&empty_bar[s], 4);  // the 4 warps of the consuming warpgroup
    }
    ptx::fence_mbar_init();
  }
  if (tid == 32) {
    ptx::tma_prefetch_desc(&tmap_a);
    ptx::tma_prefetch_desc(&tmap_b);
  }
  for (int i = tid; i <= num_groups; i += kNumThreads) s_offs[i] = min(max(__ldg(p.group_offsets + i), 0), p.m_total);
  __syncthreads();
  if (warp == 0)
    warp_exclusive_scan_groups(num_groups, lane, s_tile, [&](int g) {
      return ceil_div(max(s_offs[g + 1] - s_offs[g], 0), kBlockM) * n_blocks;
    });
  __syncthreads();
  const int num_tiles = s_tile[num_groups];

  struct Work {
    int g;
    int row0;
    int row_end;
    int n0;
  };
  auto locate = [&](int u, int& g) -> Work {  // group-major, then n-block, m-block fastest
    while (s_tile[g + 1] <= u) ++g;
    const int start = s_offs[g];
    const int end = max(s_offs[g + 1], start);
    const int m_blocks = ceil_div(end - start, kBlockM);
    const int local = u - s_tile[g];
    const int nb = local / m_blocks;
    return Work{g, start + (local - nb * m_blocks) * kBlockM, end, nb * kBlockN};
  };

  if (warp < 4) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (warp == 0 && lane == 0) {
      int stage = 0;
      uint32_t phase = 0;
      int g = 0;
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
            ptx::tma_load_3d(sb + j * L::kMnBoxBytes, &tmap_b, &full_bar[stage], w.n0 + 64 * j, kb * kBlockK, w.g);
          if (++stage == kNumStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
  } else {
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const int wg = (warp >> 2) - 1;
    const int wg_tid = tid - 128 * (wg + 1);
    const uint64_t desc_a0 = ptx::make_desc_sw128(ptx::smem_addr(smem + L::kAOff), 0, 1024);
    const uint64_t desc_b0 = ptx::make_desc_sw128(ptx::smem_addr(smem + L::kBOff), L::kMnBoxBytes, 1024);
    const uint32_t a_lo0 = static_cast<uint32_t>(desc_a0), a_hi = static_cast<uint32_t>(desc_a0 >> 32);
    const uint32_t b_lo0 = static_cast<uint32_t>(desc_b0), b_hi = static_cast<uint32_t>(desc_b0 >> 32);
    constexpr uint32_t kHalfADesc = (64 * 128) >> 4;
    constexpr uint32_t kBStepDesc = (16 * 128) >> 4;  // one k16 step of MN-major B

    const int cta = (int)ptx::ctaid_x_volatile();
    const int step = (int)gridDim.x;
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
        stage += num_k_blocks;
        while (stage >= kNumStages) {
          stage -= kNumStages;
          phase ^= 1;
        }
        continue;
      }
      const bool half1 = w.row0 + 64 < w.row_end;
      // the tile's h lines into L2 while the mainloop runs: thread r takes row r's two gate and two up lines
      if (w.row0 + wg_tid < w.row_end) {
        const __nv_bfloat16* hrow = p.h + static_cast<int64_t>(w.row0 + wg_tid) * p.ldh;
#pragma unroll
        for (int c = 0; c < kBlockN; c += 64) {
          if (w.n0 + c < p.n) {
            ptx::prefetch_l2(hrow + w.n0 + c);
            ptx::prefetch_l2(hrow + p.n + w.n0 + c);
          }
        }
      }
      ptx::named_bar_sync(kBarSwigluTurnWg0 + wg, 256);
#pragma unroll
      for (int i = 0; i < kAcc; ++i) {
        acc0[i] = 0.f;
        acc1[i] = 0.f;
      }
      int prev_stage = 0;
      for (int kb = 0; kb < num_k_blocks; ++kb) {
        ptx::mbar_wait(&full_bar[stage], phase);
#pragma unroll
        for (int i = 0; i < kAcc; ++i) {
          ptx::reg_fence(acc0[i]);
          ptx::reg_fence(acc1[i]);
        }
        ptx::wgmma_fence();
        const uint32_t a_lo = a_lo0 + static_cast<uint32_t>(stage) * (L::kABytes >> 4);
        const uint32_t b_lo = b_lo0 + static_cast<uint32_t>(stage) * (L::kBBytes >> 4);
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) {
          const uint64_t db = ptx::desc_from_halves(b_lo + kk * kBStepDesc, b_hi);
          Mma::mma(acc0, ptx::desc_from_halves(a_lo + kk * (32 >> 4), a_hi), db, 1u);
          // unconditional: a divergent wgmma makes ptxas serialize every wgmma in the kernel (C7520); rows
          // past the group's end compute on whatever the TMA box holds and are never stored
          Mma::mma(acc1, ptx::desc_from_halves(a_lo + kHalfADesc + kk * (32 >> 4), a_hi), db, 1u);
        }
        ptx::wgmma_commit();
#pragma unroll
        for (int i = 0; i < kAcc; ++i) {
          ptx::reg_fence(acc0[i]);
          ptx::reg_fence(acc1[i]);
        }
        if (kb > 0) {
          ptx::wgmma_wait<1>();
          __syncwarp();
          if (lane == 0) ptx::mbar_arrive(&empty_bar[prev_stage]);
        }
        prev_stage = stage;
        if (++stage == kNumStages) {
          stage = 0;
          phase ^= 1;
        }
      }
      if (k + 1 < ntiles) ptx::named_bar_arrive(kBarSwigluTurnWg0 + (wg ^ 1), 256);
      ptx::wgmma_wait<0>();
      __syncwarp();
      if (lane == 0 && num_k_blocks > 0) ptx::mbar_arrive(&empty_bar[prev_stage]);

      swiglu_bwd_epilogue<kBlockN>(acc0, wg_tid, w.row0, w.row_end, w.n0, p.n, p.h, p.ldh, p.pool_src_route,
                                   p.route_weights, p.dh, p.lddh, p.aw, p.ldaw, p.dt_part, p.dt_ld, p.clamp);
      if (half1)
        swiglu_bwd_epilogue<kBlockN>(acc1, wg_tid, w.row0 + 64, w.row_end, w.n0, p.n, p.h, p.ldh, p.pool_src_route,
                                     p.route_weights, p.dh, p.lddh, p.aw, p.ldaw, p.dt_part, p.dt_ld, p.clamp);
    }
  }
#endif
}

}  // namespace sm90
}  // namespace deep_gemm
