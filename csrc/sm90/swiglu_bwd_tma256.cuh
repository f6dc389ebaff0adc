// prime-kernels: sm90a L2 dgrad with the SwiGLU backward in its epilogue on cooperative 128 x 256 tiles
// (PK_SWIGLU_BWD_KERNEL=tma256, development switch; NOT RUN on a GPU yet: written in session 10 without device time).
//
// The work of swiglu_bwd_pp.cuh (da = dy_pool @ w2_e, then dh, w * s and the d topk_weights partials) with both
// consumer warpgroups on one 128 x 256 tile (m64n256 each, 64 rows) instead of each owning 128 x 128 tiles in turn.
// Why (bench/NOTES.md, session 10): this mainloop alone ran the op's GEMM in 0.603 ms at 30B, T=16384 (90% tensor
// active) against the ping-pong kernel's 0.82 ms for everything, when its tiles were walked with n-blocks fastest
// (a wave of 256-column tiles spans twice the experts; m-fastest re-read dy rows from DRAM); the helper-warp epilogue
// tried there could not keep up. Here the consumers run the ping-pong kernel's epilogue themselves, one 64 x 64
// piece after the other (four per warpgroup), with its TMA traffic: h comes in by TMA into two slots per warpgroup
// (the first two pieces issued before the mainloop), dg and du overwrite g and u in place, w * s goes to a third box,
// and one thread TMA-stores the three boxes. The epilogue is not overlapped with tensor work (the price of the
// larger tile); the prediction in bench/NOTES.md weighs it.
//
// Meant to be bit-identical to the ping-pong kernel (test_swiglu_bwd_tma256_matches_pingpong_bitwise; not yet run):
// each da element sums the same k16 steps in the same order, the epilogue is the same code (swiglu_bwd_piece and
// its neighbours in swiglu_bwd_pp.cuh), and the d topk_weights partial of each 128 columns is summed in the same
// order (per thread: pieces in column order, rows' fragment columns in order; then lanes 1 and 2 apart).
//
// Shared memory: 3 x 48 KB stages + 2 warpgroups x (2 h slots of 16 KB + an 8 KB w * s box) = 224 KB, which leaves
// room for the group tables of at most kTma256MaxGroups experts (with more, the host runs the ping-pong kernel).
#pragma once

#include <cuda.h>

#include "gemm_common.cuh"
#include "m_grouped_gemm.cuh"
#include "swiglu_bwd_pp.cuh"

namespace deep_gemm {
namespace sm90 {

constexpr int kTma256MaxGroups = 128;

template <int kNumStages>
struct SwigluBwdTma256Layout : StageRingLayout<128, 256, 64, kNumStages> {
  using Ring = StageRingLayout<128, 256, 64, kNumStages>;
  static constexpr int kMnBoxBytes = 64 * Ring::kBlockK * 2;  // one 64-column box of B per stage
  static constexpr int kBoxBytes = 64 * 64 * 2;                 // one 64 x 64 bf16 piece, 128-byte swizzle
  static constexpr int kSlotBytes = 2 * kBoxBytes;              // gate and up boxes of one piece
  static constexpr int kHOff = Ring::kRingEnd;                  // per warpgroup: 2 slots
  static constexpr int kAwOff = kHOff + 2 * 2 * kSlotBytes;     // per warpgroup: 1 w*s box
  static constexpr int kBarOff = kAwOff + 2 * kBoxBytes;
  static constexpr int kHBarOff = kBarOff + 2 * kNumStages * 8;  // per warpgroup: 2 slot barriers
  static constexpr int kOffsOff = kHBarOff + 4 * 8;
  static constexpr int kMbOff = kOffsOff + (kTma256MaxGroups + 1) * 4;  // first m-block of each group
  static constexpr int kEnd = kMbOff + (kTma256MaxGroups + 1) * 4;
  static constexpr int kSmemBytes = kEnd + 1024;
  static_assert(kSmemBytes <= Ring::kSmemLimit, "shared memory budget exceeded");
};

template <int kNumStages>
__global__ void __launch_bounds__(kNumThreads, 1)
    m_grouped_swiglu_bwd_tma256_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                                       const __grid_constant__ CUtensorMap tmap_h, const __grid_constant__ CUtensorMap tmap_dh,
                                       const __grid_constant__ CUtensorMap tmap_aw, const MGroupedParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = SwigluBwdTma256Layout<kNumStages>;
  constexpr int kBlockM = L::kBlockM;
  constexpr int kBlockN = L::kBlockN;
  constexpr int kBlockK = L::kBlockK;
  using Mma = ptx::WgmmaBf16<kBlockN, 0, 1>;  // B MN-major
  constexpr int kPieces = kBlockN / 64;       // 64 x 64 pieces per warpgroup and tile

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + L::kBarOff);
  uint64_t* empty_bar = full_bar + kNumStages;
  int32_t* s_offs = reinterpret_cast<int32_t*>(smem + L::kOffsOff);
  int32_t* s_mb = reinterpret_cast<int32_t*>(smem + L::kMbOff);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;

