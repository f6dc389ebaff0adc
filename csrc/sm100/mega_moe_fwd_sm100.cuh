// prime-kernels: sm_100a fused MoE forward (BF16), round two: the L1 GEMM with SwiGLU and the L2 GEMM on tcgen05
// (accumulators in tensor memory, operands by TMA), persistent CTAs over a static tile schedule.
//
// Per pool row m of expert e (rows grouped by expert through expert_offsets, the routing plan's order; the same
// contract as csrc/sm90/mega_moe_fwd.cuh, whose host plan drives this kernel unchanged):
//   h[m] = [x_pool[m] @ w13_e[0:I]^T | x_pool[m] @ w13_e[I:2I]^T]   (fp32 in tensor memory; stored as bf16 if asked)
//   s[m] = silu(h~_gate) * h~_up                                     (h~: h rounded as saved; sm90/swiglu_math.cuh,
//                                                                     so both archs round s alike; optional clamp)
//   o[m] = s[m] @ w2_e^T                                             (bf16, pool order: the combine's input)
// The dispatch x -> x_pool is its own launch before this one (dispatch_pool_sm100.cuh).
//
// Structure, chosen to be simple enough to be right before anything here has run (no Blackwell GPU exists for this
// project; this code is compiled and disassembled only, never run on hardware): NOT one fused launch. kPhase = 1 is
// a launch over every L1 tile, kPhase = 2 a second launch over every L2 tile, and s goes through global memory
// between them (stream order publishes it). Each launch is persistent: at most one CTA per SM, and CTA b computes
// tiles b, b + grid, ... of the launch's tile sequence (mega_moe_tiles_sm100.cuh: m-blocks over the experts in
// plan order, 128 rows each and never across an expert, n-blocks fastest). The grid is sized by the bound
// max_m_blocks, since the plan lives on the device; a tile past the plan's last m-block ends a CTA's sequence.
//
// Roles (192 threads, one CTA per SM by its shared memory):
//   warp 0     TMA producer (one thread): A (x_pool or s rows, 128 x 64 boxes) and B (w13 gate + up rows, or w2
//              rows, 256 x 64) into a ring of kStages stages, "full" mbarriers with the transaction count; the
//              ring runs on from one tile into the next;
//   warp 1     allocates all 512 tensor-memory columns: two accumulator stages of 256. One thread issues the
//              tcgen05.mma (M 128, N 256, K 16, four per stage) of this CTA's i-th tile into accumulator i % 2
//              once its "accumulator empty" mbarrier says the epilogue has drained tile i - 2, frees each stage
//              with tcgen05.commit to its "empty" mbarrier, and commits the tile to "accumulator full";
//   warps 2-5  the epilogue: warp w reads tensor-memory lanes 32 (w % 4) .. + 31 (the only lanes a warp may
//              address), so each thread owns one row of the tile; tcgen05.ld 32 columns at a time, SwiGLU (L1) or
//              plain rounding (L2), 16-byte stores of the row's columns, rows past the expert and columns past the
//              tensor not stored; then one arrival per warp on "accumulator empty". While they do this the MMA
//              warp already runs the next tile's mainloop into the other accumulator.
// Every role walks the tile sequence itself (no descriptor is passed between warps); the mbarriers keep them in
// step, each with a phase that flips per use: stage s's k-th use waits parity k & 1, accumulator a's j-th use
// parity j & 1, and a producer (of stages or of accumulators) waits the opposite parity, which a fresh barrier
// passes at once.
//
// Forward progress: no CTA ever waits for another CTA. The only waits are on this CTA's own mbarriers (its TMA
// loads, its MMAs, its own warps), each of which is reached by construction: the producer waits for a stage only
// after the MMA thread was handed it, and the MMA thread commits every stage it waits for; the MMA thread waits
// for an accumulator only after the epilogue warps were handed it (the tile two before), and they arrive on it
// for every tile they wait for. All roles walk the same, finite tile sequence. Every mbarrier wait is bounded in
// debug builds (PK_DEBUG_SPIN_BOUND) and traps with a message. The L2 launch depends on the L1 launch only
// through stream order. A grid of any size therefore completes with any subset of its CTAs resident. The
// tensor-memory allocation can block only while another kernel's CTA on the same SM holds columns; that CTA does
// not wait for this one, and this CTA relinquishes its allocation permit at once.
//
// Known gaps (for the next rounds): epilogue stores straight from registers (a thread per row: each warp store
// touches 32 rows; a staged TMA store would coalesce), the dispatch as a separate launch (the TMA gather4 in
// ptx_sm100.cuh could read the token rows in the L1 producer), L1 and L2 as two launches, single rank only, no
// cluster multicast.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "common/device_check.hpp"
#include "mega_moe_tiles_sm100.cuh"
#include "ptx_sm100.cuh"
#include "sm90/swiglu_math.cuh"

