// torch.ops.prime_kernels.mega_moe_fp8_fused_fwd: the fused FP8 forward (CUDA only: the quantizing dispatch, then the
// fused L1 + L2 kernel) over a routing plan (route_to_pool flat, [T * top_k]). Returns h (gate | up rounded to bf16, [m_total, 2I], empty without save_h) and o
// (the L2 rows, bf16 [m_total, H], the combine's input). The dispatched pool lives in o's memory (its rows in the
// first half of o's rows, mega_moe.hpp), and s with the pool's scales are freed when the call returns, so the op's
// peak is o, h, s and the scales.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <cstdint>
#include <tuple>

#include "api/prime_kernels_api.h"
#include "torch/shim_common.hpp"

namespace {

using namespace prime_kernels::torch_shim;

constexpr const char* kOp = "mega_moe_fp8_fused_fwd";

std::tuple<Tensor, Tensor> mega_moe_fp8_fused_fwd(Tensor x, Tensor pool_src_route, Tensor route_to_pool,
                                                  Tensor expert_offsets, Tensor w13_q, Tensor w13_sb, Tensor w2_q,
                                                  Tensor w2_sb, int64_t top_k, bool save_h, bool pow2_scales,
                                                  int64_t num_sms) {
  check_core(pk_device_check(), kOp);  // a lost context or an earlier call's findings, said first
  STD_TORCH_CHECK(x.is_cuda() && x.scalar_type() == ScalarType::BFloat16 && x.dim() == 2 && x.stride(1) == 1,
                  "prime_kernels.", kOp, ": x must be a bfloat16 CUDA [T, H] tensor with unit column stride");
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  STD_TORCH_CHECK(w13_q.scalar_type() == ScalarType::Float8_e4m3fn && w13_q.dim() == 3 && w13_q.is_contiguous() &&
                      w13_q.size(2) == hidden && w13_q.size(1) % 2 == 0,
                  "prime_kernels.", kOp, ": w13_q must be a contiguous float8_e4m3fn [E, 2I, H] tensor");
  check_same_device(w13_q, x, kOp, "w13_q");
  const int64_t experts = w13_q.size(0), inter = w13_q.size(1) / 2;
  STD_TORCH_CHECK(hidden % 128 == 0 && inter % 128 == 0, "prime_kernels.", kOp, ": H (", hidden, ") and I (", inter,
                  ") must be multiples of 128");
  STD_TORCH_CHECK(w2_q.scalar_type() == ScalarType::Float8_e4m3fn && w2_q.dim() == 3 && w2_q.is_contiguous() &&
                      w2_q.size(0) == experts && w2_q.size(1) == hidden && w2_q.size(2) == inter,
                  "prime_kernels.", kOp, ": w2_q must be a contiguous float8_e4m3fn [E, H, I] tensor");
  check_same_device(w2_q, x, kOp, "w2_q");
  const int64_t hb = hidden / 128, ib = inter / 128;
  STD_TORCH_CHECK(w13_sb.scalar_type() == ScalarType::Float && w13_sb.dim() == 3 && w13_sb.is_contiguous() &&
                      w13_sb.size(0) == experts && w13_sb.size(1) == 2 * ib && w13_sb.size(2) == hb,
                  "prime_kernels.", kOp, ": w13_sb must be a contiguous float32 [E, 2I / 128, H / 128] tensor");
  check_same_device(w13_sb, x, kOp, "w13_sb");
  STD_TORCH_CHECK(w2_sb.scalar_type() == ScalarType::Float && w2_sb.dim() == 3 && w2_sb.is_contiguous() &&
                      w2_sb.size(0) == experts && w2_sb.size(1) == hb && w2_sb.size(2) == ib,
                  "prime_kernels.", kOp, ": w2_sb must be a contiguous float32 [E, H / 128, I / 128] tensor");
  check_same_device(w2_sb, x, kOp, "w2_sb");
  check_int32_vector(pool_src_route, x, kOp, "pool_src_route");
  check_int32_vector(expert_offsets, x, kOp, "expert_offsets");
  check_int32_vector(route_to_pool, x, kOp, "route_to_pool");
  STD_TORCH_CHECK(route_to_pool.size(0) == num_tokens * top_k, "prime_kernels.", kOp,
                  ": route_to_pool must have T * top_k = ", num_tokens * top_k, " entries");
  STD_TORCH_CHECK(expert_offsets.size(0) == experts + 1, "prime_kernels.", kOp, ": expert_offsets must have E + 1 = ",
                  experts + 1, " entries");
  STD_TORCH_CHECK(top_k >= 1 && top_k <= 1024, "prime_kernels.", kOp, ": top_k = ", top_k, ", must be in [1, 1024]");
  STD_TORCH_CHECK(num_sms >= 0 && num_sms <= (int64_t(1) << 20), "prime_kernels.", kOp, ": num_sms = ", num_sms,
                  ", must be >= 1 (or 0: every SM)");
  STD_TORCH_CHECK(num_tokens < (int64_t(1) << 28), "prime_kernels.", kOp, ": at most 2^28 - 1 tokens");
  const int64_t m_total = pool_src_route.size(0);
  torch::stable::accelerator::DeviceGuard guard(x.get_device_index());
  const int64_t ld_sa = (m_total + 3) / 4 * 4;  // K-block major scales: [blocks][ld_sa]
  Tensor o = new_tensor(x, {m_total, hidden}, ScalarType::BFloat16);
  Tensor h = new_tensor(x, {save_h ? m_total : 0, 2 * inter}, ScalarType::BFloat16);
  {
    Tensor x_sa = new_tensor(x, {hb, ld_sa}, ScalarType::Float);
    Tensor s_q = new_tensor(x, {m_total, inter}, ScalarType::Float8_e4m3fn);
    Tensor s_sa = new_tensor(x, {inter / 64, ld_sa}, ScalarType::Float);
    Tensor counters = new_tensor(x, {pk_mega_moe_fwd_counter_count(m_total, static_cast<int>(experts))},
                                 ScalarType::Int);
    check_core(pk_mega_moe_fwd_fp8(
                   num_tokens > 0 ? x.data_ptr() : nullptr, num_tokens > 1 ? x.stride(0) : hidden, num_tokens,
                   static_cast<const int32_t*>(pool_src_route.data_ptr()), static_cast<int>(top_k),
                   static_cast<const int32_t*>(route_to_pool.data_ptr()),
                   static_cast<const int32_t*>(expert_offsets.data_ptr()), static_cast<int>(experts), m_total, hidden,
                   inter, w13_q.data_ptr(), static_cast<const float*>(w13_sb.data_ptr()), 2 * ib * hb, hb,
                   w2_q.data_ptr(), static_cast<const float*>(w2_sb.data_ptr()), hb * ib, ib, o.data_ptr(),
                   2 * hidden, static_cast<float*>(x_sa.data_ptr()), ld_sa, s_q.data_ptr(),
                   static_cast<float*>(s_sa.data_ptr()), ld_sa, save_h ? h.data_ptr() : nullptr, o.data_ptr(),
                   pow2_scales ? 1 : 0, static_cast<int32_t*>(counters.data_ptr()), static_cast<int>(num_sms),
                   current_cuda_stream(x.get_device_index())),
               kOp);
  }  // the pool's scales, s and the counters go back to the (stream-ordered) allocator here
  return {h, o};
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(prime_kernels, m) {
  m.def("mega_moe_fp8_fused_fwd(Tensor x, Tensor pool_src_route, Tensor route_to_pool, Tensor expert_offsets, "
        "Tensor w13_q, "
        "Tensor w13_sb, Tensor w2_q, Tensor w2_sb, int top_k, bool save_h, bool pow2_scales=False, int num_sms=0) "
        "-> (Tensor h, Tensor o)");
}

STABLE_TORCH_LIBRARY_IMPL(prime_kernels, CUDA, m) {
  m.impl("mega_moe_fp8_fused_fwd", TORCH_BOX(&mega_moe_fp8_fused_fwd));
}
