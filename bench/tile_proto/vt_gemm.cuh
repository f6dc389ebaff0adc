// proto192 VT: the m-grouped BF16 "nt" GEMM with variable-height tiles (prototype).
//
// Same problem as big_tile_gemm.cuh (D[m, :] = A[m, :] @ B_g^T for m in [offs[g], offs[g+1]), rows outside every
// group untouched) and the same CTA as V3s: 512 threads = 3 consumer warpgroups (warps 0..11) + a producer
// warpgroup (warps 12..15, one thread issues TMA), setmaxnreg 32 / 160, 3 stages of (A 192 x 64 | B 256 x 64) bf16,
// each consumer warpgroup covers its 64 rows x 256 columns with two m64n128k16 per k16 step.
//
// What changes: the tile height. A group of c = 128 q + r rows (0 <= r < 128) is cut into
//   - q - 1 tiles of 128 rows and one "tall" tile of 128 + r rows, if 1 <= r <= 64 and q >= 1 (vt_has_tall);
//   - ceil(c / 128) tiles of 128 rows otherwise (the last one partial, as in our kernel).
// So a tail of at most 64 rows rides along with the group's last full m-block and shares its B stream instead of
// streaming the whole B slice again for a few rows.
// In a 128-row tile consumer warpgroup 2 has no rows; a warpgroup whose 64-row slice starts at or past the tile's
// last row (row_end = min(row0 + height, group end)) is inactive: it only walks the stage ring (waits each full
// barrier, releases the stage) and stores nothing. The producer loads only the active slices of A: one TMA box of
// 64 rows x 64 columns per slice (tensor map box 64 x 64), so a stage's full barrier expects
// n_slices * 8 KB + the B tile (TMA counts the zero-filled bytes of a box that runs past the end of A, so the
// count is the same near the end of A). Rows of an active slice past the group's end (rows of the next group, or
// zero fill past A's end) are computed but never stored.
//
// Tile order (p.tile_order):
//   0 natural: group-major; within a group n-block / m-tile in the bands of band_tile (m-tiles = vt_m_tiles),
//     the tall tile is the group's last m-tile (so it comes last within each n-block of the group).
//   1 tall last: first every regular tile of every group in the same order (a group with a tall tile has
//     vt_m_tiles - 1 regular m-tiles), then all tall tiles, group-major, n-block fastest.
// Every role walks the same static sequence: tile u -> CTA u mod gridDim.x. s_tile[g] = the first tile of group g in
// the first part (natural: all tiles); the tall part is located by a per-walk cursor over the groups (u increases
// along a walk, so the cursor only moves forward; no second per-group table: shared memory is full).
#pragma once

#include "big_tile_gemm.cuh"