namespace prime_kernels {
namespace sm100 {

constexpr int kMegaSm100Threads = 192;
constexpr int kMegaSm100EpiWarp0 = 2;  // warps 2..5 read tensor memory
constexpr int kMegaSm100EpiWarps = 4;
// Tensor memory: two accumulator stages of 256 fp32 columns (the N = 256 MMA's D), all 512 columns of the SM.
constexpr int kMegaSm100AccCols = 256;
constexpr int kMegaSm100TmemAlloc = 2 * kMegaSm100AccCols;
constexpr int kMegaSm100MaxExperts = 512;

// The tensor maps of one phase: kPhase 1: a = x_pool [m_total, hidden] (box 64 x 128), b = w13 [E, 2I, hidden]
// (box 64 x 128 x 1); kPhase 2: a = s [m_total, inter] (box 64 x 128), b = w2 [E, hidden, inter] (box 64 x 256 x 1).
// bf16, 128-byte swizzle, zero fill out of bounds.
struct MegaFwdSm100Maps {
  CUtensorMap a;
  CUtensorMap b;
};

struct MegaFwdSm100Params {
  const int32_t* expert_offsets;  // [num_experts + 1]
  int32_t num_experts;
  int32_t m_total;
  int32_t hidden;
  int32_t inter;
  int32_t n_blocks;  // tiles per m-block in this phase
  int32_t k_blocks;  // 64-wide K steps: hidden / 64 (L1) or inter / 64 (L2)
  __nv_bfloat16* s;  // [m_total, inter]
  __nv_bfloat16* h;  // [m_total, 2 * inter] or null
  __nv_bfloat16* o;  // [m_total, hidden]
  float clamp;       // 0: none
  float clamp_below; // the bf16 neighbours of clamp (sm90/swiglu_math.cuh, PackBf16x2ClampMasks)
  float clamp_above;
  common::DeviceCheckRecord* check;
};

// Shared memory of one CTA. Stage buffers are 1024-byte aligned (the 128-byte swizzle's atom; the MMA descriptors
// assume base offset 0).
template <int kStages>
struct MegaFwdSm100Layout {
  static constexpr int kABytes = 128 * 64 * 2;
  static constexpr int kBBytes = 256 * 64 * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kFullOff = kStages * kStageBytes;
  static constexpr int kEmptyOff = kFullOff + 8 * kStages;
  static constexpr int kAccFullOff = kEmptyOff + 8 * kStages;  // two accumulator stages
  static constexpr int kAccEmptyOff = kAccFullOff + 16;
  static constexpr int kTmemOff = kAccEmptyOff + 16;
  static constexpr int kEnd = kTmemOff + 16;
  static constexpr int kSmemBytes = kEnd + 1024;  // the dynamic base is aligned up to 1024 in the kernel
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0, "1024-byte aligned stage buffers");
  static_assert(kSmemBytes <= 232448, "sm_100 allows 227 KB of shared memory per CTA");
};

#if defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM103_ALL) || \
    (defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && (__CUDA_ARCH_FAMILY_SPECIFIC__ == 1000))
#define PK_SM100_HAS_TCGEN05 1
#endif

// The L1 epilogue of one thread's row: 32 s columns at a time, from the gate accumulator columns c and the up
// columns 128 + c. Round: sm90's RoundHPlain or RoundHMasks (clamp), the saved h's rounding.
template <typename Round>
__device__ __forceinline__ void mega_sm100_l1_epilogue(const MegaFwdSm100Params& p, uint32_t taddr, int nb,
                                                       int64_t row, bool valid, const Round& round) {
#pragma unroll 1
  for (int c = 0; c < 128; c += 32) {
    const int col = nb * 128 + c;
    if (col >= p.inter) break;  // the same for the whole warp: tcgen05.ld is warp-collective
    uint32_t g[32], u[32];
    ptx::tmem_ld_32x32b_x32(taddr + c, g);
    ptx::tmem_ld_32x32b_x32(taddr + 128 + c, u);
    ptx::tmem_wait_ld();
    if (!valid) continue;
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
    __nv_bfloat16* s_row = p.s + row * p.inter + col;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      ptx::st_global_v4(s_row + 8 * j, make_uint4(sw[4 * j], sw[4 * j + 1], sw[4 * j + 2], sw[4 * j + 3]));
    if (p.h != nullptr) {
      __nv_bfloat16* h_row = p.h + row * (2 * static_cast<int64_t>(p.inter)) + col;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        ptx::st_global_v4(h_row + 8 * j, make_uint4(gw[4 * j], gw[4 * j + 1], gw[4 * j + 2], gw[4 * j + 3]));
        ptx::st_global_v4(h_row + p.inter + 8 * j,
                          make_uint4(uw[4 * j], uw[4 * j + 1], uw[4 * j + 2], uw[4 * j + 3]));
      }
    }
  }
}

