// torch.ops.prime_kernels.mega_moe_bwd_fused: the fused Mega MoE backward kernel (CUDA only;
// csrc/sm90/mega_moe_bwd.cuh) with its outputs allocated and its operands checked.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "api/prime_kernels_api.h"
#include "torch/shim_common.hpp"

namespace {

using namespace prime_kernels::torch_shim;

// The fused backward (csrc/sm90/mega_moe_bwd.cuh): the L2 dgrad's outputs as m_grouped_bf16_gemm_swiglu_bwd returns
// them, dx_pool = dh @ w13[g] [M, H] (rows outside every group not written) and, given x_pool [M, H] (the token rows
// in pool order), the weight gradients dw13 [E, 2I, H] and dw2 [E, H, I]: bf16, fp32 (wgrad_fp32), or added to the
// fp32 accumulators dw13_accum / dw2_accum (both given; dw13 and dw2 come back empty), all from one persistent kernel.
// Without x_pool the kernel runs no weight-gradient tile and dw13, dw2 are empty.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> mega_moe_bwd_fused(
    Tensor dy_pool, Tensor w2, Tensor w13, Tensor group_offsets, Tensor h, Tensor pool_src_route, Tensor topk_weights,
    double clamp, std::optional<Tensor> x_pool, bool wgrad_fp32, std::optional<Tensor> dw13_accum,
    std::optional<Tensor> dw2_accum, int64_t num_sms, int64_t lag) {
  const char* op = "mega_moe_bwd_fused";
  check_core(pk_device_check(), op);  // a lost context or an earlier call's findings, said first
  const int sms = check_num_sms(num_sms, op);
  STD_TORCH_CHECK(lag >= -1 && lag <= 64, "prime_kernels.", op, ": lag = ", lag, ", must be -1 (the heuristic's) or "
                  "in [0, 64]");
  check_bf16_cuda(w13, op, "w13", 3);
  check_bf16_cuda(dy_pool, op, "dy_pool", 2);  // before its device index is used
  torch::stable::accelerator::DeviceGuard guard(dy_pool.get_device_index());
  SwigluBwdOperands o = swiglu_bwd_operands(dy_pool, w2, group_offsets, h, pool_src_route, topk_weights, op);
  const int64_t E = o.num_groups, H = o.hidden, I = o.inter;
  STD_TORCH_CHECK(w13.get_device_index() == dy_pool.get_device_index() && w13.size(0) == E && w13.size(1) == 2 * I &&
                      w13.size(2) == H,
                  "prime_kernels.", op, ": w13 must be [num_groups, 2I, H] on dy_pool's device");
  STD_TORCH_CHECK(dw13_accum.has_value() == dw2_accum.has_value(), "prime_kernels.", op,
                  ": give both accumulators (dw13_accum, dw2_accum) or neither");
  STD_TORCH_CHECK(!dw13_accum.has_value() || x_pool.has_value(), "prime_kernels.", op,
                  ": the accumulators need x_pool (the weight gradients' operand)");
  int wgrad = 0;  // pk_mega_moe_bwd_bf16's code: 0 none, 1 bf16, 2 fp32, 3 fp32 added
  Tensor dw13 = new_tensor(dy_pool, {0}, ScalarType::BFloat16);
  Tensor dw2 = new_tensor(dy_pool, {0}, ScalarType::BFloat16);
  void* dw13_ptr = nullptr;
  void* dw2_ptr = nullptr;
  if (x_pool.has_value()) {
    check_bf16_cuda(*x_pool, op, "x_pool", 2);
    STD_TORCH_CHECK(x_pool->get_device_index() == dy_pool.get_device_index() && x_pool->size(0) >= o.m_total &&
                        x_pool->size(1) == H,
                    "prime_kernels.", op, ": x_pool must be [>= pool rows, H] on dy_pool's device");
    if (dw13_accum.has_value()) {
      const std::pair<const Tensor*, std::vector<int64_t>> accs[2] = {{&*dw13_accum, {E, 2 * I, H}},
                                                                     {&*dw2_accum, {E, H, I}}};
      for (const auto& [t, shape] : accs) {
        STD_TORCH_CHECK(t->scalar_type() == ScalarType::Float && t->is_contiguous() && t->is_cuda() &&
                            t->get_device_index() == dy_pool.get_device_index() && t->dim() == 3 &&
                            t->size(0) == shape[0] && t->size(1) == shape[1] && t->size(2) == shape[2],
                        "prime_kernels.", op, ": dw13_accum must be fp32 [E, 2I, H] and dw2_accum fp32 [E, H, I], "
                        "contiguous, on dy_pool's device");
      }
      wgrad = 3;
      dw13_ptr = dw13_accum->data_ptr();
      dw2_ptr = dw2_accum->data_ptr();
    } else {
      const ScalarType dt = wgrad_fp32 ? ScalarType::Float : ScalarType::BFloat16;
      dw13 = new_tensor(dy_pool, {E, 2 * I, H}, dt);
      dw2 = new_tensor(dy_pool, {E, H, I}, dt);
      wgrad = wgrad_fp32 ? 2 : 1;
      dw13_ptr = dw13.data_ptr();
      dw2_ptr = dw2.data_ptr();
    }
  }
  Tensor dx = new_tensor(dy_pool, {o.m_total, H}, ScalarType::BFloat16);
  Tensor counters = new_tensor(dy_pool, {pk_mega_moe_bwd_counter_count(o.m_total, o.num_groups)}, ScalarType::Int);
  check_core(pk_mega_moe_bwd_bf16(
                 dy_pool.data_ptr(), dy_pool.stride(0), w2.data_ptr(), w2.stride(1), w2.stride(0), h.data_ptr(),
                 h.stride(0), static_cast<const int32_t*>(pool_src_route.data_ptr()),
                 static_cast<const float*>(topk_weights.data_ptr()), topk_weights.numel(), w13.data_ptr(),
                 w13.stride(1), w13.stride(0), o.dh.data_ptr(), o.dh.stride(0), o.aw.data_ptr(), o.aw.stride(0),
                 static_cast<float*>(o.dt_part.data_ptr()), o.n_blocks, dx.data_ptr(), dx.stride(0),
                 x_pool.has_value() ? x_pool->data_ptr() : nullptr, x_pool.has_value() ? x_pool->stride(0) : 0, wgrad,
                 dw2_ptr, dw13_ptr, static_cast<const int32_t*>(group_offsets.data_ptr()), o.num_groups, o.m_total,
                 o.inter, o.hidden, static_cast<float>(clamp), static_cast<int32_t*>(counters.data_ptr()),
                 static_cast<int>(lag), sms, current_cuda_stream(dy_pool.get_device_index())),
             op);
  return {o.dh, o.aw, o.dt_part, dx, dw13, dw2};
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(prime_kernels, m) {
  m.def("mega_moe_bwd_fused(Tensor dy_pool, Tensor w2, Tensor w13, Tensor group_offsets, Tensor h, "
        "Tensor pool_src_route, Tensor topk_weights, float clamp=0.0, Tensor? x_pool=None, bool wgrad_fp32=False, "
        "Tensor(a!)? dw13_accum=None, Tensor(b!)? dw2_accum=None, int num_sms=0, int lag=-1) -> "
        "(Tensor dh, Tensor aw, Tensor dt_part, Tensor dx_pool, Tensor dw13, Tensor dw2)");
}

STABLE_TORCH_LIBRARY_IMPL(prime_kernels, CUDA, m) {
  m.impl("mega_moe_bwd_fused", TORCH_BOX(&mega_moe_bwd_fused));
}