  if (tid == 0) {
    for (int s = 0; s < 4; ++s) ptx::mbar_init(reinterpret_cast<uint64_t*>(smem + L::kHBarOff) + s, 1);
    // empty: the 8 consumer warps (the fence also publishes the h-slot barriers above)
    init_stage_barriers(full_bar, empty_bar, kNumStages, 1, kNumConsumerThreads / 32);
  }
  if (tid == 32) {
    ptx::tma_prefetch_desc(&tmap_a);
    ptx::tma_prefetch_desc(&tmap_b);
    ptx::tma_prefetch_desc(&tmap_h);
    ptx::tma_prefetch_desc(&tmap_dh);
    ptx::tma_prefetch_desc(&tmap_aw);
  }
  // the host guarantees num_groups <= kTma256MaxGroups (the tables' room)
  load_group_offsets_and_mblocks<kBlockM>(p.group_offsets, p.num_groups, p.m_total, s_offs, s_mb);

  // Computed by each role after its setmaxnreg (a value live across the register reconfiguration gets spilled).
  struct Work {
    int g;
    int row0;
    int row_end;
    int n0;
  };
  // Tile order: group-major, then m-block, n-block fastest (see the file comment).
  auto locate = [&](int u, int& g, int n_blocks) -> Work {
    while (s_mb[g + 1] * n_blocks <= u) ++g;
    const int start = s_offs[g];
    const int end = max(s_offs[g + 1], start);
    const int local = u - s_mb[g] * n_blocks;
    const int mb = local / n_blocks;
    return Work{g, start + mb * kBlockM, end, (local - mb * n_blocks) * kBlockN};
  };
  auto num_tiles_of = [&](int n_blocks) -> int {
    return static_cast<int>(ptx::ld_shared_u32(ptx::smem_addr(s_mb + p.num_groups))) * n_blocks;
  };

