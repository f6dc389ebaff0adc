// torch.ops.prime_kernels.m_grouped_fp8_gemm_swiglu_bwd_: the FP8 L2 dgrad with the SwiGLU backward and the
// quantizing epilogue (CUDA only here; prime_kernels.swiglu_bwd_fp8 registers the CPU emulation and the fake kernel),
// and torch.ops.prime_kernels.mega_moe_fp8_dgrad_fused: the same with the FP8 L1 dgrad in one kernel (CUDA only;
// prime_kernels.swiglu_bwd_fp8 registers its fake kernel and runs the two ops in its place on the CPU).
// They write into the tensors they are given, in the layouts the FP8 GEMMs read; the core checks strides and
// alignment.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <cstdint>

#include "api/prime_kernels_api.h"
#include "torch/shim_common.hpp"

namespace {

using namespace prime_kernels::torch_shim;

// The FP8 L2 dgrad's operands and outputs, checked (the grouped op and the fused FP8 dgrad take them alike), and the
// sizes and strides the core takes them with.
struct SwigluBwdFp8Operands {
  int64_t m, hidden, inter, experts;
  int64_t ld_sa, sb_n_stride, ld_dh_sa, ld_dht_s, ld_awt_s, dt_ld;
};

SwigluBwdFp8Operands check_swiglu_bwd_fp8_operands(const char* op, const Tensor& dy_q, const Tensor& dy_sa,
                                                   const Tensor& w2t_q, const Tensor& w2t_sb,
                                                   const Tensor& group_offsets, const Tensor& h,
                                                   const Tensor& pool_src_route, const Tensor& route_weights,
                                                   const Tensor& dh_q, const Tensor& dh_sa, const Tensor& dht_q,
                                                   const Tensor& dht_s, const Tensor& awt_q, const Tensor& awt_s,
                                                   const Tensor& dt_part, int64_t num_sms) {
  STD_TORCH_CHECK(dy_q.is_cuda() && dy_q.dim() == 2, "prime_kernels.", op, ": dy_q must be a 2-D CUDA tensor");
  STD_TORCH_CHECK(num_sms >= 0 && num_sms <= (int64_t(1) << 30), "prime_kernels.", op, ": num_sms = ", num_sms,
                  ", must be >= 0 (0 = every SM)");
  SwigluBwdFp8Operands o;
  const int64_t m = dy_q.size(0), hidden = dy_q.size(1);
  check_e4m3(dy_q, dy_q, op, "dy_q", m, hidden);
  STD_TORCH_CHECK(w2t_q.scalar_type() == ScalarType::Float8_e4m3fn && w2t_q.dim() == 3 && w2t_q.size(2) == hidden &&
                      w2t_q.stride(2) == 1,
                  "prime_kernels.", op, ": w2t_q must be a float8_e4m3fn [E, I, H] tensor (H contiguous)");
  check_same_device(w2t_q, dy_q, op, "w2t_q");
  const int64_t experts = w2t_q.size(0), inter = w2t_q.size(1);
  STD_TORCH_CHECK(hidden > 0 && inter > 0 && hidden % 64 == 0 && inter % 64 == 0, "prime_kernels.", op, ": H (",
                  hidden, ") and I (", inter, ") must be positive multiples of 64");
  STD_TORCH_CHECK(group_offsets.scalar_type() == ScalarType::Int && group_offsets.dim() == 1 &&
                      group_offsets.is_contiguous() && group_offsets.size(0) == experts + 1,
                  "prime_kernels.", op, ": group_offsets must be a contiguous int32 [E + 1] tensor (E = ", experts,
                  ")");
  check_same_device(group_offsets, dy_q, op, "group_offsets");
  const int64_t kb = (hidden + 127) / 128, nb = (inter + 127) / 128, tb = (m + 127) / 128;
  // dh's scales: per 128 columns along 2I, or per 64 when I = 64 (mod 128) (grouped_gemm_fp8.hpp)
  const int64_t dh_blocks = inter % 128 == 0 ? 2 * nb : 2 * inter / 64;
  o.ld_sa = block_major_ld(dy_sa, m, kb, op, "dy_sa", "[M, ceil(H / 128)]");
  check_same_device(dy_sa, dy_q, op, "dy_sa");
  STD_TORCH_CHECK(w2t_sb.scalar_type() == ScalarType::Float && w2t_sb.dim() == 3 && w2t_sb.size(0) == experts &&
                      w2t_sb.size(1) == nb && w2t_sb.size(2) == kb && (w2t_sb.stride(2) == 1 || kb == 1),
                  "prime_kernels.", op, ": w2t_sb must be a float32 [E, ceil(I / 128), ceil(H / 128)] = [", experts,
                  ", ", nb, ", ", kb, "] tensor with unit stride in its last dim");
  check_same_device(w2t_sb, dy_q, op, "w2t_sb");
  STD_TORCH_CHECK(h.scalar_type() == ScalarType::BFloat16 && h.dim() == 2 && h.size(0) >= m &&
                      h.size(1) == 2 * inter && h.stride(1) == 1,
                  "prime_kernels.", op, ": h must be a bfloat16 [>= M, 2I] tensor with unit column stride");
  check_same_device(h, dy_q, op, "h");
  STD_TORCH_CHECK(pool_src_route.scalar_type() == ScalarType::Int && pool_src_route.is_contiguous() &&
                      pool_src_route.numel() >= m,
                  "prime_kernels.", op, ": pool_src_route must be a contiguous int32 tensor with >= M entries");
  check_same_device(pool_src_route, dy_q, op, "pool_src_route");
  STD_TORCH_CHECK(route_weights.scalar_type() == ScalarType::Float && route_weights.is_contiguous(), "prime_kernels.",
                  op, ": route_weights must be a contiguous float32 tensor (topk_weights flattened)");
  check_same_device(route_weights, dy_q, op, "route_weights");
  check_e4m3(dh_q, dy_q, op, "dh_q", m, 2 * inter);
  o.ld_dh_sa = block_major_ld(dh_sa, m, dh_blocks, op, "dh_sa",
                              inter % 128 == 0 ? "[M, 2I / 128]" : "[M, 2I / 64] (I = 64 mod 128)");
  check_e4m3(dht_q, dy_q, op, "dht_q", 2 * inter, m);
  o.ld_dht_s = block_major_ld(dht_s, 2 * inter, tb, op, "dht_s", "[2I, ceil(M / 128)]");
  check_e4m3(awt_q, dy_q, op, "awt_q", inter, m);
  o.ld_awt_s = block_major_ld(awt_s, inter, tb, op, "awt_s", "[I, ceil(M / 128)]");
  for (const Tensor* t : {&dh_sa, &dht_s, &awt_s}) check_same_device(*t, dy_q, op, "a scale output");
  STD_TORCH_CHECK(dt_part.scalar_type() == ScalarType::Float && dt_part.dim() == 2 && dt_part.size(0) == m &&
                      dt_part.size(1) == nb && (dt_part.stride(1) == 1 || nb == 1),
                  "prime_kernels.", op,
                  ": dt_part must be a float32 [M, ceil(I / 128)] tensor with unit column stride");
  check_same_device(dt_part, dy_q, op, "dt_part");
  o.m = m;
  o.hidden = hidden;
  o.inter = inter;
  o.experts = experts;
  // with one block of I the stride between w2t_sb's rows of blocks, and with one row dt_part's row stride, are never
  // used (torch may report any value for them)
  o.sb_n_stride = nb == 1 ? kb : w2t_sb.stride(1);
  o.dt_ld = m <= 1 ? nb : dt_part.stride(0);
  return o;
}

constexpr const char* kOp = "m_grouped_fp8_gemm_swiglu_bwd_";

void m_grouped_fp8_gemm_swiglu_bwd_cuda(Tensor dy_q, Tensor dy_sa, Tensor w2t_q, Tensor w2t_sb, Tensor group_offsets,
                                        Tensor h, Tensor pool_src_route, Tensor route_weights, Tensor dh_q,
                                        Tensor dh_sa, Tensor dht_q, Tensor dht_s, Tensor awt_q, Tensor awt_s,
                                        Tensor dt_part, double clamp, bool pow2_scales, int64_t num_sms) {
  const SwigluBwdFp8Operands o =
      check_swiglu_bwd_fp8_operands(kOp, dy_q, dy_sa, w2t_q, w2t_sb, group_offsets, h, pool_src_route, route_weights,
                                    dh_q, dh_sa, dht_q, dht_s, awt_q, awt_s, dt_part, num_sms);
  const int64_t m = o.m, inter = o.inter;
  torch::stable::accelerator::DeviceGuard guard(dy_q.get_device_index());
  check_core(pk_m_grouped_fp8_gemm_swiglu_bwd(
                 dy_q.data_ptr(), row_stride_bytes(dy_q, o.hidden), static_cast<const float*>(dy_sa.data_ptr()),
                 o.ld_sa, w2t_q.data_ptr(), w2t_q.stride(1), w2t_q.stride(0),
                 static_cast<const float*>(w2t_sb.data_ptr()), w2t_sb.stride(0), o.sb_n_stride, h.data_ptr(),
                 h.stride(0), static_cast<const int32_t*>(pool_src_route.data_ptr()),
                 static_cast<const float*>(route_weights.data_ptr()), route_weights.numel(), dh_q.data_ptr(),
                 row_stride_bytes(dh_q, 2 * inter), static_cast<float*>(dh_sa.data_ptr()), o.ld_dh_sa,
                 dht_q.data_ptr(), row_stride_bytes(dht_q, m), static_cast<float*>(dht_s.data_ptr()), o.ld_dht_s,
                 awt_q.data_ptr(), row_stride_bytes(awt_q, m), static_cast<float*>(awt_s.data_ptr()), o.ld_awt_s,
                 static_cast<float*>(dt_part.data_ptr()), o.dt_ld,
                 static_cast<const int32_t*>(group_offsets.data_ptr()), static_cast<int>(o.experts), m, inter,
                 o.hidden, static_cast<float>(clamp), pow2_scales ? 1 : 0, static_cast<int>(num_sms),
                 current_cuda_stream(dy_q.get_device_index())),
             kOp);
}

// The fused FP8 dgrad (csrc/sm90/mega_moe_bwd_fp8.cuh): the L2 dgrad above, written into the same outputs, and the L1
// dgrad dx_pool = m_grouped_fp8_gemm_nt(dh_q, dh_sa, w13t_q, w13t_sb) [M, H] bf16 (rows outside every group not
// written), returned, from one persistent kernel. w13t_q e4m3 [E, H, 2I] (2I contiguous), w13t_sb fp32
// [E, ceil(H / 128), 2I / 128]; I a multiple of 128.
Tensor mega_moe_fp8_dgrad_fused(Tensor dy_q, Tensor dy_sa, Tensor w2t_q, Tensor w2t_sb, Tensor w13t_q, Tensor w13t_sb,
                                Tensor group_offsets, Tensor h, Tensor pool_src_route, Tensor route_weights,
                                Tensor dh_q, Tensor dh_sa, Tensor dht_q, Tensor dht_s, Tensor awt_q, Tensor awt_s,
                                Tensor dt_part, double clamp, bool pow2_scales, int64_t num_sms, int64_t lag) {
  const char* op = "mega_moe_fp8_dgrad_fused";
  check_core(pk_device_check(), op);  // a lost context or an earlier call's findings, said first
  const SwigluBwdFp8Operands o =
      check_swiglu_bwd_fp8_operands(op, dy_q, dy_sa, w2t_q, w2t_sb, group_offsets, h, pool_src_route, route_weights,
                                    dh_q, dh_sa, dht_q, dht_s, awt_q, awt_s, dt_part, num_sms);
  const int64_t m = o.m, hidden = o.hidden, inter = o.inter, experts = o.experts;
  STD_TORCH_CHECK(lag >= -1 && lag <= 64, "prime_kernels.", op, ": lag = ", lag,
                  ", must be -1 (the heuristic's) or in [0, 64]");
  STD_TORCH_CHECK(inter % 128 == 0, "prime_kernels.", op, ": I (", inter,
                  ") must be a multiple of 128 (the fused kernel has no 64-wide last block of I; "
                  "m_grouped_fp8_gemm_swiglu_bwd with m_grouped_fp8_gemm_nt take I = 64 mod 128)");
  const int64_t k13_blocks = 2 * inter / 128, n13_blocks = (hidden + 127) / 128;
  STD_TORCH_CHECK(w13t_q.scalar_type() == ScalarType::Float8_e4m3fn && w13t_q.dim() == 3 &&
                      w13t_q.size(0) == experts && w13t_q.size(1) == hidden && w13t_q.size(2) == 2 * inter &&
                      w13t_q.stride(2) == 1,
                  "prime_kernels.", op, ": w13t_q must be a float8_e4m3fn [E, H, 2I] = [", experts, ", ", hidden, ", ",
                  2 * inter, "] tensor (2I contiguous)");
  check_same_device(w13t_q, dy_q, op, "w13t_q");
  STD_TORCH_CHECK(w13t_sb.scalar_type() == ScalarType::Float && w13t_sb.dim() == 3 && w13t_sb.size(0) == experts &&
                      w13t_sb.size(1) == n13_blocks && w13t_sb.size(2) == k13_blocks &&
                      (w13t_sb.stride(2) == 1 || k13_blocks == 1),
                  "prime_kernels.", op, ": w13t_sb must be a float32 [E, ceil(H / 128), 2I / 128] = [", experts, ", ",
                  n13_blocks, ", ", k13_blocks, "] tensor with unit stride in its last dim");
  check_same_device(w13t_sb, dy_q, op, "w13t_sb");
  torch::stable::accelerator::DeviceGuard guard(dy_q.get_device_index());
  // as m_grouped_fp8_gemm_nt's D: uninitialised, the rows of the groups written
  Tensor dx = new_tensor(dy_q, {m, hidden}, ScalarType::BFloat16);
  Tensor counters =
      new_tensor(dy_q, {pk_mega_moe_bwd_fp8_counter_count(m, static_cast<int>(experts))}, ScalarType::Int);
  check_core(pk_mega_moe_bwd_fp8(
                 dy_q.data_ptr(), row_stride_bytes(dy_q, hidden), static_cast<const float*>(dy_sa.data_ptr()),
                 o.ld_sa, w2t_q.data_ptr(), w2t_q.stride(1), w2t_q.stride(0),
                 static_cast<const float*>(w2t_sb.data_ptr()), w2t_sb.stride(0), o.sb_n_stride, h.data_ptr(),
                 h.stride(0), static_cast<const int32_t*>(pool_src_route.data_ptr()),
                 static_cast<const float*>(route_weights.data_ptr()), route_weights.numel(), dh_q.data_ptr(),
                 row_stride_bytes(dh_q, 2 * inter), static_cast<float*>(dh_sa.data_ptr()), o.ld_dh_sa,
                 dht_q.data_ptr(), row_stride_bytes(dht_q, m), static_cast<float*>(dht_s.data_ptr()), o.ld_dht_s,
                 awt_q.data_ptr(), row_stride_bytes(awt_q, m), static_cast<float*>(awt_s.data_ptr()), o.ld_awt_s,
                 static_cast<float*>(dt_part.data_ptr()), o.dt_ld,
                 static_cast<const int32_t*>(group_offsets.data_ptr()), static_cast<int>(experts), m, inter, hidden,
                 static_cast<float>(clamp), pow2_scales ? 1 : 0, w13t_q.data_ptr(), w13t_q.stride(1),
                 w13t_q.stride(0), static_cast<const float*>(w13t_sb.data_ptr()), w13t_sb.stride(0),
                 n13_blocks == 1 ? k13_blocks : w13t_sb.stride(1), dx.data_ptr(), dx.stride(0),
                 static_cast<int32_t*>(counters.data_ptr()), static_cast<int>(lag), static_cast<int>(num_sms),
                 current_cuda_stream(dy_q.get_device_index())),
             op);
  return dx;
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(prime_kernels, m) {
  m.def("m_grouped_fp8_gemm_swiglu_bwd_(Tensor dy_q, Tensor dy_sa, Tensor w2t_q, Tensor w2t_sb, Tensor group_offsets, "
        "Tensor h, Tensor pool_src_route, Tensor route_weights, Tensor(a!) dh_q, Tensor(b!) dh_sa, Tensor(c!) dht_q, "
        "Tensor(d!) dht_s, Tensor(e!) awt_q, Tensor(f!) awt_s, Tensor(g!) dt_part, float clamp=0.0, "
        "bool pow2_scales=False, int num_sms=0) -> ()");
  m.def("mega_moe_fp8_dgrad_fused(Tensor dy_q, Tensor dy_sa, Tensor w2t_q, Tensor w2t_sb, Tensor w13t_q, "
        "Tensor w13t_sb, Tensor group_offsets, Tensor h, Tensor pool_src_route, Tensor route_weights, "
        "Tensor(a!) dh_q, Tensor(b!) dh_sa, Tensor(c!) dht_q, Tensor(d!) dht_s, Tensor(e!) awt_q, Tensor(f!) awt_s, "
        "Tensor(g!) dt_part, float clamp=0.0, bool pow2_scales=False, int num_sms=0, int lag=-1) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(prime_kernels, CUDA, m) {
  m.impl("m_grouped_fp8_gemm_swiglu_bwd_", TORCH_BOX(&m_grouped_fp8_gemm_swiglu_bwd_cuda));
  m.impl("mega_moe_fp8_dgrad_fused", TORCH_BOX(&mega_moe_fp8_dgrad_fused));
}
