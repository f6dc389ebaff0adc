// prime-kernels: the constants, parameters, tensor maps and shared-memory layout of the sm_100a fused forward
// (mega_moe_fwd_sm100.cuh, launched by mega_moe_sm100.cu).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "common/device_check.hpp"

namespace prime_kernels {
namespace sm100 {

constexpr int kMegaSm100Threads = 192;
constexpr int kMegaSm100EpiWarp0 = 2;  // warps 2..5 read tensor memory
constexpr int kMegaSm100EpiWarps = 4;
// Tensor memory: two accumulator stages of 256 fp32 columns (the N = 256 MMA's D), all 512 columns of the SM.
constexpr int kMegaSm100AccCols = 256;
constexpr int kMegaSm100TmemAlloc = 2 * kMegaSm100AccCols;
constexpr int kMegaSm100MaxExperts = 512;

// The tensor maps of one phase, bf16. Loads (128-byte swizzle, zero fill out of bounds): kPhase 1: a = the token
// rows x [num_tokens, hidden] (row stride ld_x; box 64 x 1, read by gather4, four rows at a time; a dummy map
// when there are no tokens, whose rows are then never named), b = w13 [E, 2I, hidden] (box 64 x 128 x 1); kPhase 2: a = s [m_total, inter]
// (box 64 x 128), b = w2 [E, hidden, inter] (box 64 x 256 x 1). Stores (64-byte swizzle, box 32 x 32: one epilogue
// warp's rows and one 32-column chunk): kPhase 1: c = s, d = h [m_total, 2I] (unset when h is null); kPhase 2: c = o.
struct MegaFwdSm100Maps {
  CUtensorMap a;
  CUtensorMap b;
  CUtensorMap c;
  CUtensorMap d;
};

struct MegaFwdSm100Params {
  const int32_t* expert_offsets;  // [num_experts + 1]
  int32_t num_experts;
  int32_t m_total;
  int32_t hidden;
  int32_t inter;
  int32_t n_blocks;  // tiles per m-block in this phase
  int32_t k_blocks;  // 64-wide K steps: hidden / 64 (L1) or inter / 64 (L2)
  // L1's gather: x row of pool row m = pool_src_route[m] / top_k; routes outside [0, num_tokens * top_k) read
  // zeros (those past the end are reported, kCheckMegaFwdRoute)
  const int32_t* pool_src_route;
  int32_t top_k;
  int32_t num_tokens;
  __nv_bfloat16* s;  // [m_total, inter]
  __nv_bfloat16* h;  // [m_total, 2 * inter] or null
  __nv_bfloat16* o;  // [m_total, hidden]
  float clamp;       // 0: none
  float clamp_below; // the bf16 neighbours of clamp (sm90/swiglu_math.cuh, PackBf16x2ClampMasks)
  float clamp_above;
  common::DeviceCheckRecord* check;
};

// Shared memory of one CTA. Stage buffers are 1024-byte aligned (the 128-byte swizzle's atom; the MMA descriptors
// assume base offset 0). Then each epilogue warp's staging area: three 32 x 32 bf16 boxes (2 KB each, in the
// store maps' 64-byte swizzle, whose pattern repeats every 512 bytes): s, gate and up of an L1 chunk, or a
// rotation of three o chunks in L2.
template <int kStages>
struct MegaFwdSm100Layout {
  static constexpr int kABytes = 128 * 64 * 2;
  static constexpr int kBBytes = 256 * 64 * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kOutBoxBytes = 32 * 32 * 2;
  static constexpr int kOutWarpBytes = 3 * kOutBoxBytes;
  static constexpr int kOutOff = kStages * kStageBytes;
  static constexpr int kFullOff = kOutOff + kMegaSm100EpiWarps * kOutWarpBytes;
  static constexpr int kEmptyOff = kFullOff + 8 * kStages;
  static constexpr int kAccFullOff = kEmptyOff + 8 * kStages;  // two accumulator stages
  static constexpr int kAccEmptyOff = kAccFullOff + 16;
  static constexpr int kTmemOff = kAccEmptyOff + 16;
  static constexpr int kGatherOff = kTmemOff + 16;  // int32 [128]: the x row of each row of the L1 tile
  static constexpr int kEnd = kGatherOff + 128 * 4;
  static constexpr int kSmemBytes = kEnd + 1024;  // the dynamic base is aligned up to 1024 in the kernel
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0, "1024-byte aligned stage buffers");
  static_assert(kSmemBytes <= 232448, "sm_100 allows 227 KB of shared memory per CTA");
};

#if defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM103_ALL) || \
    (defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && (__CUDA_ARCH_FAMILY_SPECIFIC__ == 1000))
#define PK_SM100_HAS_TCGEN05 1
#endif

}  // namespace sm100
}  // namespace prime_kernels
