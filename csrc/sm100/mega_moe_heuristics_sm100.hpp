// prime-kernels: the tile configuration of the sm_100a BF16 fused MoE forward (mega_moe_fwd_sm100.cuh, launched by
// mega_moe_sm100.cu). Plain host C++ (no CUDA headers needed).
//
// UNTUNED: this project has no Blackwell GPU, so not one of these numbers has been measured. Each rule states
// the constraint or the expectation it rests on; the first runs on an sm_100 device should replace the
// expectations with measurements, as mega_moe_heuristics.hpp does for the H200.
#pragma once

#include <cstdint>

namespace prime_kernels {
namespace sm100 {

// Rows per tile: the M of one cta_group::1 tcgen05.mma, so that TMEM lane i holds row i of the tile and each
// epilogue thread owns one row (tensor memory has 128 lanes).
constexpr int kMegaSm100BlockM = 128;
// K per stage: one 128-byte swizzle row of bf16, the widest K a single K-major TMA box with the 128-byte swizzle
// holds; the MMA consumes it in four K = 16 steps.
constexpr int kMegaSm100BlockK = 64;
// L1 tile: 128 columns of the intermediate (s), i.e. 128 gate rows and the 128 matching up rows of w13, one N = 256
// MMA per K step; its fp32 accumulator is 256 of the 512 tensor-memory columns.
constexpr int kMegaSm100L1BlockN = 128;
// L2 tile: 256 columns of hidden, the widest N of one MMA (the same 256 accumulator columns).
constexpr int kMegaSm100L2BlockN = 256;
// Accumulator stages in tensor memory: two, so that the epilogue warps drain tile i's accumulator while the MMA
// warp fills the other with tile i + 1 (the persistent launch's overlap). Each stage is the N = 256 MMA's 256
// fp32 columns, so the CTA allocates all 512 columns of the SM; that is safe because only one CTA of these
// kernels fits on an SM (the stage ring below takes most of shared memory), and another kernel's CTA holding
// columns never waits for ours, so an allocation that has to wait is released in time.
constexpr int kMegaSm100AccStages = 2;
constexpr int kMegaSm100TmemCols = 512;
// Stage ring: each stage is a 128 x 64 A box and a 256 x 64 B box (16 + 32 KB). Four stages (192 KB) plus the
// epilogue's staging boxes (24 KB: three 2 KB boxes per epilogue warp, the most an L1 chunk needs) fit the 227 KB
// of an sm_100 CTA and cover, by expectation only, the HBM latency at one CTA per SM; five stages do not fit.
constexpr int kMegaSm100Stages = 4;

// What the launcher configures for one forward.
struct MegaFwdSm100Config {
  int block_m;       // kMegaSm100BlockM
  int l1_block_n;    // s columns per L1 tile
  int l2_block_n;    // o columns per L2 tile
  int stages;        // stage ring depth (the instantiated kMegaSm100Stages)
  int tmem_cols;     // tensor-memory columns allocated per CTA (kMegaSm100AccStages accumulators)
  int l1_n_blocks;   // L1 tiles per m-block: ceil(inter / l1_block_n)
  int l2_n_blocks;   // L2 tiles per m-block: ceil(hidden / l2_block_n)
};

// The tiles do not depend on the shape yet: hidden and inter only set how many n-blocks there are (a partial last
// n-block computes past the edge and stores only the columns inside it; inter and hidden are multiples of 64).
// Shape-dependent choices (a 64-column L1 tile when inter % 128 == 64, two CTAs sharing B through a cluster when
// the pool is large) wait for measurements.
inline MegaFwdSm100Config mega_fwd_sm100_config(int64_t hidden, int64_t inter) {
  MegaFwdSm100Config c;
  c.block_m = kMegaSm100BlockM;
  c.l1_block_n = kMegaSm100L1BlockN;
  c.l2_block_n = kMegaSm100L2BlockN;
  c.stages = kMegaSm100Stages;
  c.tmem_cols = kMegaSm100TmemCols;
  c.l1_n_blocks = static_cast<int>((inter + c.l1_block_n - 1) / c.l1_block_n);
  c.l2_n_blocks = static_cast<int>((hidden + c.l2_block_n - 1) / c.l2_block_n);
  return c;
}

}  // namespace sm100
}  // namespace prime_kernels
