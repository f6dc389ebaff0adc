// prime-kernels: host launch function of the sm90a fused FP8 Mega MoE backward (csrc/sm90/mega_moe_bwd_fp8.cuh): the
// FP8 L2 dgrad with the SwiGLU backward and its quantizing epilogue (m_grouped_fp8_gemm_swiglu_bwd's tiles) and the
// FP8 L1 dgrad (m_grouped_fp8_gemm_nt's tiles on qK(dh)) in one persistent kernel. The weight gradients stay with
// k_grouped_fp8_gemm_tn, on the qT operands this kernel writes.
//
// Plain C++ over raw device pointers; same conventions as grouped_gemm_fp8.hpp (status.hpp's codes, err message,
// asynchronous on `stream`, everything validated before the device is touched).
#pragma once

#include <cstddef>
#include <cstdint>

#include "grouped_gemm_fp8.hpp"
#include "m_blocks.hpp"
#include "status.hpp"

namespace prime_kernels {
namespace sm90 {

// The most experts (groups) the kernel takes: its per-expert tables in shared memory are sized for them, which leaves
// room for a fourth ring stage (mega_moe_bwd_fp8.cuh).
constexpr int kMegaBwdFp8MaxExpertsHost = 256;

// int32 counters the kernel needs (zeroed by the launch itself, on `stream`): one per m-block, one per expert, then
// the task claim (the BF16 fused backward's count).
inline int64_t mega_moe_bwd_fp8_counter_count(int64_t m_total, int num_experts) {
  return max_m_blocks(m_total, num_experts) + num_experts + 1;
}

// Host-side arguments of mega_moe_bwd_fp8.
struct MegaBwdFp8Args {
  // The L2 dgrad: every field of SwigluBwdFp8GemmArgs with its meaning there (its outputs dh_q / dh_sa, dht_q /
  // dht_s, awt_q / awt_s and dt_part are this kernel's too, bit for bit), with intermediate a multiple of 128.
  SwigluBwdFp8GemmArgs l2;
  // The L1 dgrad's B: W13^T e4m3 [num_groups, hidden, 2 * intermediate] (K = 2I contiguous; the weight cache's
  // transposed copy of W13), row stride ldb13 (>= 2I, % 16 == 0), group stride b13_group_stride (>= hidden * ldb13,
  // % 16 == 0 when num_groups > 1), 16-byte aligned; its 128 x 128 block scales [num_groups, ceil(hidden / 128),
  // 2I / 128] at w13t_sb[g * sb13_group_stride + nb * sb13_n_stride + kb], as MGroupedFp8GemmArgs' sb.
  const void* w13t_q = nullptr;
  int64_t ldb13 = 0;
  int64_t b13_group_stride = 0;
  const float* w13t_sb = nullptr;
  int64_t sb13_group_stride = 0;
  int64_t sb13_n_stride = 0;
  // bf16 [m_total, hidden] out: qK(dh) @ W13 per pool row (m_grouped_fp8_gemm_nt's D, bit for bit), row stride lddx
  // (>= hidden, % 8 == 0), 16-byte aligned; rows outside every expert are not written
  void* dx = nullptr;
  int64_t lddx = 0;
  // device int32 [mega_moe_bwd_fp8_counter_count(m_total, num_groups)], zeroed here
  int32_t* counters = nullptr;
  // The sequence's lag (mega_moe_bwd_schedule.hpp), 0 .. kMegaBwdMaxLagHost, or -1: the heuristic's
  // (mega_bwd_lag). Any lag gives the same bits.
  int lag = -1;
};

// Validates (check_swiglu_bwd_fp8_args and the L1 operands), returns without a launch when m_total == 0, else
// launches on stream.
int mega_moe_bwd_fp8(const MegaBwdFp8Args& args, cudaStream_t stream, char* err, size_t err_len);

}  // namespace sm90
}  // namespace prime_kernels
