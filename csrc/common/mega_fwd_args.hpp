// prime-kernels: the host arguments the BF16 fused MoE forwards of sm90 (sm90/mega_moe.hpp, MegaFwdArgs) and sm100
// (sm100/mega_moe_sm100.hpp, MegaFwdSm100Args) share. Both take them with one meaning and layout, so one host
// routing plan drives either; each derives its arguments from this and adds its token source and its own options.
// Plain host C++ (no CUDA headers).
#pragma once

#include <cstdint>

namespace prime_kernels {
namespace common {

struct MegaFwdCommonArgs {
  // row stride of the bf16 token rows x, in elements (>= hidden, % 8)
  int64_t ld_x = 0;
  // device int32 [m_total]: token * top_k + k per pool row (< 0: a row of zeros, e.g. a padded plan's padding rows,
  // whose h, s and o rows are then zeros too)
  const int32_t* pool_src_route = nullptr;
  int top_k = 0;
  // device int32 [num_experts + 1] (1..512 experts), non-decreasing from 0, last <= m_total (otherwise nothing is
  // written and the finding is reported at the next call into the library)
  const int32_t* expert_offsets = nullptr;
  int num_experts = 0;
  int64_t m_total = 0;
  // multiples of 64
  int64_t hidden = 0;
  int64_t inter = 0;
  // w13: bf16 [num_experts, 2 * inter, hidden] contiguous (gate rows, then up rows);
  // w2: bf16 [num_experts, hidden, inter] contiguous
  const void* w13 = nullptr;
  const void* w2 = nullptr;
  // Outputs, rows [0, expert_offsets[num_experts]) written: x_pool bf16 [m_total, hidden] (the dispatched rows, the
  // backward's pooled x); s bf16 [m_total, inter] (silu(gate) * up); h bf16 [m_total, 2 * inter] (gate | up
  // pre-activation) or null; o bf16 [m_total, hidden] (s @ w2^T per pool row, the combine's input). o may be x_pool
  // itself: the dispatched rows are then gone, and the forward's peak memory drops by m_total * hidden * 2 bytes.
  void* x_pool = nullptr;
  void* s = nullptr;
  void* h = nullptr;
  void* o = nullptr;
  // rows of x; pool_src_route values must be < num_tokens * top_k: a larger one is not read (its row is dispatched
  // as zeros) and is reported at the next call into the library (common/watchdog.hpp, input flags)
  int64_t num_tokens = 0;
  // >= 0 (0 = none)
  float clamp = 0.f;
  // the SMs the persistent launches may use (0 = every SM), so that a trainer can leave some to its other kernels;
  // the result is the same at every value
  int num_sms = 0;
};

// The fields above from the C ABI's parameters of the same names, in the order pk_mega_moe_fwd_bf16 and
// pk_mega_moe_fwd_bf16_sm100 (one parameter list) and pk_mega_fwd_rank take them.
inline MegaFwdCommonArgs mega_fwd_common_args(int64_t ld_x, const int32_t* pool_src_route, int top_k,
                                              const int32_t* expert_offsets, int num_experts, int64_t m_total,
                                              int64_t hidden, int64_t inter, const void* w13, const void* w2,
                                              void* x_pool, void* s, void* h, void* o, int64_t num_tokens,
                                              float clamp, int num_sms) {
  MegaFwdCommonArgs a;
  a.ld_x = ld_x;
  a.pool_src_route = pool_src_route;
  a.top_k = top_k;
  a.expert_offsets = expert_offsets;
  a.num_experts = num_experts;
  a.m_total = m_total;
  a.hidden = hidden;
  a.inter = inter;
  a.w13 = w13;
  a.w2 = w2;
  a.x_pool = x_pool;
  a.s = s;
  a.h = h;
  a.o = o;
  a.num_tokens = num_tokens;
  a.clamp = clamp;
  a.num_sms = num_sms;
  return a;
}

}  // namespace common
}  // namespace prime_kernels