namespace proto192 {

using CfgVT = CfgV3s;  // 192 x 256 capacity, 512 threads, 2 x m64n128k16, setmaxnreg 32 / 160

__host__ __device__ __forceinline__ bool vt_has_tall(int c) {
  return c > 128 && (c & 127) != 0 && (c & 127) <= 64;
}
// m-tiles of a group of c rows (the tall tile counts as one)
__host__ __device__ __forceinline__ int vt_m_tiles(int c) { return vt_has_tall(c) ? (c >> 7) : (c + 127) >> 7; }
// tiles of group g (c rows) in the first part of the walk: natural order = all of them; tall-last = all but the tall
__host__ __device__ __forceinline__ int vt_main_tiles(int c, bool tall_last, int n_blocks) {
  return (vt_m_tiles(c) - ((tall_last && vt_has_tall(c)) ? 1 : 0)) * n_blocks;
}


struct VtWork {
  int row0;     // first row of the tile
  int row_end;  // min(row0 + tile height, group end): rows [row0, row_end) are stored
  int g;
  int n0;
};
struct VtCursor {
  int g;   // group of the last tile located in the first part
  int gt;  // group of the last tall tile located in the tall part
  int tb;  // tall tiles of the groups before gt
};

// Tile u of the walk. s_offs: clamped offsets [num_groups + 1]; s_tile: exclusive scan of vt_main_tiles
// (s_tile[num_groups] = total_main); tiles u >= total_main (tall-last order only) are the tall tiles, group-major,
// n-block fastest. cur: the walk's cursor (start {0, 0, 0}; u must not decrease along a walk).
template <int kBlockN>
__host__ __device__ __forceinline__ VtWork vt_locate(int u, VtCursor& cur, const int32_t* s_offs, const int32_t* s_tile,
                                                     int num_groups, int n_blocks, int total_main) {
  VtWork w;
  if (u < total_main) {
    while (s_tile[cur.g + 1] <= u) ++cur.g;
    const int g = cur.g;
    const int start = s_offs[g];
    const int end = max(s_offs[g + 1], start);
    const int c = end - start;
    const bool tall = vt_has_tall(c);
    const int mt = vt_m_tiles(c);
    const int m_main = (s_tile[g + 1] - s_tile[g]) / n_blocks;  // mt, or mt - 1 when the tall tile comes last
    int nb, mb;
    deep_gemm::sm90::band_tile(u - s_tile[g], m_main, n_blocks, nb, mb);
    w.row0 = start + mb * 128;
    w.row_end = min(w.row0 + ((tall && mb == mt - 1) ? 192 : 128), end);
    w.g = g;
    w.n0 = nb * kBlockN;
  } else {
    const int v = u - total_main;
    const int t = v / n_blocks;
    // the t-th group with a tall tile (bounded by the last group: the total guarantees that one exists)
    while (cur.gt < num_groups - 1) {
      const bool tl = vt_has_tall(max(s_offs[cur.gt + 1] - s_offs[cur.gt], 0));
      if (tl && cur.tb == t) break;
      cur.tb += tl ? 1 : 0;
      ++cur.gt;
    }
    const int g = cur.gt;
    const int start = s_offs[g];
    const int end = max(s_offs[g + 1], start);
    w.row0 = start + (((end - start) >> 7) - 1) * 128;
    w.row_end = end;
    w.g = g;
    w.n0 = (v - t * n_blocks) * kBlockN;
  }
  return w;
}

template <class C>
__global__ void __launch_bounds__(C::kThreads, 1)
    vt_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                   const __grid_constant__ CUtensorMap tmap_d, const BigTileParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  static_assert(C::kProducerWarps == 4 && C::kConsumerWGs == 3 && C::kMmaM == 1 && C::kBlockM == 192,
                "VT: 3 consumer warpgroups of 64 rows + a producer warpgroup");
  constexpr int kBlockN = C::kBlockN;
  constexpr int kBlockK = C::kBlockK;
  constexpr int kNumStages = C::kNumStages;
  constexpr int kS = C::kNSplit;
  constexpr int kSliceBytes = 64 * kBlockK * 2;  // one 64-row slice of an A stage (one TMA box)
  using Mma = typename MmaN<C::kMmaN>::T;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + C::kBarOff);
  uint64_t* empty_bar = full_bar + kNumStages;
  int32_t* s_offs = reinterpret_cast<int32_t*>(smem + C::kOffsOff);
  int32_t* s_tile = reinterpret_cast<int32_t*>(smem + C::kTileOff);
  int32_t* s_misc = reinterpret_cast<int32_t*>(smem + C::kCurOff);  // [0]: number of groups with a tall tile

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int num_groups = p.num_groups;
  const int n_blocks = ceil_div(p.n, kBlockN);
  const int num_k_blocks = ceil_div(p.k, kBlockK);  // >= 1 (the host asks k >= 8)
  const bool tall_last = p.tile_order != 0;

  // ---- prologue: barriers, clamped offsets, per-group first tile, number of tall tiles
  if (tid == 0) deep_gemm::sm90::init_stage_barriers(full_bar, empty_bar, kNumStages, 1, C::kConsumerWGs * 4);
  if (tid == 32) {
    ptx::tma_prefetch_desc(&tmap_a);
    ptx::tma_prefetch_desc(&tmap_b);
    ptx::tma_prefetch_desc(&tmap_d);
  }
  for (int i = tid; i <= num_groups; i += C::kThreads) s_offs[i] = min(max(__ldg(p.group_offsets + i), 0), p.m_total);
  __syncthreads();
  if (warp == 0) {
    warp_exclusive_scan_groups(num_groups, lane, s_tile, [&](int g) {
      return vt_main_tiles(max(s_offs[g + 1] - s_offs[g], 0), tall_last, n_blocks);
    });
  } else if (warp == 1) {
    int t = 0;
    for (int base = 0; base < num_groups; base += 32) {
      const int g = base + lane;
      const bool tl = g < num_groups && vt_has_tall(max(s_offs[g + 1] - s_offs[g], 0));
      t += __popc(__ballot_sync(0xffffffffu, tl));
    }
    if (lane == 0) s_misc[0] = t;
  }
  __syncthreads();
  const int total_main = s_tile[num_groups];
  const int total = total_main + (tall_last ? s_misc[0] * n_blocks : 0);

  auto locate = [&](int u, VtCursor& cur) -> VtWork {
    return vt_locate<kBlockN>(u, cur, s_offs, s_tile, num_groups, n_blocks, total_main);
  };

  if (warp >= C::kConsumerWGs * 4) {
    // ================= producer warpgroup: one thread issues TMA
    ptx::setmaxnreg_dec<C::kProdRegs>();
    if (warp == C::kConsumerWGs * 4 && lane == 0) {
      const uint64_t pol_b = (p.l2_hints & 8) ? ptx::l2_policy_evict_last() : ptx::l2_policy_evict_normal();
      int stage = 0;
      uint32_t phase = 0;
      VtCursor cur{0, 0, 0};
      for (int u = (int)ptx::ctaid_x_volatile(); u < total; u += (int)gridDim.x) {
        const VtWork w = locate(u, cur);
        const int n_sl = min(C::kConsumerWGs, ceil_div(w.row_end - w.row0, 64));  // active 64-row slices (>= 1)
        for (int kb = 0; kb < num_k_blocks; ++kb) {
          bar_wait(&empty_bar[stage], phase ^ 1);
          uint8_t* sa = smem + C::kAOff + stage * C::kABytes;
          uint8_t* sb = smem + C::kBOff + stage * C::kBBytes;
          ptx::mbar_arrive_expect_tx(&full_bar[stage], n_sl * kSliceBytes + C::kBBytes);
#pragma unroll 1
          for (int s = 0; s < n_sl; ++s)
            ptx::tma_load_2d(sa + s * kSliceBytes, &tmap_a, &full_bar[stage], kb * kBlockK, w.row0 + 64 * s);
          ptx::tma_load_3d_hint(sb, &tmap_b, &full_bar[stage], kb * kBlockK, w.n0, w.g, pol_b);
          deep_gemm::sm90::advance_stage<kNumStages>(stage, phase);
        }
      }
    }
  } else {
    // ================= consumer warpgroups
    ptx::setmaxnreg_inc<C::kConsRegs>();
    const int wg = warp >> 2;
    const int wg_tid = tid & 127;
    const uint32_t smem_base = ptx::smem_addr(smem);
    // descriptor low halves of stage 0 / k-step 0 (this warpgroup's 64-row slice of A; B), as big_tile_gemm_kernel
    const uint32_t a_lo0 = (smem_base + C::kAOff + wg * kSliceBytes) >> 4;
    const uint32_t b_lo0 = (smem_base + C::kBOff) >> 4;
    constexpr uint32_t kDescHi = (1024u >> 4) | (1u << 30);

    float acc[kS][C::kAccRegs];
    auto fence_acc = [&]() {
#pragma unroll
      for (int s = 0; s < kS; ++s)
#pragma unroll
        for (int i = 0; i < C::kAccRegs; ++i) ptx::reg_fence(acc[s][i]);
    };
    auto release = [&](int s_) {
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(&empty_bar[s_]);
    };
    int stage = 0;
    uint32_t phase = 0;
    VtCursor cur{0, 0, 0};
    for (int u = (int)ptx::ctaid_x_volatile(); u < total; u += (int)gridDim.x) {
      bool active;
      {
        const VtWork w = locate(u, cur);
        active = w.row0 + 64 * wg < w.row_end;
      }
#pragma unroll
      for (int s = 0; s < kS; ++s)
#pragma unroll
        for (int i = 0; i < C::kAccRegs; ++i) acc[s][i] = 0.f;
      // ---- mainloop
      if (!active) {
        // no rows in this warpgroup's slice: walk the ring only (the producer loaded no A rows for it)
        for (int kb = 0; kb < num_k_blocks; ++kb) {
          bar_wait(&full_bar[stage], phase);
          release(stage);
          deep_gemm::sm90::advance_stage<kNumStages>(stage, phase);
        }
      } else {
        int prev_stage = 0;
        for (int kb = 0; kb < num_k_blocks; ++kb) {
          bar_wait(&full_bar[stage], phase);
          fence_acc();
          ptx::wgmma_fence();
          const uint32_t a_lo = a_lo0 + static_cast<uint32_t>(stage) * (C::kABytes >> 4);
          const uint32_t b_lo = b_lo0 + static_cast<uint32_t>(stage) * (C::kBBytes >> 4);
#pragma unroll
          for (int kk = 0; kk < kBlockK / 16; ++kk) {
            const uint64_t da = ptx::desc_from_halves(a_lo + kk * (32 >> 4), kDescHi);
#pragma unroll
            for (int s = 0; s < kS; ++s)
              Mma::mma(acc[s], da,
                       ptx::desc_from_halves(b_lo + s * ((C::kMmaN * 128) >> 4) + kk * (32 >> 4), kDescHi), 1u);
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
      }
      ptx::wgmma_wait<0>();  // unconditional: every accumulator settled on both paths
      fence_acc();

      // ---- epilogue (located again: nothing of the tile stays live across the mainloop but `active`)
      if (active) {
        const VtWork w = locate(u, cur);
        const uint32_t ring = smem_base + C::kCOff + wg * (C::kRingBoxes * C::kBoxBytes);
        const int hrow0 = w.row0 + wg * 64;
        int box = 0;
#pragma unroll
        for (int s = 0; s < kS; ++s)
          store_fragment<C::kMmaN, C::kRingBoxes>(acc[s], ring, box, 1 + wg, wg_tid, &tmap_d, p, hrow0, w.row_end,
                                                  w.n0 + s * C::kMmaN);
        // the next tile starts at slot 0: wait for a pending store of it if this tile staged an odd box count
        if (wg_tid == 0 && (box & (C::kRingBoxes - 1)) != 0) ptx::bulk_wait_group_read<0>();
      }
    }
    if (wg_tid == 0) ptx::bulk_wait_group<0>();  // stores done before the CTA's shared memory goes away
  }
#ifdef PROTO_DEBUG
  if (*reinterpret_cast<volatile int*>(&g_spin_timeout) != 0) __trap();
#endif
#endif
}

}  // namespace proto192
