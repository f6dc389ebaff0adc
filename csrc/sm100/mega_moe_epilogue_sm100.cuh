// prime-kernels: the epilogue of the sm_100a fused forward's tiles (mega_moe_fwd_sm100.cuh): tensor memory ->
// registers -> the warp's staging boxes in shared memory -> global memory.
//
// Each epilogue warp owns 32 rows of a tile (its tensor-memory lane quarter) and works in 32-column chunks: one
// tcgen05.ld of 32 columns gives each thread 32 values of its own row, so the rounding and SwiGLU need no data
// from other threads. The thread writes its row's 64 bytes into the warp's 32 x 32 box in the store map's 64-byte
// swizzle (16-byte chunk j of row r at chunk j ^ ((r / 2) % 4)): the eight rows one shared-memory store phase
// serves then fall on eight different 16-byte bank groups, where the plain layout would put two rows on each.
// One lane issues a TMA store of the box (32 rows of 64 contiguous bytes). A TMA store clips only at the
// tensor's end, not at the expert's: a warp whose rows run past the expert's last row (in an expert's last
// m-block) copies the box out with 16-byte generic stores instead, four lanes per 64-byte row segment, the rows
// past the expert skipped, since the next expert's tile owns them.
//
// Staging reuse: a box is rewritten only after the bulk group that read it has finished reading
// (cp.async.bulk.wait_group.read by lane 0, then __syncwarp). Lane 0 commits one bulk group per chunk, an empty
// one when the chunk went out by generic stores, so "at most N groups pending" always means "every chunk but the
// last N has been read".
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "mega_moe_params_sm100.cuh"
#include "ptx_sm100.cuh"
#include "sm90/swiglu_math.cuh"

namespace prime_kernels {
namespace sm100 {

// Byte offset of 16-byte chunk j of row r in a 32 x 32 bf16 box under the 64-byte swizzle (the box base is
// 512-byte aligned, so the address bits the swizzle reads are the offset's).
__device__ __forceinline__ uint32_t mega_sm100_box_off(int r, int j) {
  return static_cast<uint32_t>(r * 64 + ((j ^ ((r >> 1) & 3)) << 4));
}

// Whole warp: lane r writes the 16 packed bf16 pairs of its row r into box.
__device__ __forceinline__ void mega_sm100_stage_row(uint8_t* box, const uint32_t (&w)[16]) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int j = 0; j < 4; ++j)
    ptx::st_shared_v4(box + mega_sm100_box_off(lane, j), make_uint4(w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]));
}

// Whole warp: the first `rows` rows of box to dst (row stride ld elements), eight rows per 16-byte store.
__device__ __forceinline__ void mega_sm100_copy_out(const uint8_t* box, __nv_bfloat16* dst, int64_t ld, int rows) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int j = lane % 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = 8 * i + lane / 4;
    if (r < rows) ptx::st_global_v4(dst + r * ld + 8 * j, ptx::ld_shared_v4(box + mega_sm100_box_off(r, j)));
  }
}

// Whole warp, once every lane has staged its row of each box: boxes[i] goes to column cols[i] of rows row0 ..
// row0 + 31 of maps[i] (the tensor at base[i], row stride ld[i]); by TMA when all 32 rows are the tile's, else
// rows 0 .. rows - 1 by generic stores. Lane 0 then closes the chunk's bulk group.
template <int kBoxes>
__device__ __forceinline__ void mega_sm100_emit(const CUtensorMap* const (&maps)[kBoxes], uint8_t* const (&boxes)[kBoxes],
                                                __nv_bfloat16* const (&base)[kBoxes], const int64_t (&ld)[kBoxes],
                                                const int (&cols)[kBoxes], int row0, int rows) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (rows == 32) {
    ptx::fence_proxy_async_smem();  // each lane's st.shared, before lane 0's TMA store reads them
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < kBoxes; ++i) ptx::tma_store_2d(maps[i], boxes[i], cols[i], row0);
    }
  } else {
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kBoxes; ++i) mega_sm100_copy_out(boxes[i], base[i] + row0 * ld[i] + cols[i], ld[i], rows);
  }
  if (lane == 0) ptx::bulk_commit_group();
}

