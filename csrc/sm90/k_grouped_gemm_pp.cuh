// prime-kernels: sm90a k-grouped BF16 GEMM (weight gradients, bf16 out) with ping-pong consumers.
//
// Same problem, tile order and operands as k_grouped_gemm.cuh (C_e = A_e^T @ B_e, both operands MN-major, the
// experts ranked by row count, serpentine rounds), but each consumer warpgroup owns whole 128 x 128 tiles (the
// CTA's tiles alternate between them) and the two take the tensor cores in turn (named barriers), so one's
// epilogue (the bf16 conversion, at 16 per clock per SM, the staging writes and the partial k-block's zeroing)
// runs while the other's MMAs do. That is what an expert with few rows needs: at T = 4096 per rank a 235B
// expert has ~256 rows, four k-blocks per tile, and the cooperative kernel's tensor cores stop for about a
// third of every tile (bench/NOTES.md, session 9). Each output element is accumulated by the same k16 steps in
// the same order as in the cooperative kernel, so the two agree bit for bit.
#pragma once

#include <cuda.h>

#include "gemm_common.cuh"

namespace deep_gemm {
namespace sm90 {

template <int kNumStages>
struct KGroupedPPLayout : StageRingLayout<128, 128, 64, kNumStages> {
  using Ring = StageRingLayout<128, 128, 64, kNumStages>;
  static constexpr int kBoxBytes = 64 * Ring::kBlockK * 2;  // one 64-wide MN block of one stage
  static constexpr int kCOff = Ring::kRingEnd;  // per warpgroup: a 128 x 128 bf16 staging tile (two 64-row halves)
  static constexpr int kCBytes = 2 * 2 * TmaStaging<128>::kHalfBytes;
  static constexpr int kBarOff = kCOff + kCBytes;
  static constexpr int kOffsOff = kBarOff + 2 * kNumStages * 8;
  static constexpr int kOrderOff = kOffsOff + (kMaxGroups + 1) * 4;
  static constexpr int kEnd = kOrderOff + kMaxGroups * 4;
  static constexpr int kSmemBytes = kEnd + 1024;
  static_assert(kSmemBytes <= Ring::kSmemLimit, "shared memory budget exceeded");
};

constexpr uint32_t kBarKGroupedTurnWg0 = 5;  // +wg: "the tensor cores are this warpgroup's"

template <int kNumStages>
__global__ void __launch_bounds__(kNumThreads, 1)
    k_grouped_bf16_gemm_pp_kernel(const __grid_constant__ CUtensorMap tmap_a,
                                  const __grid_constant__ CUtensorMap tmap_b,
                                  const __grid_constant__ CUtensorMap tmap_c, const KGroupedParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = KGroupedPPLayout<kNumStages>;
  constexpr int kBlockM = L::kBlockM;
  constexpr int kBlockN = L::kBlockN;
  constexpr int kBlockK = L::kBlockK;
  constexpr int kBoxBytes = L::kBoxBytes;
  constexpr int kNumBoxes = (kBlockM + kBlockN) / 64;
  constexpr int kAcc = kBlockN / 2;
  constexpr uint32_t kStepDesc = (16 * 128) >> 4;  // a k16 step of an MN-major operand: 16 rows of 128 bytes
  using Mma = ptx::WgmmaBf16<kBlockN, 1, 1>;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + L::kBarOff);
  uint64_t* empty_bar = full_bar + kNumStages;
  int32_t* s_offs = reinterpret_cast<int32_t*>(smem + L::kOffsOff);
  int32_t* s_order = reinterpret_cast<int32_t*>(smem + L::kOrderOff);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int num_groups = p.num_groups;

  // ---- prologue (as k_grouped_bf16_gemm_kernel's)
  if (tid == 0) init_stage_barriers(full_bar, empty_bar, kNumStages, 1, 4);  // empty: the consuming warpgroup's warps
  if (tid == 32) {
    ptx::tma_prefetch_desc(&tmap_a);
    ptx::tma_prefetch_desc(&tmap_b);
    ptx::tma_prefetch_desc(&tmap_c);
  }
  for (int i = tid; i <= num_groups; i += kNumThreads) {
    const int v = __ldg(p.group_offsets + i);
    s_offs[i] = min(max(v, 0), p.p_total);
  }
  __syncthreads();
  for (int e = tid; e < num_groups; e += kNumThreads) {  // order[rank] = expert, by decreasing row count
    const int rows_e = max(s_offs[e + 1] - s_offs[e], 0);
    int rank = 0;
    for (int f = 0; f < num_groups; ++f) {
      const int rows_f = max(s_offs[f + 1] - s_offs[f], 0);
      rank += (rows_f > rows_e) || (rows_f == rows_e && f < e);
    }
    s_order[rank] = e;
  }
  __syncthreads();

