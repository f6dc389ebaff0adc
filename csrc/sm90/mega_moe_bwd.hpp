// prime-kernels: host launch function of the sm90a fused Mega MoE backward (BF16, csrc/sm90/mega_moe_bwd.cuh): the
// L2 dgrad with the SwiGLU backward, the L1 dgrad and, optionally, the weight gradients in one persistent kernel.
//
// Plain C++ over raw device pointers; same conventions as grouped_gemm.hpp (status.hpp's codes, err message,
// asynchronous on `stream`, everything validated before the device is touched).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "grouped_gemm.hpp"
#include "m_blocks.hpp"
#include "status.hpp"

namespace prime_kernels {
namespace sm90 {

// int32 counters the kernel needs (zeroed by the launch itself, on `stream`): one per m-block, one per expert, then
// the task claim.
inline int64_t mega_moe_bwd_counter_count(int64_t m_total, int num_experts) {
  return max_m_blocks(m_total, num_experts) + num_experts + 1;
}

// What MegaBwdArgs::wgrad asks for: no weight-gradient tiles (the caller computes dW2 / dW13 elsewhere), or the
// weight gradients stored as bf16, stored as fp32, or added to fp32 accumulators.
enum MegaBwdWgrad : int { kMegaBwdWgradNone = 0, kMegaBwdWgradBf16 = 1, kMegaBwdWgradF32 = 2, kMegaBwdWgradF32Add = 3 };

// Host-side arguments of mega_moe_bwd_bf16: those of the L2 dgrad (m_grouped_bf16_gemm_swiglu_bwd, every field of
// SwigluBwdGemmArgs with the same meaning; group_offsets = the plan's expert offsets), the L1 dgrad's, and the weight
// gradients'.
struct MegaBwdArgs {
  SwigluBwdGemmArgs l2;
  // bf16 [num_experts, 2 * intermediate, hidden] (the forward's w13, gate rows then up rows), row stride ldw13
  // (>= hidden, % 8 == 0), group stride w13_group_stride (elements, >= 2I * ldw13, % 8 == 0)
  const void* w13 = nullptr;
  int64_t ldw13 = 0;
  int64_t w13_group_stride = 0;
  // bf16 [m_total, hidden] out: dh @ w13_e per pool row (the dX slots), row stride lddx (>= hidden, % 8 == 0)
  void* dx = nullptr;
  int64_t lddx = 0;
  // device int32 [mega_moe_bwd_counter_count(m_total, num_groups)], zeroed here
  int32_t* counters = nullptr;
  // The weight gradients (not read with kMegaBwdWgradNone):
  //   dW2_e = dy_pool_e^T (w * s)_e  -> dw2  [num_groups, hidden, intermediate], contiguous
  //   dW13_e = dh_e^T x_pool_e       -> dw13 [num_groups, 2 * intermediate, hidden], contiguous
  // (the rows of expert e: [group_offsets[e], group_offsets[e + 1])), bf16 for kMegaBwdWgradBf16, else fp32. An
  // expert without rows gets zeros (or adds nothing).
  int wgrad = kMegaBwdWgradNone;
  // bf16 [m_total, hidden]: the token rows in pool order (finite rows in every expert's range), row stride ldx
  // (>= hidden, % 8 == 0)
  const void* x_pool = nullptr;
  int64_t ldx = 0;
  void* dw2 = nullptr;
  void* dw13 = nullptr;
  // The sequence's lag (mega_moe_bwd_schedule.hpp), 0 .. kMegaBwdMaxLagHost, or -1: the heuristic's
  // (mega_bwd_lag). For the benchmark's sweep: any lag gives the same bits.
  int lag = -1;
};

int mega_moe_bwd_bf16(const MegaBwdArgs& args, cudaStream_t stream, char* err, size_t err_len);

}  // namespace sm90
}  // namespace prime_kernels
