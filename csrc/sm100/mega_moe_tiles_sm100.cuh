// prime-kernels: the static tile schedule of the sm_100a fused forward's persistent launches
// (mega_moe_fwd_sm100.cuh).
//
// Tile t of a launch is m-block t / n_blocks, n-block t % n_blocks: n fastest, so the CTAs running at one time
// read the same A rows and the same expert's weights. CTA b takes tiles b, b + grid, b + 2 grid, ... (a fixed
// stride, no claim counter: nothing in a launch waits on another CTA, so which CTA runs a tile matters only for
// speed). M-blocks are counted over the experts in plan order, ceil(rows / 128) each, never across an expert; the
// first tile whose m-block lies past the plan ends a CTA's sequence (tiles only grow along it).
//
// Every role warp walks the same sequence on its own (the producer, the MMA warp and each epilogue warp call
// mega_sm100_locate per tile), so no tile descriptor has to be handed between warps: the roles stay in step
// through the stage and accumulator mbarriers alone.
#pragma once

#include <cstdint>

#include "common/device_check.hpp"

namespace prime_kernels {
namespace sm100 {

struct MegaSm100Tile {
  int expert;   // < 0: past the plan (the sequence ends)
  int row0;     // first pool row of the m-block
  int row_end;  // end of the expert's rows: rows >= row_end of the tile are not this tile's
};

// Whole warp (shuffles over all 32 lanes): the expert and rows of m-block mb. Experts are scanned 32 at a time,
// a prefix sum of their m-block counts per chunk, until the chunk holding mb; the hit is broadcast to every lane.
__device__ __forceinline__ MegaSm100Tile mega_sm100_locate(const int32_t* expert_offsets, int num_experts, int mb) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  MegaSm100Tile t{-1, 0, 0};
  int before = 0;  // m-blocks of the experts before this chunk of 32
  for (int e0 = 0; e0 < num_experts && before <= mb; e0 += 32) {
    const int e = e0 + lane;
    int start = 0, end = 0, cnt = 0;
    if (e < num_experts) {
      start = __ldg(expert_offsets + e);
      end = __ldg(expert_offsets + e + 1);
      cnt = (end - start + 127) / 128;
    }
    int incl = cnt;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    const int first = before + incl - cnt;
    const bool hit = cnt > 0 && mb >= first && mb < first + cnt;
    const uint32_t who = __ballot_sync(0xffffffffu, hit);
    if (who != 0) {
      const int src = __ffs(static_cast<int>(who)) - 1;
      t.expert = __shfl_sync(0xffffffffu, e, src);
      t.row0 = __shfl_sync(0xffffffffu, start + (mb - first) * 128, src);
      t.row_end = __shfl_sync(0xffffffffu, end, src);
      break;
    }
    before += __shfl_sync(0xffffffffu, incl, 31);
  }
  return t;
}

// Whole warp: the x row each of the 128 rows of an L1 tile reads (gather4 row indices), lane l the rows 4 l ..
// 4 l + 3, into idx[l] (shared memory). -1 (out of the map: the gather reads zeros) for a row past the expert
// (the next tile's; its outputs are not stored), a padding row (route < 0) and a route past num_tokens * top_k,
// which is also reported as the dispatch launch would.
__device__ __forceinline__ void mega_sm100_gather_rows(const int32_t* pool_src_route, int top_k, int num_tokens,
                                                       const MegaSm100Tile& tile, int4* idx,
                                                       common::DeviceCheckRecord* check) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t routes = static_cast<int64_t>(num_tokens) * top_k;
  int r[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int row = tile.row0 + 4 * lane + k;
    const int route = row < tile.row_end ? __ldg(pool_src_route + row) : -1;
    r[k] = route >= 0 && route < routes ? route / top_k : -1;
    if (route >= routes) common::report_device_check(check, common::kCheckMegaFwdRoute, route, routes);
  }
  idx[lane] = make_int4(r[0], r[1], r[2], r[3]);
}

}  // namespace sm100
}  // namespace prime_kernels
