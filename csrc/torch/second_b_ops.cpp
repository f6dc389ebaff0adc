// torch.ops.prime_kernels.m_grouped_bf16_gemm_second_b, m_grouped_bf16_gemm_swiglu_second_b and
// m_grouped_bf16_gemm_swiglu_bwd_second_b: the m-grouped BF16 GEMMs whose last groups read a second weight tensor
// (shared experts as extra groups of the routed experts' launch; the pk_*_second_b entry points). CUDA only here;
// prime_kernels.second_b registers the CPU kernels (the first B with the second's chunks as experts of their own)
// and the fake kernels.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "api/prime_kernels_api.h"
#include "torch/shim_common.hpp"

namespace {

using namespace prime_kernels::torch_shim;

// The second B's descriptor once its shape is checked: b2 [S, rows2, cols2] with unit stride in its last dim.
PkSecondB second_b(const Tensor& b, const Tensor& b2, int64_t chunks, int32_t num_groups, const char* op) {
  check_bf16_cuda(b2, op, "b2", 3);
  STD_TORCH_CHECK(b2.get_device_index() == b.get_device_index(), "prime_kernels.", op,
                  ": b and b2 on different devices");
  STD_TORCH_CHECK(chunks >= 1 && b.size(0) + b2.size(0) * chunks == num_groups, "prime_kernels.", op,
                  ": group_offsets has ", num_groups, " groups, b ", b.size(0), " experts and b2 ", b2.size(0),
                  " experts of ", chunks, " chunks each");
  PkSecondB sb{};
  sb.b2 = b2.data_ptr();
  sb.ldb2 = b2.stride(1);
  sb.b2_group_stride = b2.stride(0);
  sb.slabs = static_cast<int>(b2.size(0));
  sb.chunks = static_cast<int>(chunks);
  sb.num_b_groups = static_cast<int>(b.size(0));
  return sb;
}

// b [E, N, K] (b_k_major) or [E, K, N]; b2 [S, N, chunks * K] (K-major: the L2, the chunk of I = K) or
// [S, chunks * K, N] (MN-major: the L1 dgrad, gate rows then up rows of each chunk).
Tensor m_grouped_bf16_gemm_second_b(Tensor a, Tensor b, Tensor b2, Tensor group_offsets, bool b_k_major,
                                    int64_t chunks, int64_t num_sms) {
  const char* op = "m_grouped_bf16_gemm_second_b";
  const int sms = check_num_sms(num_sms, op);
  check_bf16_cuda(a, op, "a", 2);
  check_bf16_cuda(b, op, "b", 3);
  STD_TORCH_CHECK(b.get_device_index() == a.get_device_index(), "prime_kernels.", op, ": a and b on different devices");
  const int32_t num_groups = check_offsets(group_offsets, a, op);
  const int64_t k = a.size(1);
  const int64_t n = b_k_major ? b.size(1) : b.size(2);
  STD_TORCH_CHECK((b_k_major ? b.size(2) : b.size(1)) == k, "prime_kernels.", op, ": b's K does not match a's K (", k,
                  ")");
  const PkSecondB sb = second_b(b, b2, chunks, num_groups, op);
  STD_TORCH_CHECK(b_k_major ? (b2.size(1) == n && b2.size(2) == chunks * k) : (b2.size(1) == chunks * k && b2.size(2) == n),
                  "prime_kernels.", op, ": b2 must be [S, ", b_k_major ? n : chunks * k, ", ",
                  b_k_major ? chunks * k : n, "]");
  torch::stable::accelerator::DeviceGuard guard(a.get_device_index());
  Tensor d = new_tensor(a, {a.size(0), n}, ScalarType::BFloat16);
  check_core(pk_m_grouped_bf16_gemm_second_b(a.data_ptr(), a.stride(0), b.data_ptr(), b_k_major ? 1 : 0, b.stride(1),
                                             b.stride(0), &sb, d.data_ptr(), d.stride(0),
                                             static_cast<const int32_t*>(group_offsets.data_ptr()), num_groups,
                                             a.size(0), n, k, sms, current_cuda_stream(a.get_device_index())),
             op);
  return d;
}

// w13 [E, 2I, K], w13_2 [S, 2 * chunks * I, K] (gate rows, then up rows).
std::tuple<Tensor, Tensor> m_grouped_bf16_gemm_swiglu_second_b(Tensor a, Tensor w13, Tensor w13_2,
                                                               Tensor group_offsets, std::optional<Tensor> a_row_index,
                                                               int64_t m_total, bool save_h, int64_t chunks,
                                                               double clamp, int64_t num_sms) {
  const char* op = "m_grouped_bf16_gemm_swiglu_second_b";
  const int sms = check_num_sms(num_sms, op);
  check_bf16_cuda(a, op, "a", 2);
  check_bf16_cuda(w13, op, "w13", 3);
  const int32_t num_groups = check_offsets(group_offsets, a, op);
  STD_TORCH_CHECK(w13.size(2) == a.size(1) && w13.size(1) % 2 == 0, "prime_kernels.", op,
                  ": w13 must be [E, 2I, K] with K = a's columns");
  const int64_t inter = w13.size(1) / 2;
  const PkSecondB sb = second_b(w13, w13_2, chunks, num_groups, op);
  STD_TORCH_CHECK(w13_2.size(1) == 2 * chunks * inter && w13_2.size(2) == a.size(1), "prime_kernels.", op,
                  ": w13_2 must be [S, 2 * chunks * I, K] = [S, ", 2 * chunks * inter, ", ", a.size(1), "]");
  const int32_t* index = gather_index(a_row_index, a, m_total, op);
  torch::stable::accelerator::DeviceGuard guard(a.get_device_index());
  Tensor s = new_tensor(a, {m_total, inter}, ScalarType::BFloat16);
  Tensor h = new_tensor(a, {save_h ? m_total : 0, 2 * inter}, ScalarType::BFloat16);
  check_core(pk_m_grouped_bf16_gemm_swiglu_second_b(
                 a.data_ptr(), a.stride(0), a.size(0), index, w13.data_ptr(), w13.stride(1), w13.stride(0), &sb, inter,
                 s.data_ptr(), s.stride(0), save_h ? h.data_ptr() : nullptr, 2 * inter,
                 static_cast<const int32_t*>(group_offsets.data_ptr()), num_groups, m_total, a.size(1),
                 static_cast<float>(clamp), sms, current_cuda_stream(a.get_device_index())),
             op);
  return {s, h};
}

// The L2 dgrad with the SwiGLU backward: w2 [E, H, I], w2_2 [S, H, chunks * I] (I a multiple of 128).
std::tuple<Tensor, Tensor, Tensor> m_grouped_bf16_gemm_swiglu_bwd_second_b(Tensor dy_pool, Tensor w2, Tensor w2_2,
                                                                           Tensor group_offsets, Tensor h,
                                                                           Tensor pool_src_route, Tensor topk_weights,
                                                                           int64_t chunks, double clamp,
                                                                           int64_t num_sms) {
  const char* op = "m_grouped_bf16_gemm_swiglu_bwd_second_b";
  const int sms = check_num_sms(num_sms, op);
  check_bf16_cuda(dy_pool, op, "dy_pool", 2);  // before its device index is used
  torch::stable::accelerator::DeviceGuard guard(dy_pool.get_device_index());
  SwigluBwdOperands o =
      swiglu_bwd_operands(dy_pool, w2, group_offsets, h, pool_src_route, topk_weights, op, w2.dim() == 3 ? w2.size(0) : -1);
  const PkSecondB sb = second_b(w2, w2_2, chunks, o.num_groups, op);
  STD_TORCH_CHECK(w2_2.size(1) == o.hidden && w2_2.size(2) == chunks * o.inter, "prime_kernels.", op,
                  ": w2_2 must be [S, H, chunks * I] = [S, ", o.hidden, ", ", chunks * o.inter, "]");
  check_core(pk_m_grouped_bf16_gemm_swiglu_bwd_second_b(
                 dy_pool.data_ptr(), dy_pool.stride(0), w2.data_ptr(), w2.stride(1), w2.stride(0), &sb, h.data_ptr(),
                 h.stride(0), static_cast<const int32_t*>(pool_src_route.data_ptr()),
                 static_cast<const float*>(topk_weights.data_ptr()), topk_weights.numel(), o.dh.data_ptr(),
                 o.dh.stride(0), o.aw.data_ptr(), o.aw.stride(0), static_cast<float*>(o.dt_part.data_ptr()),
                 o.n_blocks, static_cast<const int32_t*>(group_offsets.data_ptr()), o.num_groups, o.m_total, o.inter,
                 o.hidden, static_cast<float>(clamp), sms, current_cuda_stream(dy_pool.get_device_index())),
             op);
  return {o.dh, o.aw, o.dt_part};
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(prime_kernels, m) {
  m.def("m_grouped_bf16_gemm_second_b(Tensor a, Tensor b, Tensor b2, Tensor group_offsets, bool b_k_major, "
        "int chunks, int num_sms=0) -> Tensor");
  m.def("m_grouped_bf16_gemm_swiglu_second_b(Tensor a, Tensor w13, Tensor w13_2, Tensor group_offsets, "
        "Tensor? a_row_index, int m_total, bool save_h, int chunks, float clamp=0.0, int num_sms=0) -> "
        "(Tensor s, Tensor h)");
  m.def("m_grouped_bf16_gemm_swiglu_bwd_second_b(Tensor dy_pool, Tensor w2, Tensor w2_2, Tensor group_offsets, "
        "Tensor h, Tensor pool_src_route, Tensor topk_weights, int chunks, float clamp=0.0, int num_sms=0) -> "
        "(Tensor, Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(prime_kernels, CUDA, m) {
  m.impl("m_grouped_bf16_gemm_second_b", TORCH_BOX(&m_grouped_bf16_gemm_second_b));
  m.impl("m_grouped_bf16_gemm_swiglu_second_b", TORCH_BOX(&m_grouped_bf16_gemm_swiglu_second_b));
  m.impl("m_grouped_bf16_gemm_swiglu_bwd_second_b", TORCH_BOX(&m_grouped_bf16_gemm_swiglu_bwd_second_b));
}