  struct Tile {
    int group, k_start, rows, m0, n0;
  };
  // Computed by each role after its setmaxnreg (values live across the register reallocation get spilled).
  struct Walk {
    int m_blocks, tiles_per_group, num_tiles, grid, cta;
    __device__ __forceinline__ Walk(const KGroupedParams& p) {
      m_blocks = ceil_div(p.m, kBlockM);
      tiles_per_group = m_blocks * ceil_div(p.n, kBlockN);
      num_tiles = tiles_per_group * p.num_groups;
      grid = (int)gridDim.x;
      cta = (int)ptx::ctaid_x_volatile();
    }
    // the i-th tile of this CTA (serpentine over rounds of grid tiles); >= num_tiles: none
    __device__ __forceinline__ int tile_of(int i) const { return i * grid + ((i & 1) ? (grid - 1 - cta) : cta); }
    __device__ __forceinline__ Tile locate(int t, const int32_t* s_offs, const int32_t* s_order) const {
      const int slot = t / tiles_per_group;
      const int local = t - slot * tiles_per_group;
      const int e = s_order[slot];
      const int start = s_offs[e];
      const int nb = local / m_blocks;
      return Tile{e, start, max(s_offs[e + 1] - start, 0), (local - nb * m_blocks) * kBlockM, nb * kBlockN};
    }
  };

