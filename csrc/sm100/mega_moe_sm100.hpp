// prime-kernels: host launch of the sm_100a BF16 fused MoE forward (csrc/sm100/mega_moe_fwd_sm100.cuh).
//
// Plain C++ over raw device pointers, the conventions of csrc/sm90/mega_moe.hpp (sm90/status.hpp's codes, err
// message, asynchronous on `stream`, every argument checked before the device is touched). The arguments are the
// single-rank subset of sm90::MegaFwdArgs with the same meaning and layouts, so the same host routing plan drives
// both; what this kernel does not support is rejected, not ignored.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "sm90/status.hpp"

namespace prime_kernels {
namespace sm100 {

struct MegaFwdSm100Args {
  // bf16 token rows [num_tokens, hidden], row stride ld_x (>= hidden, % 8); may be null when num_tokens is 0
  const void* x = nullptr;
  int64_t ld_x = 0;
  int64_t num_tokens = 0;
  // device int32 [m_total]: token * top_k + k per pool row (< 0: a row of zeros; >= num_tokens * top_k: zeros, and
  // reported at the next call into the library)
  const int32_t* pool_src_route = nullptr;
  int top_k = 0;
  // device int32 [num_experts + 1] (1..512 experts), non-decreasing from 0, last <= m_total (otherwise nothing is
  // written and the finding is reported)
  const int32_t* expert_offsets = nullptr;
  int num_experts = 0;
  int64_t m_total = 0;
  // multiples of 64
  int64_t hidden = 0;
  int64_t inter = 0;
  // bf16 [num_experts, 2 * inter, hidden] (gate rows, then up rows) and [num_experts, hidden, inter], contiguous
  const void* w13 = nullptr;
  const void* w2 = nullptr;
  // outputs, rows [0, expert_offsets[num_experts]) written: x_pool bf16 [m_total, hidden] (the dispatched rows),
  // s bf16 [m_total, inter], h bf16 [m_total, 2 * inter] or null (gate | up as saved), o bf16 [m_total, hidden] (the
  // combine's input, pool order). o may be x_pool itself, as in the sm90 forward: the dispatched rows are then gone,
  // so they are never written (the L1 launch gathers its rows from x, not from x_pool).
  void* x_pool = nullptr;
  void* s = nullptr;
  void* h = nullptr;
  void* o = nullptr;
  float clamp = 0.f;  // >= 0 (0 = none)
  // the SMs the persistent launches may use (0 = every SM), so that a trainer can leave some to its other kernels
  int num_sms = 0;
};

// On `stream`: the dispatch of x_pool (only when o is not x_pool), the persistent L1 + SwiGLU launch (its A rows
// gathered from x), the persistent L2 launch. All pointers 16-byte aligned.
int mega_moe_fwd_bf16_sm100(const MegaFwdSm100Args& args, cudaStream_t stream, char* err, size_t err_len);

}  // namespace sm100
}  // namespace prime_kernels
