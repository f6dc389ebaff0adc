// prime-kernels: the tuning of the fused Mega MoE forward (mega_moe_fwd.cuh, launched by mega_moe.cu): each constant
// with what it was measured against on the H200 (docs/performance.md has the tables), and the configuration the
// launcher takes from them. Plain host C++ (no CUDA headers needed).
#pragma once

#include <cstdint>

namespace prime_kernels {
namespace sm90 {

// The pipeline: 3 stages of 128x256x64 (48 KB each) + the 32 KB half-width staging tile leave room for 11 dispatch
// slots of 4 KB; the three dispatch warps use 3 each. 2 stages with 15 slots were slower (30B 2.92 vs ~2.6 ms);
// 4 stages do not fit beside the slots. The kernel is instantiated for these two values only.
constexpr int kMegaFwdStages = 3;
constexpr int kMegaFwdDispatchSlots = 9;

// Both hand-offs (MegaFwdParams::handoff). The L2 one, measured on the H200: L2 epilogues -46%, consumer cycles
// -1.1% (30B) / -1.2% (235B), layer forward -0.3 to -2% (docs/performance.md).
constexpr int32_t kMegaFwdHandoff = 3;

// MegaFwdParams::disp_split_row as a percentage of the pool at inter = 768, scaled by 768 / inter
// (mega_fwd_dispatch_split_pct), and its floor. The token-major rows land near the end of the dispatch, so the L1
// tiles must not reach them sooner, and the tiles' time per dispatched row grows with inter. Measured on the H200:
// 30B (I = 768) stalls at 25, gains at 35-50; 235B (I = 1536) stalls at 15, gains at 25-50 (the floor keeps a
// margin at T = 4096).
constexpr int kMegaFwdDispatchSplitAt768 = 50;
constexpr int kMegaFwdDispatchSplitMin = 35;

// MegaFwdParams::l2_hints: h, s, o stores evict-first (nothing in this kernel reads them back soon: s is read in the
// L2 phase, after the whole L1 phase); w13 / w2 loads evict-last (16 m-blocks of a band read each B tile in turn,
// while the x_pool, h, s and o streams would push it out between them). Measured on the H200: -2 to -4% in steady
// state at both layer shapes.
constexpr int32_t kMegaFwdL2Hints = 15;

// The share of the pool (percent of m_total, first rows) dispatched in pool order; the rest goes token by token
// (MegaFwdParams::disp_split_row). 100: all of it in pool order.
inline int mega_fwd_dispatch_split_pct(int64_t inter) {
  int64_t pct = (kMegaFwdDispatchSplitAt768 * 768 + inter - 1) / inter;
  if (pct < kMegaFwdDispatchSplitMin) pct = kMegaFwdDispatchSplitMin;
  return static_cast<int>(pct > 100 ? 100 : pct);
}

// The FP8 forward (mega_moe_fwd_fp8.cuh): the FP8 GEMMs' ring, 5 stages of 128 x 128 x 128 e4m3 (32 KB each, two
// scale boxes), beside the L2 epilogue's 32 KB staging tile (its dispatch is a launch of its own: no slots).
constexpr int kMegaFwdFp8Stages = 5;

// The largest lag the backward kernel's shared memory holds (kMegaBwdMaxLag in mega_moe_bwd.cuh).
constexpr int kMegaBwdMaxLagHost = 64;

// What the launcher configures for one forward: the kernel's instantiation and MegaFwdParams' tuning fields.
struct MegaFwdConfig {
  int num_stages;          // stage ring depth (the instantiated kMegaFwdStages)
  int dispatch_slots;      // 4 KB dispatch slots (the instantiated kMegaFwdDispatchSlots)
  int dispatch_split_pct;  // mega_fwd_dispatch_split_pct
  int32_t handoff;         // MegaFwdParams::handoff
  int32_t l2_hints;        // MegaFwdParams::l2_hints
};

inline MegaFwdConfig mega_fwd_config(int64_t inter) {
  MegaFwdConfig c;
  c.num_stages = kMegaFwdStages;
  c.dispatch_slots = kMegaFwdDispatchSlots;
  c.dispatch_split_pct = mega_fwd_dispatch_split_pct(inter);
  c.handoff = kMegaFwdHandoff;
  c.l2_hints = kMegaFwdL2Hints;
  return c;
}

// The fused backward's lag (mega_moe_bwd_schedule.hpp): how many experts' L2-dgrad tiles run ahead of the first
// tiles that wait for an expert's L2 dgrad. Enough to cover one wave (two tiles per SM, one per consumer
// warpgroup), so that with every CTA running an L1-dgrad tile's m-block is done when it is claimed, and no more (the
// later an expert's L1-dgrad tiles run, the further its dh rows have fallen out of L2). From the pool's average
// L2-dgrad tiles per expert (the plan pads each expert to whole 128-row m-blocks). Measured on the FP8 dgrad kernel,
// which shares this sequence (H100, 30B and 235B, T = 4096 and 16384): within 1% of lag 16, where lag 1 took up to
// 1.8x at T = 4096 (its L1-dgrad tiles wait on the m-blocks just released).
inline int mega_bwd_lag(int64_t m_total, int num_experts, int64_t inter, int sms) {
  if (num_experts <= 0) return 0;
  const int64_t tiles_per_expert = (m_total / 128 + num_experts - 1) / num_experts * ((inter + 127) / 128);
  int64_t lag = tiles_per_expert > 0 ? (2 * static_cast<int64_t>(sms) + tiles_per_expert - 1) / tiles_per_expert : 1;
  if (lag < 1) lag = 1;
  if (lag > kMegaBwdMaxLagHost) lag = kMegaBwdMaxLagHost;
  return static_cast<int>(lag);
}

}  // namespace sm90
}  // namespace prime_kernels
