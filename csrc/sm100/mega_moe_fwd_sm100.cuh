// prime-kernels: sm_100a fused MoE forward (BF16): the L1 GEMM with SwiGLU and the L2 GEMM on tcgen05
// (accumulators in tensor memory, operands by TMA), persistent CTAs over a static tile schedule.
//
// Per pool row m of expert e (rows grouped by expert through expert_offsets, the routing plan's order; the same
// contract as csrc/sm90/mega_moe_fwd.cuh, whose host plan drives this kernel unchanged):
//   h[m] = [x~[m] @ w13_e[0:I]^T | x~[m] @ w13_e[I:2I]^T]   (x~[m] = x[pool_src_route[m] / top_k], zeros for a
//                                                             padding or bad route: x_pool's row, gathered from x
//                                                             by the L1 producer; fp32 in tensor memory; stored
//                                                             as bf16 if asked)
//   s[m] = silu(h~_gate) * h~_up                                     (h~: h rounded as saved; sm90/swiglu_math.cuh,
//                                                                     so both archs round s alike; optional clamp)
//   o[m] = s[m] @ w2_e^T                                             (bf16, pool order: the combine's input)
// x_pool itself is written by a launch of its own (dispatch_pool_sm100.cuh), only when the caller keeps it (o is
// not x_pool); nothing here reads it.
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
//   warp 0     TMA producer: per tile the whole warp turns the tile's 128 pool rows into x row indices (L1;
//              shared memory, 4 per lane); one thread then loads A (L1: 32 tile::gather4 loads of four token
//              rows x 64 columns from x; L2: a 128 x 64 box of s) and B (w13 gate + up rows, or w2 rows, 256 x
//              64) into a ring of kStages stages, "full" mbarriers with the transaction count; the ring runs on
//              from one tile into the next;
//   warp 1     allocates all 512 tensor-memory columns: two accumulator stages of 256. One thread issues the
//              tcgen05.mma (M 128, N 256, K 16, four per stage) of this CTA's i-th tile into accumulator i % 2
//              once its "accumulator empty" mbarrier says the epilogue has drained tile i - 2, frees each stage
//              with tcgen05.commit to its "empty" mbarrier, and commits the tile to "accumulator full";
//   warps 2-5  the epilogue (mega_moe_epilogue_sm100.cuh): warp w reads tensor-memory lanes 32 (w % 4) .. + 31
//              (the only lanes a warp may address), so each thread owns one row of the tile; tcgen05.ld 32
//              columns at a time, SwiGLU (L1) or plain rounding (L2), each row's 64 bytes into the warp's staging
//              box in shared memory, then one TMA store per 32 x 32 box (s, and gate | up of h when asked; o). A
//              warp whose rows run past the expert copies its boxes out with 16-byte generic stores instead,
//              skipping those rows; columns past the tensor are never computed into a store. Then one arrival per
//              warp on "accumulator empty". While they do this the MMA warp already runs the next tile's mainloop
//              into the other accumulator.
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
// Known gaps (for the next rounds): x_pool, when kept, still written by a launch of its own (an L1 tile of
// n-block 0 could TMA-store its gathered A stages), L1 and L2 as two launches, single rank only, no cluster
// multicast.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "common/device_check.hpp"
#include "mega_moe_epilogue_sm100.cuh"
#include "mega_moe_params_sm100.cuh"
#include "mega_moe_tiles_sm100.cuh"
#include "ptx_sm100.cuh"
#include "sm90/swiglu_math.cuh"

namespace prime_kernels {
namespace sm100 {

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
    ptx::tma_prefetch_desc(&maps.c);
    if (kPhase == 1 && p.h != nullptr) ptx::tma_prefetch_desc(&maps.d);
  }
  ptx::tcgen05_fence_before();
  __syncthreads();
  ptx::tcgen05_fence_after();
  const uint32_t tmem_base = *tmem_slot;