// The L2 epilogue of one thread's row: 32 o columns at a time, rounded to bf16.
__device__ __forceinline__ void mega_sm100_l2_epilogue(const MegaFwdSm100Params& p, uint32_t taddr, int nb,
                                                       int64_t row, bool valid) {
#pragma unroll 1
  for (int c = 0; c < 256; c += 32) {
    const int col = nb * 256 + c;
    if (col >= p.hidden) break;
    uint32_t v[32];
    ptx::tmem_ld_32x32b_x32(taddr + c, v);
    ptx::tmem_wait_ld();
    if (!valid) continue;
    uint32_t w[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = ptx::pack_bf16x2(__uint_as_float(v[2 * i]), __uint_as_float(v[2 * i + 1]));
    __nv_bfloat16* o_row = p.o + row * p.hidden + col;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      ptx::st_global_v4(o_row + 8 * j, make_uint4(w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]));
  }
}

template <int kPhase, int kStages>
__global__ void __launch_bounds__(kMegaSm100Threads, 1)
    mega_moe_fwd_sm100_kernel(const __grid_constant__ MegaFwdSm100Maps maps,
                              const __grid_constant__ MegaFwdSm100Params p) {
  static_assert(kPhase == 1 || kPhase == 2, "phase 1: L1 + SwiGLU, phase 2: L2");
#ifdef PK_SM100_HAS_TCGEN05
  using L = MegaFwdSm100Layout<kStages>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kFullOff);
  uint64_t* empty = reinterpret_cast<uint64_t*>(smem + L::kEmptyOff);
  uint64_t* acc_full = reinterpret_cast<uint64_t*>(smem + L::kAccFullOff);
  uint64_t* acc_empty = reinterpret_cast<uint64_t*>(smem + L::kAccEmptyOff);
  uint32_t* tmem_slot = reinterpret_cast<uint32_t*>(smem + L::kTmemOff);
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;

  // Offsets that are not a plan: nothing is written (CTA 0 notes them; the first writer of the record wins).
  if (common::group_offsets_invalid(p.expert_offsets, p.num_experts, p.m_total, p.check,
                                    common::kCheckMegaFwdOffsets))
    return;
  // A CTA without a tile leaves before any allocation (every warp finds the same first tile).
  const int first_tile = static_cast<int>(blockIdx.x);
  const int stride = static_cast<int>(gridDim.x);
  if (mega_sm100_locate(p.expert_offsets, p.num_experts, first_tile / p.n_blocks).expert < 0) return;

  if (warp == 1) {
    if (lane == 0) {
      for (int s = 0; s < kStages; ++s) {
        ptx::mbar_init(&full[s], 1);
        ptx::mbar_init(&empty[s], 1);
      }
      for (int a = 0; a < 2; ++a) {
        ptx::mbar_init(&acc_full[a], 1);
        ptx::mbar_init(&acc_empty[a], kMegaSm100EpiWarps);  // one arrival per epilogue warp
      }
      ptx::fence_mbar_init();
    }
    __syncwarp();
    ptx::tmem_alloc(tmem_slot, kMegaSm100TmemAlloc);
    ptx::tmem_relinquish_alloc_permit();
  }
  if (warp == 0 && lane == 0) {
    ptx::tma_prefetch_desc(&maps.a);
    ptx::tma_prefetch_desc(&maps.b);
  }
  ptx::tcgen05_fence_before();
  __syncthreads();
  ptx::tcgen05_fence_after();
  const uint32_t tmem_base = *tmem_slot;

  if (warp == 0) {
    // Producer: the stage ring runs on across tiles (it counts stage uses, not k-blocks of one tile).
    uint32_t it = 0;
    for (int t = first_tile;; t += stride) {
      const MegaSm100Tile tile = mega_sm100_locate(p.expert_offsets, p.num_experts, t / p.n_blocks);
      if (tile.expert < 0) break;
      const int nb = t % p.n_blocks;
      if (lane == 0) {
        for (int kb = 0; kb < p.k_blocks; ++kb, ++it) {
          const uint32_t st = it % kStages;
          const uint32_t ph = (it / kStages) & 1u;
          ptx::mbar_wait(&empty[st], ph ^ 1u);  // a fresh barrier passes parity 1 at once
          uint8_t* a_dst = smem + st * L::kStageBytes;
          uint8_t* b_dst = a_dst + L::kABytes;
          ptx::mbar_arrive_expect_tx(&full[st], L::kStageBytes);  // out-of-bounds box elements count too
          ptx::tma_load_2d(a_dst, &maps.a, &full[st], kb * 64, tile.row0);
          if (kPhase == 1) {
            ptx::tma_load_3d(b_dst, &maps.b, &full[st], kb * 64, nb * 128, tile.expert);
            ptx::tma_load_3d(b_dst + L::kBBytes / 2, &maps.b, &full[st], kb * 64, p.inter + nb * 128, tile.expert);
          } else {
            ptx::tma_load_3d(b_dst, &maps.b, &full[st], kb * 64, nb * 256, tile.expert);
          }
        }
      }
      __syncwarp();
    }
  } else if (warp == 1) {
    // MMA issuer: tile i of this CTA accumulates into stage i % 2 of tensor memory, once the epilogue has
    // drained what tile i - 2 left there.
    constexpr uint32_t kIdesc = ptx::idesc_bf16_f32<128, 256>();
    uint32_t it = 0, i = 0;
    for (int t = first_tile;; t += stride, ++i) {
      if (mega_sm100_locate(p.expert_offsets, p.num_experts, t / p.n_blocks).expert < 0) break;
      if (lane == 0) {
        const uint32_t acc = i & 1u;
        ptx::mbar_wait(&acc_empty[acc], ((i >> 1) & 1u) ^ 1u);
        ptx::tcgen05_fence_after();
        const uint32_t d_tmem = tmem_base + acc * kMegaSm100AccCols;
        for (int kb = 0; kb < p.k_blocks; ++kb, ++it) {
          const uint32_t st = it % kStages;
          const uint32_t ph = (it / kStages) & 1u;
          ptx::mbar_wait(&full[st], ph);
          ptx::tcgen05_fence_after();
          const uint32_t a_addr = ptx::smem_addr(smem + st * L::kStageBytes);
          const uint32_t b_addr = a_addr + L::kABytes;
#pragma unroll
          for (int k = 0; k < 4; ++k)
            ptx::mma_bf16_ss(d_tmem, ptx::smem_desc_kmajor_sw128(a_addr + 32 * k),
                             ptx::smem_desc_kmajor_sw128(b_addr + 32 * k), kIdesc, kb > 0 || k > 0);
          ptx::mma_commit(&empty[st]);  // the stage is free once these MMAs have read it
        }
        ptx::mma_commit(&acc_full[acc]);
      }
      __syncwarp();
    }
  } else {
    // Epilogue warps 2..5: quarter q = warp % 4 of the tensor-memory lanes, i.e. rows 32 q .. 32 q + 31.
    const int q = warp % 4;
    uint32_t i = 0;
    for (int t = first_tile;; t += stride, ++i) {
      const MegaSm100Tile tile = mega_sm100_locate(p.expert_offsets, p.num_experts, t / p.n_blocks);
      if (tile.expert < 0) break;
      const int nb = t % p.n_blocks;
      const uint32_t acc = i & 1u;
      ptx::mbar_wait(&acc_full[acc], (i >> 1) & 1u);
      ptx::tcgen05_fence_after();
      const int64_t row = static_cast<int64_t>(tile.row0) + q * 32 + lane;
      const bool valid = row < tile.row_end;
      const uint32_t taddr = tmem_base + acc * kMegaSm100AccCols + (static_cast<uint32_t>(q * 32) << 16);
      if (kPhase == 1) {
        if (p.clamp > 0.f)
          mega_sm100_l1_epilogue(p, taddr, nb, row, valid,
                                 sm90::RoundHMasks{p.clamp, p.clamp_below, p.clamp_above});
        else
          mega_sm100_l1_epilogue(p, taddr, nb, row, valid, sm90::RoundHPlain{});
      } else {
        mega_sm100_l2_epilogue(p, taddr, nb, row, valid);
      }
      // Every tensor-memory read of this stage is complete (tcgen05.wait::ld); the MMA warp may overwrite it.
      ptx::tcgen05_fence_before();
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(&acc_empty[acc]);
    }
  }

  // Every tensor-memory read is complete before the barrier; the allocating warp frees.
  ptx::tcgen05_fence_before();
  __syncthreads();
  if (warp == 1) {
    ptx::tcgen05_fence_after();
    ptx::tmem_dealloc(tmem_base, kMegaSm100TmemAlloc);
  }
#elif defined(__CUDA_ARCH__)
  // Built for a target without tcgen05 (CMake compiles this file for 100a, 103a and 100f only): a launch must not
  // return with its outputs unwritten.
  __trap();
#endif
}

}  // namespace sm100
}  // namespace prime_kernels