// The L1 epilogue of one warp's 32 rows (row0 .. row0 + 31, the first `rows` of them the tile's; rows >= 1):
// 32 s columns at a time from the gate accumulator columns c and the up columns 128 + c. Round: sm90's
// RoundHPlain or RoundHMasks (clamp), the saved h's rounding. out: the warp's three staging boxes (s, gate, up).
template <typename Round>
__device__ __forceinline__ void mega_sm100_l1_epilogue(const MegaFwdSm100Maps& maps, const MegaFwdSm100Params& p,
                                                       uint8_t* out, uint32_t taddr, int nb, int row0, int rows,
                                                       const Round& round) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  uint8_t* const s_box = out;
  uint8_t* const g_box = out + 2048;
  uint8_t* const u_box = out + 4096;
#pragma unroll 1
  for (int c = 0; c < 128; c += 32) {
    const int col = nb * 128 + c;
    if (col >= p.inter) break;  // the same for the whole warp: tcgen05.ld is warp-collective
    uint32_t g[32], u[32];
    ptx::tmem_ld_32x32b_x32(taddr + c, g);
    ptx::tmem_ld_32x32b_x32(taddr + 128 + c, u);
    ptx::tmem_wait_ld();
    uint32_t sw[16], gw[16], uw[16];
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      float g0 = __uint_as_float(g[i]), g1 = __uint_as_float(g[i + 1]);
      float u0 = __uint_as_float(u[i]), u1 = __uint_as_float(u[i + 1]);
      round.gate(g0, g1);
      round.up(u0, u1);
      gw[i / 2] = sm90::PackBf16x2Exact{}(g0, g1);
      uw[i / 2] = sm90::PackBf16x2Exact{}(u0, u1);
      sw[i / 2] = ptx::pack_bf16x2(sm90::swiglu_value(g0, u0, p.clamp), sm90::swiglu_value(g1, u1, p.clamp));
    }
    // All three boxes are rewritten per chunk: the previous chunk's stores must have read them all.
    if (lane == 0) ptx::bulk_wait_group_read<0>();
    __syncwarp();
    mega_sm100_stage_row(s_box, sw);
    if (p.h != nullptr) {
      mega_sm100_stage_row(g_box, gw);
      mega_sm100_stage_row(u_box, uw);
      const int64_t ld_h = 2 * static_cast<int64_t>(p.inter);
      mega_sm100_emit<3>({&maps.c, &maps.d, &maps.d}, {s_box, g_box, u_box}, {p.s, p.h, p.h},
                         {static_cast<int64_t>(p.inter), ld_h, ld_h}, {col, col, p.inter + col}, row0, rows);
    } else {
      mega_sm100_emit<1>({&maps.c}, {s_box}, {p.s}, {static_cast<int64_t>(p.inter)}, {col}, row0, rows);
    }
  }
}

// The L2 epilogue of one warp's 32 rows: 32 o columns at a time, rounded to bf16, through the warp's three boxes
// in turn (seq counts this warp's chunks over all its tiles, so the rotation and the bulk groups stay in step).
__device__ __forceinline__ void mega_sm100_l2_epilogue(const MegaFwdSm100Maps& maps, const MegaFwdSm100Params& p,
                                                       uint8_t* out, uint32_t taddr, int nb, int row0, int rows,
                                                       uint32_t& seq) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll 1
  for (int c = 0; c < 256; c += 32, ++seq) {
    const int col = nb * 256 + c;
    if (col >= p.hidden) break;
    uint32_t v[32];
    ptx::tmem_ld_32x32b_x32(taddr + c, v);
    ptx::tmem_wait_ld();
    uint32_t w[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = ptx::pack_bf16x2(__uint_as_float(v[2 * i]), __uint_as_float(v[2 * i + 1]));
    uint8_t* const box = out + (seq % 3) * 2048;
    // This box was last used three chunks ago: at most two later groups may still be reading.
    if (lane == 0) ptx::bulk_wait_group_read<2>();
    __syncwarp();
    mega_sm100_stage_row(box, w);
    mega_sm100_emit<1>({&maps.c}, {box}, {p.o}, {static_cast<int64_t>(p.hidden)}, {col}, row0, rows);
  }
}

}  // namespace sm100
}  // namespace prime_kernels
