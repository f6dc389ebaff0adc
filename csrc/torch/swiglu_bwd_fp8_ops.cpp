// torch.ops.prime_kernels.m_grouped_fp8_gemm_swiglu_bwd_: the FP8 L2 dgrad with the SwiGLU backward and the
// quantizing epilogue (CUDA only here; prime_kernels.swiglu_bwd_fp8 registers the CPU emulation and the fake kernel).
// It writes into the tensors it is given, in the layouts the FP8 GEMMs read; the core checks strides and alignment.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <cstdint>

#include "api/prime_kernels_api.h"
#include "torch/shim_common.hpp"

namespace {

using namespace prime_kernels::torch_shim;

constexpr const char* kOp = "m_grouped_fp8_gemm_swiglu_bwd_";

void m_grouped_fp8_gemm_swiglu_bwd_cuda(Tensor dy_q, Tensor dy_sa, Tensor w2t_q, Tensor w2t_sb, Tensor group_offsets,
                                        Tensor h, Tensor pool_src_route, Tensor route_weights, Tensor dh_q,
                                        Tensor dh_sa, Tensor dht_q, Tensor dht_s, Tensor awt_q, Tensor awt_s,
                                        Tensor dt_part, double clamp, bool pow2_scales, int64_t num_sms) {
  STD_TORCH_CHECK(dy_q.is_cuda() && dy_q.dim() == 2, "prime_kernels.", kOp, ": dy_q must be a 2-D CUDA tensor");
  STD_TORCH_CHECK(num_sms >= 0 && num_sms <= (int64_t(1) << 30), "prime_kernels.", kOp, ": num_sms = ", num_sms,
                  ", must be >= 0 (0 = every SM)");
  const int64_t m = dy_q.size(0), hidden = dy_q.size(1);
  check_e4m3(dy_q, dy_q, kOp, "dy_q", m, hidden);
  STD_TORCH_CHECK(w2t_q.scalar_type() == ScalarType::Float8_e4m3fn && w2t_q.dim() == 3 && w2t_q.size(2) == hidden &&
                      w2t_q.stride(2) == 1,
                  "prime_kernels.", kOp, ": w2t_q must be a float8_e4m3fn [E, I, H] tensor (H contiguous)");
  check_same_device(w2t_q, dy_q, kOp, "w2t_q");
  const int64_t experts = w2t_q.size(0), inter = w2t_q.size(1);
  STD_TORCH_CHECK(hidden > 0 && inter > 0 && hidden % 64 == 0 && inter % 64 == 0, "prime_kernels.", kOp, ": H (",
                  hidden, ") and I (", inter, ") must be positive multiples of 64");
  STD_TORCH_CHECK(group_offsets.scalar_type() == ScalarType::Int && group_offsets.dim() == 1 &&
                      group_offsets.is_contiguous() && group_offsets.size(0) == experts + 1,
                  "prime_kernels.", kOp, ": group_offsets must be a contiguous int32 [E + 1] tensor (E = ", experts,
                  ")");
  check_same_device(group_offsets, dy_q, kOp, "group_offsets");
  const int64_t kb = (hidden + 127) / 128, nb = (inter + 127) / 128, tb = (m + 127) / 128;
  // dh's scales: per 128 columns along 2I, or per 64 when I = 64 (mod 128) (grouped_gemm_fp8.hpp)
  const int64_t dh_blocks = inter % 128 == 0 ? 2 * nb : 2 * inter / 64;
  const int64_t ld_sa = block_major_ld(dy_sa, m, kb, kOp, "dy_sa", "[M, ceil(H / 128)]");
  check_same_device(dy_sa, dy_q, kOp, "dy_sa");
  STD_TORCH_CHECK(w2t_sb.scalar_type() == ScalarType::Float && w2t_sb.dim() == 3 && w2t_sb.size(0) == experts &&
                      w2t_sb.size(1) == nb && w2t_sb.size(2) == kb && (w2t_sb.stride(2) == 1 || kb == 1),
                  "prime_kernels.", kOp, ": w2t_sb must be a float32 [E, ceil(I / 128), ceil(H / 128)] = [", experts,
                  ", ", nb, ", ", kb, "] tensor with unit stride in its last dim");
  check_same_device(w2t_sb, dy_q, kOp, "w2t_sb");
  STD_TORCH_CHECK(h.scalar_type() == ScalarType::BFloat16 && h.dim() == 2 && h.size(0) >= m &&
                      h.size(1) == 2 * inter && h.stride(1) == 1,
                  "prime_kernels.", kOp, ": h must be a bfloat16 [>= M, 2I] tensor with unit column stride");
  check_same_device(h, dy_q, kOp, "h");
  STD_TORCH_CHECK(pool_src_route.scalar_type() == ScalarType::Int && pool_src_route.is_contiguous() &&
                      pool_src_route.numel() >= m,
                  "prime_kernels.", kOp, ": pool_src_route must be a contiguous int32 tensor with >= M entries");
  check_same_device(pool_src_route, dy_q, kOp, "pool_src_route");
  STD_TORCH_CHECK(route_weights.scalar_type() == ScalarType::Float && route_weights.is_contiguous(), "prime_kernels.",
                  kOp, ": route_weights must be a contiguous float32 tensor (topk_weights flattened)");
  check_same_device(route_weights, dy_q, kOp, "route_weights");
  check_e4m3(dh_q, dy_q, kOp, "dh_q", m, 2 * inter);
  const int64_t ld_dh_sa = block_major_ld(dh_sa, m, dh_blocks, kOp, "dh_sa",
                                          inter % 128 == 0 ? "[M, 2I / 128]" : "[M, 2I / 64] (I = 64 mod 128)");
  check_e4m3(dht_q, dy_q, kOp, "dht_q", 2 * inter, m);
  const int64_t ld_dht_s = block_major_ld(dht_s, 2 * inter, tb, kOp, "dht_s", "[2I, ceil(M / 128)]");
  check_e4m3(awt_q, dy_q, kOp, "awt_q", inter, m);
  const int64_t ld_awt_s = block_major_ld(awt_s, inter, tb, kOp, "awt_s", "[I, ceil(M / 128)]");
  for (const Tensor* t : {&dh_sa, &dht_s, &awt_s}) check_same_device(*t, dy_q, kOp, "a scale output");
  STD_TORCH_CHECK(dt_part.scalar_type() == ScalarType::Float && dt_part.dim() == 2 && dt_part.size(0) == m &&
                      dt_part.size(1) == nb && (dt_part.stride(1) == 1 || nb == 1),
                  "prime_kernels.", kOp,
                  ": dt_part must be a float32 [M, ceil(I / 128)] tensor with unit column stride");
  check_same_device(dt_part, dy_q, kOp, "dt_part");
  torch::stable::accelerator::DeviceGuard guard(dy_q.get_device_index());
  check_core(pk_m_grouped_fp8_gemm_swiglu_bwd(
                 dy_q.data_ptr(), row_stride_bytes(dy_q, hidden), static_cast<const float*>(dy_sa.data_ptr()), ld_sa,
                 w2t_q.data_ptr(), w2t_q.stride(1), w2t_q.stride(0), static_cast<const float*>(w2t_sb.data_ptr()),
                 w2t_sb.stride(0), nb == 1 ? kb : w2t_sb.stride(1), h.data_ptr(), h.stride(0),
                 static_cast<const int32_t*>(pool_src_route.data_ptr()),
                 static_cast<const float*>(route_weights.data_ptr()), route_weights.numel(), dh_q.data_ptr(),
                 row_stride_bytes(dh_q, 2 * inter), static_cast<float*>(dh_sa.data_ptr()), ld_dh_sa, dht_q.data_ptr(),
                 row_stride_bytes(dht_q, m), static_cast<float*>(dht_s.data_ptr()), ld_dht_s, awt_q.data_ptr(),
                 row_stride_bytes(awt_q, m), static_cast<float*>(awt_s.data_ptr()), ld_awt_s,
                 static_cast<float*>(dt_part.data_ptr()), m <= 1 ? nb : dt_part.stride(0),
                 static_cast<const int32_t*>(group_offsets.data_ptr()), static_cast<int>(experts), m, inter, hidden,
                 static_cast<float>(clamp), pow2_scales ? 1 : 0, static_cast<int>(num_sms),
                 current_cuda_stream(dy_q.get_device_index())),
             kOp);
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(prime_kernels, m) {
  m.def("m_grouped_fp8_gemm_swiglu_bwd_(Tensor dy_q, Tensor dy_sa, Tensor w2t_q, Tensor w2t_sb, Tensor group_offsets, "
        "Tensor h, Tensor pool_src_route, Tensor route_weights, Tensor(a!) dh_q, Tensor(b!) dh_sa, Tensor(c!) dht_q, "
        "Tensor(d!) dht_s, Tensor(e!) awt_q, Tensor(f!) awt_s, Tensor(g!) dt_part, float clamp=0.0, "
        "bool pow2_scales=False, int num_sms=0) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(prime_kernels, CUDA, m) {
  m.impl("m_grouped_fp8_gemm_swiglu_bwd_", TORCH_BOX(&m_grouped_fp8_gemm_swiglu_bwd_cuda));
}
