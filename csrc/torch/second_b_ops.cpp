// torch.ops.prime_kernels.m_grouped_bf16_gemm_second_b and m_grouped_bf16_gemm_swiglu_second_b: the m-grouped BF16
// GEMMs whose last groups read a second weight tensor (shared experts as extra groups of the routed experts' launch;
// the pk_*_second_b entry points); and m_grouped_bf16_gemm_swiglu_bwd_into_, the L2 dgrad with the SwiGLU backward
// into given outputs (for its two launches, routed then shared). CUDA only here; prime_kernels.second_b registers the
// CPU kernels (the first B with the second's chunks as experts of their own) and the fake kernels.
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

// The L2 dgrad with the SwiGLU backward into given outputs (pk_m_grouped_bf16_gemm_swiglu_bwd): dh [M, 2I], aw
// [M, I] bf16 and dt_part [M, ceil(I / 128)] fp32, written on the rows of the groups only, so that two launches over
// disjoint groups (the routed experts with w2, the shared chunks with theirs) fill one set of outputs.
void m_grouped_bf16_gemm_swiglu_bwd_into_(Tensor dy_pool, Tensor w2, Tensor group_offsets, Tensor h,
                                          Tensor pool_src_route, Tensor topk_weights, Tensor dh, Tensor aw,
                                          Tensor dt_part, double clamp, int64_t num_sms) {
  const char* op = "m_grouped_bf16_gemm_swiglu_bwd_into_";
  const int sms = check_num_sms(num_sms, op);
  check_bf16_cuda(dy_pool, op, "dy_pool", 2);
  check_bf16_cuda(w2, op, "w2", 3);
  check_bf16_cuda(h, op, "h", 2);
  const int32_t num_groups = check_offsets(group_offsets, dy_pool, op);
  const int64_t m = dy_pool.size(0), hidden = dy_pool.size(1), inter = w2.size(2), n_blocks = (inter + 127) / 128;
  STD_TORCH_CHECK(w2.size(0) == num_groups && w2.size(1) == hidden && w2.stride(2) == 1 && inter % 64 == 0 &&
                      h.size(0) >= m && h.size(1) == 2 * inter,
                  "prime_kernels.", op, ": w2 [num_groups, H, I] (I a multiple of 64, contiguous), h [>= M, 2I]");
  check_bf16_cuda(dh, op, "dh", 2);
  check_bf16_cuda(aw, op, "aw", 2);
  STD_TORCH_CHECK(dh.size(0) == m && dh.size(1) == 2 * inter && aw.size(0) == m && aw.size(1) == inter &&
                      dt_part.scalar_type() == ScalarType::Float && dt_part.is_cuda() && dt_part.dim() == 2 &&
                      dt_part.size(0) == m && dt_part.size(1) == n_blocks && dt_part.stride(1) == 1,
                  "prime_kernels.", op, ": dh [M, 2I], aw [M, I] bf16 and dt_part fp32 [M, ceil(I / 128)] expected");
  STD_TORCH_CHECK(pool_src_route.scalar_type() == ScalarType::Int && pool_src_route.is_contiguous() &&
                      pool_src_route.numel() >= m && pool_src_route.is_cuda() &&
                      topk_weights.scalar_type() == ScalarType::Float && topk_weights.is_contiguous() &&
                      topk_weights.is_cuda(),
                  "prime_kernels.", op, ": pool_src_route contiguous CUDA int32 [>= M], topk_weights contiguous fp32");
  for (const Tensor* t : {&w2, &h, &dh, &aw, &dt_part, &pool_src_route, &topk_weights, &group_offsets})
    STD_TORCH_CHECK(t->get_device_index() == dy_pool.get_device_index(), "prime_kernels.", op,
                    ": every tensor on dy_pool's device");
  torch::stable::accelerator::DeviceGuard guard(dy_pool.get_device_index());
  check_core(pk_m_grouped_bf16_gemm_swiglu_bwd(
                 dy_pool.data_ptr(), dy_pool.stride(0), w2.data_ptr(), w2.stride(1), w2.stride(0), h.data_ptr(),
                 h.stride(0), static_cast<const int32_t*>(pool_src_route.data_ptr()),
                 static_cast<const float*>(topk_weights.data_ptr()), topk_weights.numel(), dh.data_ptr(),
                 dh.stride(0), aw.data_ptr(), aw.stride(0), static_cast<float*>(dt_part.data_ptr()), dt_part.stride(0),
                 static_cast<const int32_t*>(group_offsets.data_ptr()), num_groups, m, inter, hidden,
                 static_cast<float>(clamp), sms, current_cuda_stream(dy_pool.get_device_index())),
             op);
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(prime_kernels, m) {
  m.def("m_grouped_bf16_gemm_second_b(Tensor a, Tensor b, Tensor b2, Tensor group_offsets, bool b_k_major, "
        "int chunks, int num_sms=0) -> Tensor");
  m.def("m_grouped_bf16_gemm_swiglu_second_b(Tensor a, Tensor w13, Tensor w13_2, Tensor group_offsets, "
        "Tensor? a_row_index, int m_total, bool save_h, int chunks, float clamp=0.0, int num_sms=0) -> "
        "(Tensor s, Tensor h)");
  m.def("m_grouped_bf16_gemm_swiglu_bwd_into_(Tensor dy_pool, Tensor w2, Tensor group_offsets, Tensor h, "
        "Tensor pool_src_route, Tensor topk_weights, Tensor(a!) dh, Tensor(b!) aw, Tensor(c!) dt_part, "
        "float clamp=0.0, int num_sms=0) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(prime_kernels, CUDA, m) {
  m.impl("m_grouped_bf16_gemm_second_b", TORCH_BOX(&m_grouped_bf16_gemm_second_b));
  m.impl("m_grouped_bf16_gemm_swiglu_second_b", TORCH_BOX(&m_grouped_bf16_gemm_swiglu_second_b));
  m.impl("m_grouped_bf16_gemm_swiglu_bwd_into_", TORCH_BOX(&m_grouped_bf16_gemm_swiglu_bwd_into_));
}