  if (warp < 4) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (warp == 0 && lane == 0) {
      const int n_blocks = ceil_div(p.n, kBlockN);
      const int num_k_blocks = ceil_div(p.k, kBlockK);
      const int num_tiles = num_tiles_of(n_blocks);
      int stage = 0;
      uint32_t phase = 0;
      int g = 0;
      for (int u = (int)ptx::ctaid_x_volatile(); u < num_tiles; u += (int)gridDim.x) {
        const Work w = locate(u, g, n_blocks);
        for (int kb = 0; kb < num_k_blocks; ++kb) {
          ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
          uint8_t* sa = smem + L::kAOff + stage * L::kABytes;
          uint8_t* sb = smem + L::kBOff + stage * L::kBBytes;
          ptx::mbar_arrive_expect_tx(&full_bar[stage], L::kABytes + L::kBBytes);
          ptx::tma_load_2d(sa, &tmap_a, &full_bar[stage], kb * kBlockK, w.row0);
#pragma unroll
          for (int j = 0; j < kBlockN / 64; ++j)
            ptx::tma_load_3d(sb + j * L::kMnBoxBytes, &tmap_b, &full_bar[stage], w.n0 + 64 * j, kb * kBlockK, w.g);
          advance_stage<kNumStages>(stage, phase);
        }
      }
    }
  } else {
    // ================= consumer warpgroups: rows [64 wg, 64 wg + 64) of each tile =================
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const int wg = (warp >> 2) - 1;
    const int wg_tid = tid - 128 * (wg + 1);
    const int n_blocks = ceil_div(p.n, kBlockN);
    const int num_k_blocks = ceil_div(p.k, kBlockK);
    const int num_tiles = num_tiles_of(n_blocks);
    const uint64_t desc_a0 = ptx::make_desc_sw128(ptx::smem_addr(smem + L::kAOff) + wg * (64 * 128), 0, 1024);
    const uint64_t desc_b0 = ptx::make_desc_sw128(ptx::smem_addr(smem + L::kBOff), L::kMnBoxBytes, 1024);
    const uint32_t a_lo0 = static_cast<uint32_t>(desc_a0), a_hi = static_cast<uint32_t>(desc_a0 >> 32);
    const uint32_t b_lo0 = static_cast<uint32_t>(desc_b0), b_hi = static_cast<uint32_t>(desc_b0 >> 32);
    constexpr uint32_t kBStepBytes = 16 * 128;  // one k16 step of MN-major B
    uint8_t* const hslots = smem + L::kHOff + wg * 2 * L::kSlotBytes;
    const uint32_t hslots_addr = ptx::smem_addr(hslots);
    const uint32_t aw_addr = ptx::smem_addr(smem + L::kAwOff) + wg * L::kBoxBytes;
    uint64_t* const h_full = reinterpret_cast<uint64_t*>(smem + L::kHBarOff) + 2 * wg;
    uint32_t h_phase = 0;  // bit s: parity of slot s's next fill
    // piece q: this warpgroup's 64 rows, columns n0 + 64 q of I (gate) and I + n0 + 64 q (up), into slot q & 1
    auto load_piece = [&](int hrow0, int n0, int q) {  // one thread
      uint8_t* dst = hslots + (q & 1) * L::kSlotBytes;
      ptx::mbar_arrive_expect_tx(&h_full[q & 1], L::kSlotBytes);
      ptx::tma_load_2d(dst, &tmap_h, &h_full[q & 1], n0 + 64 * q, hrow0);
      ptx::tma_load_2d(dst + L::kBoxBytes, &tmap_h, &h_full[q & 1], p.n + n0 + 64 * q, hrow0);
    };
    const int frag_row = 16 * ((wg_tid >> 5) & 3) + (lane >> 2);  // + 8 * hh: this thread's rows of the 64

    float acc[kBlockN / 2];
    int stage = 0;
    uint32_t phase = 0;
    int g = 0;
    for (int u = (int)ptx::ctaid_x_volatile(); u < num_tiles; u += (int)gridDim.x) {
      const Work w = locate(u, g, n_blocks);
      const int hrow0 = w.row0 + 64 * wg;
      const int rows = min(64, w.row_end - hrow0);  // <= 0: this warpgroup has no rows in the tile
      const bool active = rows > 0;
      const int pieces = min(kPieces, (p.n - w.n0) / 64);  // I is a multiple of 64 (host)
      // before the mainloop: the first two h pieces (each slot is free once the last tile's stores have read it)
      if (active && wg_tid == 0) {
        ptx::bulk_wait_group_read<0>();
        load_piece(hrow0, w.n0, 0);
        if (pieces > 1) load_piece(hrow0, w.n0, 1);
      }
      // this thread's two rows' routes (their weights are read after the mainloop: a weight held across it made
      // ptxas serialize the wgmma, C7515)
      int route[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = hrow0 + frag_row + 8 * hh;
        route[hh] = row < w.row_end ? __ldg(p.pool_src_route + row) : -1;
      }
      auto release = [&](int s_) {
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(&empty_bar[s_]);
      };
      consumer_tile_mainloop<Mma, kNumStages, kBlockK, L::kABytes, L::kBBytes, kBStepBytes, false>(
          acc, active, num_k_blocks, full_bar, stage, phase, a_lo0, a_hi, b_lo0, b_hi, release);
      if (active) {  // warpgroup-uniform
        float wgt[2];
        bool routed[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          routed[hh] = route[hh] >= 0;
          wgt[hh] = route[hh] >= 0 ? __ldg(p.route_weights + route[hh]) : 0.f;
        }
        float partial[2] = {0.f, 0.f};
#pragma unroll
        for (int q = 0; q < kPieces; ++q) {
          if (q < pieces) {  // warpgroup-uniform
            const uint32_t gb = hslots_addr + (q & 1) * L::kSlotBytes;
            const uint32_t ub = gb + L::kBoxBytes;
            ptx::mbar_wait(&h_full[q & 1], (h_phase >> (q & 1)) & 1u);
            h_phase ^= 1u << (q & 1);
            if (wg_tid == 0) ptx::bulk_wait_group_read<0>();  // the w*s box: the previous piece's store has read it
            ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
            swiglu_bwd_piece(acc, q, gb, ub, aw_addr, frag_row, lane, wgt, partial, p.clamp);
            ptx::fence_proxy_async_smem();
            ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
            swiglu_bwd_piece_store(p, &tmap_dh, &tmap_aw, gb, ub, aw_addr, w.n0 + 64 * q, hrow0, rows, wg_tid,
                                   kBarEpilogueWg0 + wg);
            if (q + 2 < pieces && wg_tid == 0) {  // refill this slot with the piece two columns on
              ptx::bulk_wait_group_read<0>();
              load_piece(hrow0, w.n0, q + 2);
            }
          }
          if ((q & 1) && q - 1 < pieces) {
            // the partials of columns [n0 + 128 (q / 2), + 128): one per 128 columns, as the ping-pong kernel sums
            // them (its tile is these 128 columns)
            write_dt_partials(p, partial, routed, hrow0, frag_row, w.row_end, w.n0 / 128 + q / 2, lane);
            partial[0] = partial[1] = 0.f;
          }
        }
      }
    }
    if (wg_tid == 0) ptx::bulk_wait_group<0>();  // stores complete before the CTA's shared memory goes away
  }
#endif
}

}  // namespace sm90
}  // namespace deep_gemm