  if (warp < 4) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (warp == 0 && lane == 0) {
      const Walk wk(p);
      int stage = 0;
      uint32_t phase = 0;
      for (int i = 0; i * wk.grid < wk.num_tiles; ++i) {
        const int t = wk.tile_of(i);
        if (t >= wk.num_tiles) continue;
        const Tile tile = wk.locate(t, s_offs, s_order);
        const int num_k_blocks = ceil_div(tile.rows, kBlockK);
        for (int kb = 0; kb < num_k_blocks; ++kb) {
          ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
          uint8_t* sa = smem + L::kAOff + stage * L::kABytes;
          uint8_t* sb = smem + L::kBOff + stage * L::kBBytes;
          const int krow = tile.k_start + kb * kBlockK;
          ptx::mbar_arrive_expect_tx(&full_bar[stage], L::kABytes + L::kBBytes);
#pragma unroll
          for (int j = 0; j < kBlockM / 64; ++j)
            ptx::tma_load_2d(sa + j * kBoxBytes, &tmap_a, &full_bar[stage], tile.m0 + 64 * j, krow);
#pragma unroll
          for (int j = 0; j < kBlockN / 64; ++j)
            ptx::tma_load_2d(sb + j * kBoxBytes, &tmap_b, &full_bar[stage], tile.n0 + 64 * j, krow);
          advance_stage<kNumStages>(stage, phase);
        }
      }
    }
  } else {
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const Walk wk(p);
    const int wg = (warp >> 2) - 1;
    const int wg_tid = tid - 128 * (wg + 1);
    const uint64_t desc_a0 = ptx::make_desc_sw128(ptx::smem_addr(smem + L::kAOff), kBoxBytes, 1024);
    const uint64_t desc_b0 = ptx::make_desc_sw128(ptx::smem_addr(smem + L::kBOff), kBoxBytes, 1024);
    const uint32_t a_lo0 = static_cast<uint32_t>(desc_a0), a_hi = static_cast<uint32_t>(desc_a0 >> 32);
    const uint32_t b_lo0 = static_cast<uint32_t>(desc_b0), b_hi = static_cast<uint32_t>(desc_b0 >> 32);
    const uint32_t stg = ptx::smem_addr(smem + L::kCOff) + wg * 2 * TmaStaging<128>::kHalfBytes;

    int ntiles = 0;  // this CTA's tiles; the k-th goes to warpgroup k % 2
    for (int i = 0; i * wk.grid < wk.num_tiles; ++i) ntiles += wk.tile_of(i) < wk.num_tiles;
    if (wg == 1 && ntiles > 0) ptx::named_bar_arrive(kBarKGroupedTurnWg0, 256);

    // Last, partial k-block of a tile: this warpgroup zeroes k-rows [valid, 64) of the stage's four boxes (whole
    // 128-byte rows, so the swizzle does not matter) before its MMAs read them: they hold the next expert's rows
    // or the TMA's out-of-bounds zeros.
    struct ZeroPartialKBlock {
      uint8_t* smem;
      int rows, wg_tid;
      uint32_t bar;
      __device__ __forceinline__ void on_stage(int kb, int stage) const {
        const int valid = rows - kb * kBlockK;
        if (valid >= kBlockK) return;
        const int per_box = (kBlockK - valid) * 8;
        const uint32_t sa = ptx::smem_addr(smem + L::kAOff + stage * L::kABytes);
        const uint32_t sb = ptx::smem_addr(smem + L::kBOff + stage * L::kBBytes);
        for (int idx = wg_tid; idx < per_box * kNumBoxes; idx += 128) {
          const int box = idx / per_box;
          const int rem = idx - box * per_box;
          const int r = valid + (rem >> 3);
          const uint32_t base = box < kBlockM / 64 ? sa + box * kBoxBytes : sb + (box - kBlockM / 64) * kBoxBytes;
          ptx::st_shared_v4(base + r * 128 + (rem & 7) * 16, make_uint4(0, 0, 0, 0));
        }
        ptx::fence_proxy_async_smem();
        ptx::named_bar_sync(bar, 128);
      }
    };

    float acc0[kAcc], acc1[kAcc];
    int stage = 0;
    uint32_t phase = 0;
    int k = 0;
    for (int i = 0; i * wk.grid < wk.num_tiles; ++i) {
      const int t = wk.tile_of(i);
      if (t >= wk.num_tiles) continue;
      const Tile tile = wk.locate(t, s_offs, s_order);
      const int num_k_blocks = ceil_div(tile.rows, kBlockK);
      if ((k++ & 1) != wg) {
        skip_stages<kNumStages>(stage, phase, num_k_blocks);
        continue;
      }
      ptx::named_bar_sync(kBarKGroupedTurnWg0 + wg, 256);
      pingpong_tile_mainloop<Mma, kNumStages, kBlockK, L::kABytes, L::kBBytes, kStepDesc, kStepDesc>(
          acc0, acc1, num_k_blocks, full_bar, empty_bar, stage, phase, a_lo0, a_hi, b_lo0, b_hi, lane,
          [&] {
            if (k < ntiles) ptx::named_bar_arrive(kBarKGroupedTurnWg0 + (wg ^ 1), 256);
          },
          ZeroPartialKBlock{smem, tile.rows, wg_tid, kBarEpilogueWg0 + wg});

      // Epilogue: both 64-row halves into this warpgroup's staging tile, then one TMA store per 64 x 64 box (the
      // 3-D map clips rows >= M and columns >= N). The previous tile's stores have long read the staging tile.
      if (wg_tid == 0) ptx::bulk_wait_group_read<0>();
      ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
      write_acc_boxes_to_staging<kBlockN, kBlockN / 64>(acc0, stg, wg_tid, 0);
      write_acc_boxes_to_staging<kBlockN, kBlockN / 64>(acc1, stg + TmaStaging<128>::kHalfBytes, wg_tid, 0);
      ptx::fence_proxy_async_smem();
      ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
      if (wg_tid == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int b = 0; b < kBlockN / 64; ++b)
            if (tile.m0 + 64 * h < p.m && tile.n0 + 64 * b < p.n)
              ptx::tma_store_3d(&tmap_c, stg + h * TmaStaging<128>::kHalfBytes + b * TmaStaging<128>::kBoxBytes,
                                tile.n0 + 64 * b, tile.m0 + 64 * h, tile.group);
        }
        ptx::bulk_commit_group();
      }
    }
    if (wg_tid == 0) ptx::bulk_wait_group<0>();
  }
#endif
}

}  // namespace sm90
}  // namespace deep_gemm
