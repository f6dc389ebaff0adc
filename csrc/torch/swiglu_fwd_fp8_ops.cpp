// torch.ops.prime_kernels.m_grouped_fp8_gemm_swiglu_: the FP8 L1 GEMM with the SwiGLU forward and the quantization
// of s (CUDA only here; prime_kernels.swiglu_fwd_fp8 registers the CPU emulation and the fake kernel). It writes into
// the tensors it is given, in the layouts the FP8 L2 GEMM reads; the core checks strides and alignment.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <cstdint>

#include "api/prime_kernels_api.h"
#include "torch/shim_common.hpp"

namespace {

using namespace prime_kernels::torch_shim;

constexpr const char* kOp = "m_grouped_fp8_gemm_swiglu_";

void m_grouped_fp8_gemm_swiglu_cuda(Tensor x_q, Tensor x_sa, Tensor w13_q, Tensor w13_sb, Tensor group_offsets,
                                    Tensor s_q, Tensor s_sa, Tensor h, bool pow2_scales, int64_t num_sms,
                                    double clamp_limit) {
  STD_TORCH_CHECK(x_q.is_cuda() && x_q.dim() == 2, "prime_kernels.", kOp, ": x_q must be a 2-D CUDA tensor");
  STD_TORCH_CHECK(num_sms >= 0 && num_sms <= (int64_t(1) << 30), "prime_kernels.", kOp, ": num_sms = ", num_sms,
                  ", must be >= 0 (0 = every SM)");
  const int64_t m = x_q.size(0), hidden = x_q.size(1);
  check_e4m3(x_q, x_q, kOp, "x_q", m, hidden);
  STD_TORCH_CHECK(w13_q.scalar_type() == ScalarType::Float8_e4m3fn && w13_q.dim() == 3 && w13_q.size(2) == hidden &&
                      w13_q.size(1) % 2 == 0 && w13_q.stride(2) == 1,
                  "prime_kernels.", kOp, ": w13_q must be a float8_e4m3fn [E, 2I, H] tensor (H contiguous)");
  check_same_device(w13_q, x_q, kOp, "w13_q");
  const int64_t experts = w13_q.size(0), inter = w13_q.size(1) / 2;
  STD_TORCH_CHECK(hidden > 0 && inter > 0 && hidden % 64 == 0 && inter % 64 == 0, "prime_kernels.", kOp, ": H (",
                  hidden, ") and I (", inter, ") must be positive multiples of 64");
  STD_TORCH_CHECK(group_offsets.scalar_type() == ScalarType::Int && group_offsets.dim() == 1 &&
                      group_offsets.is_contiguous() && group_offsets.size(0) == experts + 1,
                  "prime_kernels.", kOp, ": group_offsets must be a contiguous int32 [E + 1] tensor (E = ", experts,
                  ")");
  check_same_device(group_offsets, x_q, kOp, "group_offsets");
  const int64_t kb = (hidden + 127) / 128, nb = 2 * inter / 128;
  const int64_t ld_sa = block_major_ld(x_sa, m, kb, kOp, "x_sa", "[M, ceil(H / 128)]");
  check_same_device(x_sa, x_q, kOp, "x_sa");
  STD_TORCH_CHECK(w13_sb.scalar_type() == ScalarType::Float && w13_sb.dim() == 3 && w13_sb.size(0) == experts &&
                      w13_sb.size(1) == nb && w13_sb.size(2) == kb && (w13_sb.stride(2) == 1 || kb == 1),
                  "prime_kernels.", kOp, ": w13_sb must be a float32 [E, 2I / 128, ceil(H / 128)] = [", experts, ", ",
                  nb, ", ", kb, "] tensor with unit stride in its last dim");
  check_same_device(w13_sb, x_q, kOp, "w13_sb");
  check_e4m3(s_q, x_q, kOp, "s_q", m, inter);
  const int64_t ld_s_sa = block_major_ld(s_sa, m, inter / 64, kOp, "s_sa", "[M, I / 64]");
  check_same_device(s_sa, x_q, kOp, "s_sa");
  const bool save_h = h.numel() > 0;
  STD_TORCH_CHECK(!save_h || (h.scalar_type() == ScalarType::BFloat16 && h.dim() == 2 && h.size(0) == m &&
                              h.size(1) == 2 * inter && h.stride(1) == 1),
                  "prime_kernels.", kOp, ": h must be empty (not saved) or a bfloat16 [M, 2I] tensor with unit column "
                  "stride");
  check_same_device(h, x_q, kOp, "h");
  torch::stable::accelerator::DeviceGuard guard(x_q.get_device_index());
  check_core(pk_m_grouped_fp8_gemm_swiglu(
                 x_q.data_ptr(), row_stride_bytes(x_q, hidden), static_cast<const float*>(x_sa.data_ptr()), ld_sa,
                 w13_q.data_ptr(), w13_q.stride(1), w13_q.stride(0), static_cast<const float*>(w13_sb.data_ptr()),
                 w13_sb.stride(0), w13_sb.stride(1), s_q.data_ptr(), row_stride_bytes(s_q, inter),
                 static_cast<float*>(s_sa.data_ptr()), ld_s_sa, save_h ? h.data_ptr() : nullptr,
                 save_h ? (m <= 1 ? 2 * inter : h.stride(0)) : 0,
                 static_cast<const int32_t*>(group_offsets.data_ptr()), static_cast<int>(experts), m, inter, hidden,
                 pow2_scales ? 1 : 0, static_cast<int>(num_sms), static_cast<float>(clamp_limit),
                 current_cuda_stream(x_q.get_device_index())),
             kOp);
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(prime_kernels, m) {
  m.def("m_grouped_fp8_gemm_swiglu_(Tensor x_q, Tensor x_sa, Tensor w13_q, Tensor w13_sb, Tensor group_offsets, "
        "Tensor(a!) s_q, Tensor(b!) s_sa, Tensor(c!) h, bool pow2_scales=False, int num_sms=0, "
        "float clamp_limit=0.0) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(prime_kernels, CUDA, m) {
  m.impl("m_grouped_fp8_gemm_swiglu_", TORCH_BOX(&m_grouped_fp8_gemm_swiglu_cuda));
}