  if (warp == 0) {
    // Producer: the stage ring runs on across tiles (it counts stage uses, not k-blocks of one tile).
    int4* const gather = reinterpret_cast<int4*>(smem + L::kGatherOff);
    uint32_t it = 0;
    for (int t = first_tile;; t += stride) {
      const MegaSm100Tile tile = mega_sm100_locate(p.expert_offsets, p.num_experts, t / p.n_blocks);
      if (tile.expert < 0) break;
      const int nb = t % p.n_blocks;
      // The previous tile's gathers took their row indices from registers at issue: the slots are free.
      if (kPhase == 1) mega_sm100_gather_rows(p.pool_src_route, p.top_k, p.num_tokens, tile, gather, p.check);
      __syncwarp();
      if (lane == 0) {
        for (int kb = 0; kb < p.k_blocks; ++kb, ++it) {
          const uint32_t st = it % kStages;
          const uint32_t ph = (it / kStages) & 1u;
          ptx::mbar_wait(&empty[st], ph ^ 1u);  // a fresh barrier passes parity 1 at once
          uint8_t* a_dst = smem + st * L::kStageBytes;
          uint8_t* b_dst = a_dst + L::kABytes;
          ptx::mbar_arrive_expect_tx(&full[st], L::kStageBytes);  // out-of-bounds box elements count too
          if (kPhase == 1) {
            // A straight from the token rows: 32 gathers of four 128-byte rows, each landing where a 128-row
            // tile load would put those rows (the 128-byte swizzle is a function of the shared address).
#pragma unroll 4
            for (int g = 0; g < 32; ++g) {
              const int4 r = gather[g];
              ptx::tma_gather4(a_dst + g * 512, &maps.a, &full[st], kb * 64, r.x, r.y, r.z, r.w);
            }
            ptx::tma_load_3d(b_dst, &maps.b, &full[st], kb * 64, nb * 128, tile.expert);
            ptx::tma_load_3d(b_dst + L::kBBytes / 2, &maps.b, &full[st], kb * 64, p.inter + nb * 128, tile.expert);
          } else {
            ptx::tma_load_2d(a_dst, &maps.a, &full[st], kb * 64, tile.row0);
            ptx::tma_load_3d(b_dst, &maps.b, &full[st], kb * 64, nb * 256, tile.expert);
          }
        }
      }
      __syncwarp();
    }
    // The MMA thread's last tcgen05.commit arrivals on the stage barriers are asynchronous and nothing else waits
    // for them; waiting here, as the producer of one more round would, keeps any of them from landing in shared
    // memory after this CTA has left it to the next one on the SM.
    if (lane == 0) {
      for (int s = 0; s < kStages; ++s, ++it) ptx::mbar_wait(&empty[it % kStages], ((it / kStages) & 1u) ^ 1u);
    }
    __syncwarp();
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
    uint8_t* const out = smem + L::kOutOff + (warp - kMegaSm100EpiWarp0) * L::kOutWarpBytes;
    uint32_t i = 0, seq = 0;
    for (int t = first_tile;; t += stride, ++i) {
      const MegaSm100Tile tile = mega_sm100_locate(p.expert_offsets, p.num_experts, t / p.n_blocks);
      if (tile.expert < 0) break;
      const int nb = t % p.n_blocks;
      const uint32_t acc = i & 1u;
      ptx::mbar_wait(&acc_full[acc], (i >> 1) & 1u);
      ptx::tcgen05_fence_after();
      const int row0 = tile.row0 + q * 32;
      const int rows = min(32, tile.row_end - row0);  // a warp with none reads nothing
      const uint32_t taddr = tmem_base + acc * kMegaSm100AccCols + (static_cast<uint32_t>(q * 32) << 16);
      if (rows > 0) {
        if (kPhase == 1) {
          if (p.clamp > 0.f)
            mega_sm100_l1_epilogue(maps, p, out, taddr, nb, row0, rows,
                                   sm90::RoundHMasks{p.clamp, p.clamp_below, p.clamp_above});
          else
            mega_sm100_l1_epilogue(maps, p, out, taddr, nb, row0, rows, sm90::RoundHPlain{});
        } else {
          mega_sm100_l2_epilogue(maps, p, out, taddr, nb, row0, rows, seq);
        }
      }
      // Every tensor-memory read of this stage is complete (tcgen05.wait::ld); the MMA warp may overwrite it.
      ptx::tcgen05_fence_before();
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(&acc_empty[acc]);
    }
    // The last stores' global writes are done before the CTA (and its shared memory) goes away.
    if (lane == 0) ptx::bulk_wait_group<0>();
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
