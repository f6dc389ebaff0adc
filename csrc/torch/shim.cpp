// The LibTorch stable-ABI shim: registers torch.ops.prime_kernels.* and forwards to the C ABI core (the FP8
// quantizing producers' ops are in quantize_ops.cpp).
//
// Built against the stable headers with TORCH_TARGET_VERSION = 2.10, so one binary loads on every
// torch >= 2.10. It links libtorch_cpu only; the current CUDA stream comes from libtorch_cuda,
// looked up when a CUDA op first runs, so a CPU-only torch can still load this library.
#include <dlfcn.h>

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "api/prime_kernels_api.h"
#include "torch/shim_common.hpp"

namespace prime_kernels::torch_shim {

void check_core(int rc, const char* op) {
  STD_TORCH_CHECK(rc == PK_OK, "prime_kernels.", op, ": ", pk_last_error());
}

void* current_cuda_stream(int32_t device_index) {
  using Getter = int32_t (*)(int32_t, void**);
  static Getter getter = []() -> Getter {
    void* lib = dlopen("libtorch_cuda.so", RTLD_LAZY | RTLD_NOLOAD);
    return lib ? reinterpret_cast<Getter>(dlsym(lib, "aoti_torch_get_current_cuda_stream")) : nullptr;
  }();
  STD_TORCH_CHECK(getter != nullptr,
                  "prime_kernels: this torch build has no CUDA support (libtorch_cuda is not loaded)");
  void* stream = nullptr;
  STD_TORCH_CHECK(getter(device_index, &stream) == 0, "prime_kernels: could not get the current CUDA stream");
  return stream;
}

Tensor new_tensor(const Tensor& like, std::vector<int64_t> sizes, ScalarType dtype) {
  return torch::stable::new_empty(like, torch::headeronly::IntHeaderOnlyArrayRef(sizes.data(), sizes.size()),
                                  dtype);
}

void check_bf16_cuda(const Tensor& t, const char* op, const char* name, int64_t dim) {
  STD_TORCH_CHECK(t.is_cuda(), "prime_kernels.", op, ": ", name, " must be a CUDA tensor");
  STD_TORCH_CHECK(t.scalar_type() == ScalarType::BFloat16, "prime_kernels.", op, ": ", name, " must be bfloat16");
  STD_TORCH_CHECK(t.dim() == dim, "prime_kernels.", op, ": ", name, " must be ", dim, "-D, got ", t.dim(), "-D");
  STD_TORCH_CHECK(t.stride(dim - 1) == 1, "prime_kernels.", op, ": ", name, " must have unit stride in its last dim");
}

int32_t check_offsets(const Tensor& offsets, const Tensor& like, const char* op) {
  STD_TORCH_CHECK(offsets.scalar_type() == ScalarType::Int && offsets.dim() == 1 && offsets.is_contiguous(),
                  "prime_kernels.", op, ": group_offsets must be a contiguous 1-D int32 tensor [num_groups + 1]");
  STD_TORCH_CHECK(offsets.is_cuda() && offsets.get_device_index() == like.get_device_index(), "prime_kernels.", op,
                  ": group_offsets must be on the operands' CUDA device");
  STD_TORCH_CHECK(offsets.size(0) >= 2, "prime_kernels.", op, ": group_offsets needs num_groups + 1 >= 2 entries");
  return static_cast<int32_t>(offsets.size(0) - 1);
}

// The grouped ops' num_sms: the most SMs the kernel may use, 0 = every SM.
int check_num_sms(int64_t num_sms, const char* op) {
  STD_TORCH_CHECK(num_sms >= 0 && num_sms <= (int64_t(1) << 20), "prime_kernels.", op, ": num_sms = ", num_sms,
                  ", must be >= 1 (or 0: every SM)");
  return static_cast<int>(num_sms);
}

// The L2 dgrad's operands, checked (m_grouped_bf16_gemm_swiglu_bwd and mega_moe_bwd_fused), and its outputs
// allocated: dh [M, 2I], aw = w * s [M, I], dt_part [M, ceil(I/128)] (M = dy_pool's rows) with dt_part zeroed: the
// kernels write the rows of the groups only, and the rows after the last group must be zeros, so that a sum over
// every row (the grouped backward's d topk_weights) reads nothing uninitialised.
SwigluBwdOperands swiglu_bwd_operands(const Tensor& dy_pool, const Tensor& w2, const Tensor& group_offsets,
                                      const Tensor& h, const Tensor& pool_src_route, const Tensor& topk_weights,
                                      const char* op) {
  check_bf16_cuda(dy_pool, op, "dy_pool", 2);
  check_bf16_cuda(w2, op, "w2", 3);
  check_bf16_cuda(h, op, "h", 2);
  SwigluBwdOperands o;
  o.num_groups = check_offsets(group_offsets, dy_pool, op);
  o.m_total = dy_pool.size(0);
  o.hidden = dy_pool.size(1);
  o.inter = w2.size(2);
  STD_TORCH_CHECK(w2.size(0) == o.num_groups && w2.size(1) == o.hidden && w2.stride(2) == 1, "prime_kernels.", op,
                  ": w2 must be [num_groups, H, I] (I contiguous) with H = dy's columns");
  STD_TORCH_CHECK(o.inter % 64 == 0, "prime_kernels.", op, ": I (w2's last dim) must be a multiple of 64, got ",
                  o.inter);
  STD_TORCH_CHECK(h.size(0) >= o.m_total && h.size(1) == 2 * o.inter, "prime_kernels.", op,
                  ": h must be [>= pool rows, 2I]");
  STD_TORCH_CHECK(pool_src_route.scalar_type() == ScalarType::Int && pool_src_route.is_contiguous() &&
                      pool_src_route.numel() >= o.m_total && pool_src_route.is_cuda(),
                  "prime_kernels.", op, ": pool_src_route must be a contiguous CUDA int32 tensor with >= rows entries");
  STD_TORCH_CHECK(topk_weights.scalar_type() == ScalarType::Float && topk_weights.is_contiguous() &&
                      topk_weights.is_cuda(),
                  "prime_kernels.", op, ": topk_weights must be a contiguous CUDA fp32 tensor");
  o.n_blocks = (o.inter + 127) / 128;  // d topk_weights partials: one per 128 columns of I
  o.dh = new_tensor(dy_pool, {o.m_total, 2 * o.inter}, ScalarType::BFloat16);
  o.aw = new_tensor(dy_pool, {o.m_total, o.inter}, ScalarType::BFloat16);
  o.dt_part = new_tensor(dy_pool, {o.m_total, o.n_blocks}, ScalarType::Float);
  torch::stable::zero_(o.dt_part);
  return o;
}

}  // namespace prime_kernels::torch_shim

namespace {

using namespace prime_kernels::torch_shim;

struct PlanInput {
  int64_t num_tokens;
  int64_t top_k;
  bool is_int64;
};

PlanInput check_plan_input(const Tensor& topk_idx, int64_t num_experts, int64_t block_m) {
  STD_TORCH_CHECK(topk_idx.dim() == 2, "prime_kernels.routing_plan: topk_idx must be 2-D [num_tokens, top_k], got ",
                  topk_idx.dim(), "-D");
  const ScalarType dt = topk_idx.scalar_type();
  STD_TORCH_CHECK(dt == ScalarType::Long || dt == ScalarType::Int,
                  "prime_kernels.routing_plan: topk_idx must be int64 or int32");
  STD_TORCH_CHECK(topk_idx.is_contiguous(), "prime_kernels.routing_plan: topk_idx must be contiguous");
  STD_TORCH_CHECK(num_experts >= 1, "prime_kernels.routing_plan: num_experts must be >= 1");
  STD_TORCH_CHECK(block_m >= 1, "prime_kernels.routing_plan: block_m must be >= 1");
  return PlanInput{topk_idx.size(0), topk_idx.size(1), dt == ScalarType::Long};
}

using PlanOutputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// capacity: pool rows to allocate, -1 for the fewest the plan can need (a caller that keeps a larger fixed
// capacity gets the rows past the plan's end as padding, -1, with no separate copy).
PlanOutputs allocate_plan(const Tensor& like, const PlanInput& in, int64_t num_experts, int64_t block_m,
                          int64_t capacity) {
  const int64_t needed = pk_routing_plan_pool_capacity(in.num_tokens, in.top_k, num_experts, block_m);
  STD_TORCH_CHECK(needed >= 0, "prime_kernels.routing_plan: invalid sizes");
  STD_TORCH_CHECK(capacity == -1 || capacity >= needed, "prime_kernels.routing_plan: capacity = ", capacity,
                  " is below the ", needed, " pool rows this plan may need (-1: exactly those)");
  if (capacity == -1) capacity = needed;
  auto i32 = [&](std::vector<int64_t> sizes) {
    return torch::stable::new_empty(like, torch::headeronly::IntHeaderOnlyArrayRef(sizes.data(), sizes.size()),
                                    ScalarType::Int);
  };
  return {i32({num_experts}), i32({num_experts + 1}), i32({capacity}), i32({capacity}),
          i32({in.num_tokens, in.top_k}), i32({1})};
}

PlanOutputs routing_plan_cpu(Tensor topk_idx, int64_t num_experts, int64_t block_m, int64_t rank, int64_t capacity) {
  const PlanInput in = check_plan_input(topk_idx, num_experts, block_m);
  PlanOutputs out = allocate_plan(topk_idx, in, num_experts, block_m, capacity);
  auto& [counts, offsets, src_route, src_rank, route_to_pool, num_invalid] = out;
  check_core(pk_routing_plan_cpu(topk_idx.data_ptr(), in.is_int64, in.num_tokens, in.top_k, num_experts, block_m,
                                 static_cast<int32_t>(rank), static_cast<int32_t*>(counts.data_ptr()),
                                 static_cast<int32_t*>(offsets.data_ptr()),
                                 static_cast<int32_t*>(src_route.data_ptr()),
                                 static_cast<int32_t*>(src_rank.data_ptr()), src_route.numel(),
                                 static_cast<int32_t*>(route_to_pool.data_ptr()),
                                 static_cast<int32_t*>(num_invalid.data_ptr())),
             "routing_plan");
  return out;
}

PlanOutputs routing_plan_cuda(Tensor topk_idx, int64_t num_experts, int64_t block_m, int64_t rank,
                              int64_t capacity) {
  check_core(pk_device_check(), "routing_plan");  // a lost context or an earlier call's findings, said first
  const PlanInput in = check_plan_input(topk_idx, num_experts, block_m);
  const int32_t device = topk_idx.get_device_index();
  torch::stable::accelerator::DeviceGuard guard(device);
  PlanOutputs out = allocate_plan(topk_idx, in, num_experts, block_m, capacity);
  auto& [counts, offsets, src_route, src_rank, route_to_pool, num_invalid] = out;
  const int64_t ws_bytes = pk_routing_plan_workspace_bytes(in.num_tokens, in.top_k, num_experts);
  STD_TORCH_CHECK(ws_bytes >= 0, "prime_kernels.routing_plan: invalid sizes");
  std::vector<int64_t> ws_size{(ws_bytes + 3) / 4};
  Tensor workspace = torch::stable::new_empty(
      topk_idx, torch::headeronly::IntHeaderOnlyArrayRef(ws_size.data(), ws_size.size()), ScalarType::Int);
  check_core(pk_routing_plan_cuda(topk_idx.data_ptr(), in.is_int64, in.num_tokens, in.top_k, num_experts, block_m,
                                  static_cast<int32_t>(rank), static_cast<int32_t*>(counts.data_ptr()),
                                  static_cast<int32_t*>(offsets.data_ptr()),
                                  static_cast<int32_t*>(src_route.data_ptr()),
                                  static_cast<int32_t*>(src_rank.data_ptr()), src_route.numel(),
                                  static_cast<int32_t*>(route_to_pool.data_ptr()),
                                  static_cast<int32_t*>(num_invalid.data_ptr()), workspace.data_ptr(),
                                  workspace.numel() * 4, current_cuda_stream(device)),
             "routing_plan");
  return out;
}

// ---------------------------------------------------------------------------------------------
// Grouped GEMMs. Operands may be row-strided (unit stride in the last dim); the core checks sizes
// and alignment. Outputs are allocated here.
// ---------------------------------------------------------------------------------------------
Tensor m_grouped_gemm(const Tensor& a, const Tensor& b, const Tensor& offsets, bool b_k_major, int64_t num_sms,
                      const char* op) {
  const int sms = check_num_sms(num_sms, op);
  check_bf16_cuda(a, op, "a", 2);
  check_bf16_cuda(b, op, "b", 3);
  STD_TORCH_CHECK(b.get_device_index() == a.get_device_index(), "prime_kernels.", op, ": a and b on different devices");
  const int32_t num_groups = check_offsets(offsets, a, op);
  STD_TORCH_CHECK(b.size(0) == num_groups, "prime_kernels.", op, ": b has ", b.size(0), " groups, group_offsets ",
                  num_groups);
  const int64_t k = a.size(1);
  const int64_t n = b_k_major ? b.size(1) : b.size(2);
  STD_TORCH_CHECK((b_k_major ? b.size(2) : b.size(1)) == k, "prime_kernels.", op, ": b's K (",
                  b_k_major ? b.size(2) : b.size(1), ") does not match a's K (", k, ")");
  torch::stable::accelerator::DeviceGuard guard(a.get_device_index());
  Tensor d = new_tensor(a, {a.size(0), n}, ScalarType::BFloat16);
  check_core(pk_m_grouped_bf16_gemm(a.data_ptr(), a.stride(0), b.data_ptr(), b_k_major ? 1 : 0, b.stride(1),
                                    b.stride(0), d.data_ptr(), d.stride(0),
                                    static_cast<const int32_t*>(offsets.data_ptr()), num_groups, a.size(0), n, k, sms,
                                    current_cuda_stream(a.get_device_index())),
             op);
  return d;
}

Tensor m_grouped_bf16_gemm_nt(Tensor a, Tensor b, Tensor group_offsets, int64_t num_sms) {
  return m_grouped_gemm(a, b, group_offsets, true, num_sms, "m_grouped_bf16_gemm_nt");
}

Tensor m_grouped_bf16_gemm_nn(Tensor a, Tensor b, Tensor group_offsets, int64_t num_sms) {
  return m_grouped_gemm(a, b, group_offsets, false, num_sms, "m_grouped_bf16_gemm_nn");
}

void k_grouped_launch(const Tensor& a, const Tensor& b, const Tensor& offsets, const Tensor& c, bool accumulate,
                      int64_t num_sms, const char* op) {
  const int sms = check_num_sms(num_sms, op);
  check_bf16_cuda(a, op, "a", 2);
  check_bf16_cuda(b, op, "b", 2);
  STD_TORCH_CHECK(a.size(0) == b.size(0), "prime_kernels.", op, ": a and b must have the same rows (tokens), got ",
                  a.size(0), " and ", b.size(0));
  STD_TORCH_CHECK(b.get_device_index() == a.get_device_index(), "prime_kernels.", op, ": a and b on different devices");
  const int32_t num_groups = check_offsets(offsets, a, op);
  torch::stable::accelerator::DeviceGuard guard(a.get_device_index());
  check_core(pk_k_grouped_bf16_gemm(a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), c.data_ptr(),
                                    c.scalar_type() == ScalarType::BFloat16 ? 1 : 0, accumulate ? 1 : 0,
                                    static_cast<const int32_t*>(offsets.data_ptr()), num_groups, a.size(0), a.size(1),
                                    b.size(1), sms, current_cuda_stream(a.get_device_index())),
             op);
}

Tensor k_grouped_bf16_gemm_tn(Tensor a, Tensor b, Tensor group_offsets, bool out_fp32, int64_t num_sms) {
  const char* op = "k_grouped_bf16_gemm_tn";
  STD_TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && group_offsets.dim() == 1, "prime_kernels.", op,
                  ": a [P, M], b [P, N], group_offsets [E + 1] expected");
  Tensor c = new_tensor(a, {group_offsets.size(0) - 1, a.size(1), b.size(1)},
                        out_fp32 ? ScalarType::Float : ScalarType::BFloat16);
  k_grouped_launch(a, b, group_offsets, c, false, num_sms, op);
  return c;
}

void k_grouped_bf16_gemm_tn_accumulate_(Tensor a, Tensor b, Tensor group_offsets, Tensor c, int64_t num_sms) {
  const char* op = "k_grouped_bf16_gemm_tn_accumulate_";
  STD_TORCH_CHECK(c.scalar_type() == ScalarType::Float && c.is_contiguous() && c.dim() == 3, "prime_kernels.", op,
                  ": c must be a contiguous fp32 [E, M, N] tensor");
  STD_TORCH_CHECK(c.is_cuda() && c.get_device_index() == a.get_device_index(), "prime_kernels.", op,
                  ": c must be on the operands' CUDA device");
  STD_TORCH_CHECK(c.size(0) == group_offsets.size(0) - 1 && c.size(1) == a.size(1) && c.size(2) == b.size(1),
                  "prime_kernels.", op, ": c must be [E, M, N] = [", group_offsets.size(0) - 1, ", ", a.size(1), ", ",
                  b.size(1), "]");
  k_grouped_launch(a, b, group_offsets, c, true, num_sms, op);
}

Tensor m_grouped_bf16_gemm_nt_gather(Tensor a, Tensor b, Tensor group_offsets, Tensor a_row_index,
                                     int64_t m_total, int64_t num_sms) {
  const char* op = "m_grouped_bf16_gemm_nt_gather";
  const int sms = check_num_sms(num_sms, op);
  check_bf16_cuda(a, op, "a", 2);
  check_bf16_cuda(b, op, "b", 3);
  const int32_t num_groups = check_offsets(group_offsets, a, op);
  STD_TORCH_CHECK(b.size(0) == num_groups && b.size(2) == a.size(1), "prime_kernels.", op,
                  ": b must be [num_groups, N, K] with K = a's columns");
  STD_TORCH_CHECK(a_row_index.scalar_type() == ScalarType::Int && a_row_index.dim() == 1 &&
                      a_row_index.is_contiguous() && a_row_index.size(0) >= m_total && a_row_index.is_cuda(),
                  "prime_kernels.", op, ": a_row_index must be a contiguous CUDA int32 [>= m_total] tensor");
  torch::stable::accelerator::DeviceGuard guard(a.get_device_index());
  Tensor d = new_tensor(a, {m_total, b.size(1)}, ScalarType::BFloat16);
  check_core(pk_m_grouped_bf16_gemm_gather_a(a.data_ptr(), a.stride(0), a.size(0),
                                             static_cast<const int32_t*>(a_row_index.data_ptr()), b.data_ptr(), 1,
                                             b.stride(1), b.stride(0), d.data_ptr(), d.stride(0),
                                             static_cast<const int32_t*>(group_offsets.data_ptr()), num_groups,
                                             m_total, b.size(1), a.size(1), sms,
                                             current_cuda_stream(a.get_device_index())),
             op);
  return d;
}

// Blockwise FP8 m-grouped GEMM. a e4m3 [M, K], b e4m3 [E, N, K] (unit stride in K), sa fp32 [M, K / 128] K-block major
// (stride(0) == 1: column kb of sa is contiguous over the rows; stride(1) is the core's ld_sa), sb fp32
// [E, ceil(N / 128), K / 128] (unit stride in its last dim). The core checks K, strides and alignment.
void check_fp8_cuda(const Tensor& t, const char* op, const char* name, int64_t dim) {
  STD_TORCH_CHECK(t.is_cuda(), "prime_kernels.", op, ": ", name, " must be a CUDA tensor");
  STD_TORCH_CHECK(t.scalar_type() == ScalarType::Float8_e4m3fn, "prime_kernels.", op, ": ", name,
                  " must be float8_e4m3fn");
  STD_TORCH_CHECK(t.dim() == dim, "prime_kernels.", op, ": ", name, " must be ", dim, "-D, got ", t.dim(), "-D");
  STD_TORCH_CHECK(t.stride(dim - 1) == 1, "prime_kernels.", op, ": ", name, " must have unit stride in its last dim");
}

Tensor m_grouped_fp8_gemm_nt(Tensor a, Tensor sa, Tensor b, Tensor sb, Tensor group_offsets, int64_t num_sms) {
  const char* op = "m_grouped_fp8_gemm_nt";
  const int sms = check_num_sms(num_sms, op);
  check_fp8_cuda(a, op, "a", 2);
  check_fp8_cuda(b, op, "b", 3);
  STD_TORCH_CHECK(b.get_device_index() == a.get_device_index(), "prime_kernels.", op, ": a and b on different devices");
  const int32_t num_groups = check_offsets(group_offsets, a, op);
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  STD_TORCH_CHECK(b.size(0) == num_groups, "prime_kernels.", op, ": b has ", b.size(0), " groups, group_offsets ",
                  num_groups);
  STD_TORCH_CHECK(b.size(2) == k, "prime_kernels.", op, ": b's K (", b.size(2), ") does not match a's K (", k, ")");
  const int64_t kb = (k + 127) / 128, nb = (n + 127) / 128;
  STD_TORCH_CHECK(sa.is_cuda() && sa.get_device_index() == a.get_device_index() && sa.scalar_type() == ScalarType::Float,
                  "prime_kernels.", op, ": sa must be a float32 tensor on a's device");
  STD_TORCH_CHECK(k % 64 == 0, "prime_kernels.", op, ": K (", k,
                  ") must be a multiple of 64 (one scale block per 128 of K, the last one 64 wide when K is 64 mod "
                  "128)");
  // sa [M, K / 64]: A quantized 1 x 64 (the FP8 forward's L2 operand); else one scale per 128 of K. At K = 64 the
  // two read alike (one block of 64 columns), and it is taken as the latter.
  const bool a64 = sa.dim() == 2 && sa.size(1) == k / 64 && k / 64 != kb;
  STD_TORCH_CHECK(sa.dim() == 2 && sa.size(0) == m && (sa.size(1) == kb || a64), "prime_kernels.", op,
                  ": sa must be [M, ceil(K / 128)] = [", m, ", ", kb, "] or [M, K / 64] = [", m, ", ", k / 64, "]");
  STD_TORCH_CHECK(m <= 1 || sa.stride(0) == 1, "prime_kernels.", op,
                  ": sa must be K-block major (stride(0) == 1, e.g. the transpose of a contiguous [K / 128, M'] tensor "
                  "with M' >= M a multiple of 4), got strides (", sa.stride(0), ", ", sa.stride(1), ")");
  STD_TORCH_CHECK(sb.is_cuda() && sb.get_device_index() == a.get_device_index() && sb.scalar_type() == ScalarType::Float,
                  "prime_kernels.", op, ": sb must be a float32 tensor on a's device");
  STD_TORCH_CHECK(sb.dim() == 3 && sb.size(0) == num_groups && sb.size(1) == nb && sb.size(2) == kb, "prime_kernels.",
                  op, ": sb must be [E, ceil(N / 128), ceil(K / 128)] = [", num_groups, ", ", nb, ", ", kb, "]");
  STD_TORCH_CHECK(sb.stride(2) == 1 || kb == 1, "prime_kernels.", op, ": sb must have unit stride in its last dim");
  // With one k-block sa's stride between k-blocks is never used (torch may report any value for it).
  const int64_t ld_sa = sa.size(1) == 1 ? (m + 3) / 4 * 4 : sa.stride(1);
  torch::stable::accelerator::DeviceGuard guard(a.get_device_index());
  Tensor d = new_tensor(a, {m, n}, ScalarType::BFloat16);
  check_core(pk_m_grouped_fp8_gemm_nt(a.data_ptr(), a.stride(0), static_cast<const float*>(sa.data_ptr()), ld_sa,
                                      b.data_ptr(), b.stride(1), b.stride(0), static_cast<const float*>(sb.data_ptr()),
                                      sb.stride(0), nb == 1 ? kb : sb.stride(1), d.data_ptr(), d.stride(0),
                                      static_cast<const int32_t*>(group_offsets.data_ptr()), num_groups, m, n, k,
                                      a64 ? 64 : 128, sms, current_cuda_stream(a.get_device_index())),
             op);
  return d;
}

// Blockwise FP8 k-grouped GEMM (weight gradients). a e4m3 [M, P], b e4m3 [N, P]: the operands stored token axis
// contiguous (unit stride in P); sa fp32 [M, ceil(P / 128)], sb fp32 [N, ceil(P / 128)], both K-block major
// (stride(0) == 1: one row of scales per 128-row token block; stride(1) is the core's ld_sa / ld_sb). The core checks
// strides and alignment; the device checks the offsets (non-decreasing, multiples of 128 or P).
int64_t fp8_token_block_scales_ld(const Tensor& s, const Tensor& like, int64_t cols, int64_t kb, const char* op,
                                  const char* name, const char* cols_name) {
  STD_TORCH_CHECK(s.is_cuda() && s.get_device_index() == like.get_device_index() && s.scalar_type() == ScalarType::Float,
                  "prime_kernels.", op, ": ", name, " must be a float32 tensor on a's device");
  STD_TORCH_CHECK(s.dim() == 2 && s.size(0) == cols && s.size(1) == kb, "prime_kernels.", op, ": ", name,
                  " must be [", cols_name, ", ceil(P / 128)] = [", cols, ", ", kb, "]");
  STD_TORCH_CHECK(cols <= 1 || kb == 0 || s.stride(0) == 1, "prime_kernels.", op, ": ", name,
                  " must be K-block major (stride(0) == 1, e.g. the transpose of a contiguous [ceil(P / 128), C'] tensor "
                  "with C' >= C a multiple of 4), got strides (", s.stride(0), ", ", s.stride(1), ")");
  // With one token block the stride between blocks is never used (torch may report any value for it).
  return kb <= 1 ? (cols + 3) / 4 * 4 : s.stride(1);
}

void k_grouped_fp8_launch(const Tensor& a, const Tensor& sa, const Tensor& b, const Tensor& sb, const Tensor& offsets,
                          const Tensor& c, bool accumulate, int64_t num_sms, const char* op) {
  const int sms = check_num_sms(num_sms, op);
  check_fp8_cuda(a, op, "a", 2);
  check_fp8_cuda(b, op, "b", 2);
  STD_TORCH_CHECK(b.get_device_index() == a.get_device_index(), "prime_kernels.", op, ": a and b on different devices");
  STD_TORCH_CHECK(a.size(1) == b.size(1), "prime_kernels.", op,
                  ": a [M, P] and b [N, P] must have the same token count P, got ", a.size(1), " and ", b.size(1));
  const int32_t num_groups = check_offsets(offsets, a, op);
  const int64_t m = a.size(0), n = b.size(0), p = a.size(1), kb = (p + 127) / 128;
  const int64_t ld_sa = fp8_token_block_scales_ld(sa, a, m, kb, op, "sa", "M");
  const int64_t ld_sb = fp8_token_block_scales_ld(sb, a, n, kb, op, "sb", "N");
  torch::stable::accelerator::DeviceGuard guard(a.get_device_index());
  check_core(pk_k_grouped_fp8_gemm_tn(a.data_ptr(), a.stride(0), static_cast<const float*>(sa.data_ptr()), ld_sa,
                                      b.data_ptr(), b.stride(0), static_cast<const float*>(sb.data_ptr()), ld_sb,
                                      c.data_ptr(), c.scalar_type() == ScalarType::BFloat16 ? 1 : 0,
                                      accumulate ? 1 : 0, static_cast<const int32_t*>(offsets.data_ptr()), num_groups,
                                      p, m, n, sms, current_cuda_stream(a.get_device_index())),
             op);
}

Tensor k_grouped_fp8_gemm_tn(Tensor a, Tensor sa, Tensor b, Tensor sb, Tensor group_offsets, bool out_fp32,
                             int64_t num_sms) {
  const char* op = "k_grouped_fp8_gemm_tn";
  STD_TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && group_offsets.dim() == 1, "prime_kernels.", op,
                  ": a [M, P], b [N, P], group_offsets [E + 1] expected");
  Tensor c = new_tensor(a, {group_offsets.size(0) - 1, a.size(0), b.size(0)},
                        out_fp32 ? ScalarType::Float : ScalarType::BFloat16);
  k_grouped_fp8_launch(a, sa, b, sb, group_offsets, c, false, num_sms, op);
  return c;
}

void k_grouped_fp8_gemm_tn_accumulate_(Tensor a, Tensor sa, Tensor b, Tensor sb, Tensor group_offsets, Tensor c,
                                       int64_t num_sms) {
  const char* op = "k_grouped_fp8_gemm_tn_accumulate_";
  STD_TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && group_offsets.dim() == 1, "prime_kernels.", op,
                  ": a [M, P], b [N, P], group_offsets [E + 1] expected");
  STD_TORCH_CHECK(c.scalar_type() == ScalarType::Float && c.is_contiguous() && c.dim() == 3, "prime_kernels.", op,
                  ": c must be a contiguous fp32 [E, M, N] tensor");
  STD_TORCH_CHECK(c.is_cuda() && c.get_device_index() == a.get_device_index(), "prime_kernels.", op,
                  ": c must be on the operands' CUDA device");
  STD_TORCH_CHECK(c.size(0) == group_offsets.size(0) - 1 && c.size(1) == a.size(0) && c.size(2) == b.size(0),
                  "prime_kernels.", op, ": c must be [E, M, N] = [", group_offsets.size(0) - 1, ", ", a.size(0), ", ",
                  b.size(0), "]");
  k_grouped_fp8_launch(a, sa, b, sb, group_offsets, c, true, num_sms, op);
}

// ---------------------------------------------------------------------------------------------
// Combine (CPU: the core's host loop, same order and rounding as the kernel).
// ---------------------------------------------------------------------------------------------
struct CombineInput {
  int64_t num_tokens, top_k, hidden;
  const float* weights;
};

CombineInput check_combine_input(const Tensor& slots, const Tensor& route_to_pool,
                                 const std::optional<Tensor>& weights) {
  const char* op = "combine";
  STD_TORCH_CHECK(slots.scalar_type() == ScalarType::BFloat16 && slots.dim() == 2 && slots.stride(1) == 1,
                  "prime_kernels.", op, ": slots must be a bfloat16 [rows, H] tensor with unit column stride");
  STD_TORCH_CHECK(route_to_pool.scalar_type() == ScalarType::Int && route_to_pool.dim() == 2 &&
                      route_to_pool.is_contiguous(),
                  "prime_kernels.", op, ": route_to_pool must be a contiguous int32 [T, K] tensor");
  const float* w = nullptr;
  if (weights.has_value()) {
    const Tensor& t = *weights;
    STD_TORCH_CHECK(t.scalar_type() == ScalarType::Float && t.is_contiguous() && t.dim() == 2 &&
                        t.size(0) == route_to_pool.size(0) && t.size(1) == route_to_pool.size(1),
                    "prime_kernels.", op, ": weights must be a contiguous fp32 tensor shaped like route_to_pool");
    STD_TORCH_CHECK(t.get_device_index() == slots.get_device_index() && t.is_cuda() == slots.is_cuda(),
                    "prime_kernels.", op, ": weights must be on the slots' device");
    w = static_cast<const float*>(t.data_ptr());
  }
  STD_TORCH_CHECK(route_to_pool.is_cuda() == slots.is_cuda() &&
                      route_to_pool.get_device_index() == slots.get_device_index(),
                  "prime_kernels.", op, ": route_to_pool must be on the slots' device");
  return CombineInput{route_to_pool.size(0), route_to_pool.size(1), slots.size(1), w};
}

Tensor combine_cpu(Tensor slots, Tensor route_to_pool, std::optional<Tensor> weights) {
  const CombineInput in = check_combine_input(slots, route_to_pool, weights);
  Tensor out = new_tensor(slots, {in.num_tokens, in.hidden}, ScalarType::BFloat16);
  check_core(pk_combine_bf16_cpu(slots.data_ptr(), slots.stride(0), slots.size(0),
                                 static_cast<const int32_t*>(route_to_pool.data_ptr()), in.weights, in.num_tokens,
                                 in.top_k, in.hidden, out.data_ptr(), out.stride(0)),
             "combine");
  return out;
}

Tensor combine_cuda(Tensor slots, Tensor route_to_pool, std::optional<Tensor> weights) {
  const CombineInput in = check_combine_input(slots, route_to_pool, weights);
  torch::stable::accelerator::DeviceGuard guard(slots.get_device_index());
  Tensor out = new_tensor(slots, {in.num_tokens, in.hidden}, ScalarType::BFloat16);
  check_core(pk_combine_bf16_cuda(slots.data_ptr(), slots.stride(0), slots.size(0),
                                  static_cast<const int32_t*>(route_to_pool.data_ptr()), in.weights, in.num_tokens,
                                  in.top_k, in.hidden, out.data_ptr(), out.stride(0),
                                  current_cuda_stream(slots.get_device_index())),
             "combine");
  return out;
}

// Dispatch, the combine's transpose: out[route_to_pool[t, k]] = src[t]; other rows of out keep their contents.
void check_dispatch_input(const Tensor& src, const Tensor& route_to_pool, const Tensor& out) {
  const char* op = "dispatch_rows_";
  STD_TORCH_CHECK(src.scalar_type() == ScalarType::BFloat16 && src.dim() == 2 && src.stride(1) == 1, "prime_kernels.",
                  op, ": src must be a bfloat16 [T, H] tensor with unit column stride");
  STD_TORCH_CHECK(out.scalar_type() == ScalarType::BFloat16 && out.dim() == 2 && out.stride(1) == 1 &&
                      out.size(1) == src.size(1),
                  "prime_kernels.", op, ": out must be a bfloat16 [rows, H] tensor with src's H and unit column stride");
  STD_TORCH_CHECK(route_to_pool.scalar_type() == ScalarType::Int && route_to_pool.dim() == 2 &&
                      route_to_pool.is_contiguous() && route_to_pool.size(0) == src.size(0),
                  "prime_kernels.", op, ": route_to_pool must be a contiguous int32 [T, K] tensor with src's T rows");
  STD_TORCH_CHECK(route_to_pool.is_cuda() == src.is_cuda() && out.is_cuda() == src.is_cuda() &&
                      route_to_pool.get_device_index() == src.get_device_index() &&
                      out.get_device_index() == src.get_device_index(),
                  "prime_kernels.", op, ": src, route_to_pool and out must be on one device");
}

void dispatch_rows_cpu(Tensor src, Tensor route_to_pool, Tensor out) {
  check_dispatch_input(src, route_to_pool, out);
  check_core(pk_dispatch_rows_bf16_cpu(src.data_ptr(), src.stride(0),
                                       static_cast<const int32_t*>(route_to_pool.data_ptr()), route_to_pool.size(0),
                                       route_to_pool.size(1), src.size(1), out.data_ptr(), out.stride(0), out.size(0)),
             "dispatch_rows_");
}

void dispatch_rows_cuda(Tensor src, Tensor route_to_pool, Tensor out) {
  check_dispatch_input(src, route_to_pool, out);
  torch::stable::accelerator::DeviceGuard guard(src.get_device_index());
  check_core(pk_dispatch_rows_bf16_cuda(src.data_ptr(), src.stride(0),
                                        static_cast<const int32_t*>(route_to_pool.data_ptr()), route_to_pool.size(0),
                                        route_to_pool.size(1), src.size(1), out.data_ptr(), out.stride(0),
                                        out.size(0), current_cuda_stream(src.get_device_index())),
             "dispatch_rows_");
}

// ---------------------------------------------------------------------------------------------
// Pool-row SwiGLU (CUDA; the CPU kernels are the Python reference in prime_kernels/mega/_grouped.py).
// ---------------------------------------------------------------------------------------------
void check_rows_scalar(const Tensor& num_rows, const Tensor& like, const char* op) {
  STD_TORCH_CHECK(num_rows.scalar_type() == ScalarType::Int && num_rows.numel() == 1 && num_rows.is_cuda() &&
                      num_rows.get_device_index() == like.get_device_index(),
                  "prime_kernels.", op, ": num_rows must be a one-element int32 tensor on the operands' device");
}

Tensor swiglu_fwd(Tensor h, Tensor num_rows, double clamp) {
  const char* op = "swiglu_fwd";
  check_bf16_cuda(h, op, "h", 2);
  check_rows_scalar(num_rows, h, op);
  STD_TORCH_CHECK(h.size(1) % 2 == 0, "prime_kernels.", op, ": h must be [rows, 2I]");
  const int64_t inter = h.size(1) / 2;
  torch::stable::accelerator::DeviceGuard guard(h.get_device_index());
  Tensor s = new_tensor(h, {h.size(0), inter}, ScalarType::BFloat16);
  check_core(pk_swiglu_fwd_bf16_cuda(h.data_ptr(), h.stride(0), s.data_ptr(), s.stride(0), inter,
                                     static_cast<const int32_t*>(num_rows.data_ptr()), h.size(0),
                                     static_cast<float>(clamp), current_cuda_stream(h.get_device_index())),
             op);
  return s;
}

std::tuple<Tensor, Tensor, Tensor> swiglu_bwd(Tensor h, Tensor da, Tensor pool_src_route, Tensor topk_weights,
                                              Tensor num_rows, double clamp) {
  const char* op = "swiglu_bwd";
  check_bf16_cuda(h, op, "h", 2);
  check_bf16_cuda(da, op, "da", 2);
  check_rows_scalar(num_rows, h, op);
  const int64_t inter = h.size(1) / 2;
  STD_TORCH_CHECK(h.size(1) == 2 * inter && da.size(1) == inter && da.size(0) == h.size(0), "prime_kernels.", op,
                  ": h must be [rows, 2I] and da [rows, I]");
  STD_TORCH_CHECK(pool_src_route.scalar_type() == ScalarType::Int && pool_src_route.is_contiguous() &&
                      pool_src_route.numel() >= h.size(0) && pool_src_route.is_cuda(),
                  "prime_kernels.", op, ": pool_src_route must be a contiguous CUDA int32 tensor with >= rows entries");
  STD_TORCH_CHECK(topk_weights.scalar_type() == ScalarType::Float && topk_weights.is_contiguous() &&
                      topk_weights.is_cuda(),
                  "prime_kernels.", op, ": topk_weights must be a contiguous CUDA fp32 tensor");
  torch::stable::accelerator::DeviceGuard guard(h.get_device_index());
  Tensor dh = new_tensor(h, {h.size(0), 2 * inter}, ScalarType::BFloat16);
  Tensor a = new_tensor(h, {h.size(0), inter}, ScalarType::BFloat16);
  Tensor dt = new_tensor(h, {h.size(0)}, ScalarType::Float);
  check_core(pk_swiglu_bwd_bf16_cuda(h.data_ptr(), h.stride(0), da.data_ptr(), da.stride(0),
                                     static_cast<const int32_t*>(pool_src_route.data_ptr()),
                                     static_cast<const float*>(topk_weights.data_ptr()), topk_weights.numel(), inter,
                                     static_cast<const int32_t*>(num_rows.data_ptr()), h.size(0),
                                     static_cast<float>(clamp), dh.data_ptr(), dh.stride(0), a.data_ptr(), a.stride(0),
                                     static_cast<float*>(dt.data_ptr()), current_cuda_stream(h.get_device_index())),
             op);
  return {dh, a, dt};
}

std::tuple<Tensor, Tensor> m_grouped_bf16_gemm_swiglu(Tensor a, Tensor w13, Tensor group_offsets,
                                                      std::optional<Tensor> a_row_index, int64_t m_total,
                                                      bool save_h, double clamp, int64_t num_sms) {
  const char* op = "m_grouped_bf16_gemm_swiglu";
  const int sms = check_num_sms(num_sms, op);
  check_bf16_cuda(a, op, "a", 2);
  check_bf16_cuda(w13, op, "w13", 3);
  const int32_t num_groups = check_offsets(group_offsets, a, op);
  STD_TORCH_CHECK(w13.size(0) == num_groups && w13.size(2) == a.size(1) && w13.size(1) % 2 == 0, "prime_kernels.", op,
                  ": w13 must be [num_groups, 2I, K] with K = a's columns");
  const int32_t* index = gather_index(a_row_index, a, m_total, op);
  const int64_t inter = w13.size(1) / 2;
  torch::stable::accelerator::DeviceGuard guard(a.get_device_index());
  Tensor s = new_tensor(a, {m_total, inter}, ScalarType::BFloat16);
  Tensor h = new_tensor(a, {save_h ? m_total : 0, 2 * inter}, ScalarType::BFloat16);
  check_core(pk_m_grouped_bf16_gemm_swiglu(a.data_ptr(), a.stride(0), a.size(0), index, w13.data_ptr(), w13.stride(1),
                                           w13.stride(0), inter, s.data_ptr(), s.stride(0),
                                           save_h ? h.data_ptr() : nullptr, 2 * inter,
                                           static_cast<const int32_t*>(group_offsets.data_ptr()), num_groups, m_total,
                                           a.size(1), static_cast<float>(clamp), sms,
                                           current_cuda_stream(a.get_device_index())),
             op);
  return {s, h};
}


// L2 dgrad + SwiGLU backward (B2-B6, B9 in one GEMM): dh, aw, dt_part as swiglu_bwd_operands allocates them; route
// weights are topk_weights flattened (every entry indexable by a route id).
std::tuple<Tensor, Tensor, Tensor> m_grouped_bf16_gemm_swiglu_bwd(Tensor dy_pool, Tensor w2, Tensor group_offsets,
                                                                  Tensor h, Tensor pool_src_route, Tensor topk_weights,
                                                                  double clamp, int64_t num_sms) {
  const char* op = "m_grouped_bf16_gemm_swiglu_bwd";
  const int sms = check_num_sms(num_sms, op);
  check_bf16_cuda(dy_pool, op, "dy_pool", 2);  // before its device index is used
  torch::stable::accelerator::DeviceGuard guard(dy_pool.get_device_index());
  SwigluBwdOperands o = swiglu_bwd_operands(dy_pool, w2, group_offsets, h, pool_src_route, topk_weights, op);
  check_core(pk_m_grouped_bf16_gemm_swiglu_bwd(
                 dy_pool.data_ptr(), dy_pool.stride(0), w2.data_ptr(), w2.stride(1), w2.stride(0), h.data_ptr(),
                 h.stride(0), static_cast<const int32_t*>(pool_src_route.data_ptr()),
                 static_cast<const float*>(topk_weights.data_ptr()), topk_weights.numel(), o.dh.data_ptr(),
                 o.dh.stride(0), o.aw.data_ptr(), o.aw.stride(0), static_cast<float*>(o.dt_part.data_ptr()),
                 o.n_blocks, static_cast<const int32_t*>(group_offsets.data_ptr()), o.num_groups, o.m_total, o.inter,
                 o.hidden, static_cast<float>(clamp), sms, current_cuda_stream(dy_pool.get_device_index())),
             op);
  return {o.dh, o.aw, o.dt_part};
}

// Fused Mega MoE forward (single rank: the pointer table holds x alone). Returns s, h, o, the dispatched
// rows x_pool per pool row (x_pool only with keep_x_pool; h only with save_h) and, with route_to_pool [T, K],
// y = the weighted combine over o (the combine kernel right after the forward kernel; else an empty [0, hidden]
// tensor). With the combine, s (dead once the forward kernel is queued) is freed before y is allocated, so y can
// take its memory and the op's peak is lower by y's size; s is then returned empty ([0, I]).
// `forward` is the sm90 kernel's C ABI or the sm100 one's (one parameter list): both ops share every check and
// allocation, so the native sm100 forward sees exactly the arguments the verified sm90 forward does.
using FusedFwdAbi = decltype(&pk_mega_moe_fwd_bf16);
static_assert(std::is_same_v<FusedFwdAbi, decltype(&pk_mega_moe_fwd_bf16_sm100)>);

// w_experts: the experts w13 and w2 hold, when fewer than the plan's groups (the forward with a second B).
template <typename Forward>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> fused_fwd(
    Forward forward, const char* op, Tensor x, Tensor pool_src_route, Tensor expert_offsets, Tensor w13,
    Tensor w2, int64_t top_k, bool save_h, double clamp, bool keep_x_pool, std::optional<Tensor> route_to_pool,
    std::optional<Tensor> topk_weights, int64_t num_sms, int64_t w_experts = -1) {
  check_core(pk_device_check(), op);  // a lost context or an earlier call's findings, said first
  check_bf16_cuda(x, op, "x", 2);
  check_bf16_cuda(w13, op, "w13", 3);
  check_bf16_cuda(w2, op, "w2", 3);
  STD_TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "prime_kernels.", op, ": w13 and w2 must be contiguous");
  const int32_t num_experts = check_offsets(expert_offsets, x, op);
  const int64_t hidden = x.size(1);
  const int64_t experts = w_experts < 0 ? num_experts : w_experts;
  STD_TORCH_CHECK(w13.size(0) == experts && w13.size(2) == hidden && w13.size(1) % 2 == 0, "prime_kernels.", op,
                  ": w13 must be [num_experts, 2I, hidden]");
  const int64_t inter = w13.size(1) / 2;
  STD_TORCH_CHECK(w2.size(0) == experts && w2.size(1) == hidden && w2.size(2) == inter, "prime_kernels.", op,
                  ": w2 must be [num_experts, hidden, I]");
  STD_TORCH_CHECK(pool_src_route.scalar_type() == ScalarType::Int && pool_src_route.dim() == 1 &&
                      pool_src_route.is_contiguous() && pool_src_route.is_cuda(),
                  "prime_kernels.", op, ": pool_src_route must be a contiguous CUDA int32 [m_total] tensor");
  STD_TORCH_CHECK(num_sms >= 0 && num_sms <= (int64_t(1) << 20), "prime_kernels.", op, ": num_sms = ", num_sms,
                  ", must be >= 1 (or 0: every SM)");
  const int64_t m_total = pool_src_route.size(0);
  const int64_t num_tokens = x.size(0);
  STD_TORCH_CHECK(num_tokens < (int64_t(1) << 28), "prime_kernels.", op, ": at most 2^28 - 1 tokens");
  torch::stable::accelerator::DeviceGuard guard(x.get_device_index());
  Tensor s = new_tensor(x, {m_total, inter}, ScalarType::BFloat16);
  Tensor h = new_tensor(x, {save_h ? m_total : 0, 2 * inter}, ScalarType::BFloat16);
  Tensor o = new_tensor(x, {m_total, hidden}, ScalarType::BFloat16);
  // keep_x_pool: the dispatched rows get their own buffer (returned for the backward); otherwise they live
  // in o's memory until L2 overwrites them, and an empty [0, hidden] tensor is returned.
  Tensor x_pool = new_tensor(x, {keep_x_pool ? m_total : 0, hidden}, ScalarType::BFloat16);
  const bool combine = route_to_pool.has_value();
  STD_TORCH_CHECK(combine || !topk_weights.has_value(), "prime_kernels.", op,
                  ": topk_weights is only used with route_to_pool");
  const float* weights = nullptr;
  if (combine) {
    const CombineInput in = check_combine_input(o, *route_to_pool, topk_weights);
    STD_TORCH_CHECK(in.top_k == top_k && in.num_tokens == num_tokens && route_to_pool->is_cuda(), "prime_kernels.", op,
                    ": route_to_pool must be a CUDA int32 [T, top_k] tensor (T = x.size(0))");
    weights = in.weights;
  }
  Tensor counters = new_tensor(x, {pk_mega_moe_fwd_counter_count(m_total, num_experts)}, ScalarType::Int);
  const void* x_ranks[1] = {x.data_ptr()};
  check_core(forward(x_ranks, 1, x.stride(0), static_cast<const int32_t*>(pool_src_route.data_ptr()), nullptr,
                     static_cast<int>(top_k), static_cast<const int32_t*>(expert_offsets.data_ptr()), num_experts,
                     m_total, hidden, inter, w13.data_ptr(), w2.data_ptr(),
                     keep_x_pool ? x_pool.data_ptr() : o.data_ptr(), s.data_ptr(), save_h ? h.data_ptr() : nullptr,
                     o.data_ptr(), num_tokens,
                     combine ? static_cast<const int32_t*>(route_to_pool->data_ptr()) : nullptr,
                     static_cast<float>(clamp), static_cast<int32_t*>(counters.data_ptr()),
                     static_cast<int>(num_sms), current_cuda_stream(x.get_device_index())),
             op);
  Tensor y = new_tensor(x, {0, hidden}, ScalarType::BFloat16);
  if (combine) {
    s = new_tensor(x, {0, inter}, ScalarType::BFloat16);  // frees the pool-sized s (stream-ordered)
    y = new_tensor(x, {num_tokens, hidden}, ScalarType::BFloat16);
    check_core(pk_combine_bf16_cuda(o.data_ptr(), o.stride(0), o.size(0),
                                    static_cast<const int32_t*>(route_to_pool->data_ptr()),
                                    weights, num_tokens, top_k, hidden, y.data_ptr(), y.stride(0),
                                    current_cuda_stream(x.get_device_index())),
               op);
  }
  return {s, h, o, x_pool, y};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> mega_moe_fused_fwd(
    Tensor x, Tensor pool_src_route, Tensor expert_offsets, Tensor w13, Tensor w2, int64_t top_k, bool save_h,
    double clamp, bool keep_x_pool, std::optional<Tensor> route_to_pool, std::optional<Tensor> topk_weights,
    int64_t num_sms) {
  return fused_fwd(&pk_mega_moe_fwd_bf16, "mega_moe_fused_fwd", x, pool_src_route, expert_offsets, w13, w2, top_k,
                   save_h, clamp, keep_x_pool, route_to_pool, topk_weights, num_sms);
}

// The sm90 forward whose last groups are shared experts' chunks (pk_mega_moe_fwd_bf16_second_b): w13 / w2 hold the
// routed experts, shared_w13 [S, 2 * chunks * I, H] and shared_w2 [S, H, chunks * I] the shared ones.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> mega_moe_fused_fwd_second_b(
    Tensor x, Tensor pool_src_route, Tensor expert_offsets, Tensor w13, Tensor w2, int64_t top_k, bool save_h,
    double clamp, bool keep_x_pool, std::optional<Tensor> route_to_pool, std::optional<Tensor> topk_weights,
    int64_t num_sms, Tensor shared_w13, Tensor shared_w2, int64_t chunks) {
  const char* op = "mega_moe_fused_fwd_second_b";
  check_bf16_cuda(w13, op, "w13", 3);
  check_bf16_cuda(shared_w13, op, "shared_w13", 3);
  check_bf16_cuda(shared_w2, op, "shared_w2", 3);
  STD_TORCH_CHECK(shared_w13.is_contiguous() && shared_w2.is_contiguous() &&
                      shared_w13.get_device_index() == x.get_device_index() &&
                      shared_w2.get_device_index() == x.get_device_index(),
                  "prime_kernels.", op, ": shared_w13 and shared_w2 must be contiguous, on x's device");
  const int64_t inter = w13.size(1) / 2, slabs = shared_w13.size(0);
  STD_TORCH_CHECK(chunks >= 1 && chunks <= 512 && shared_w13.size(1) == 2 * chunks * inter &&
                      shared_w13.size(2) == x.size(1) && shared_w2.size(0) == slabs &&
                      shared_w2.size(1) == x.size(1) && shared_w2.size(2) == chunks * inter,
                  "prime_kernels.", op, ": shared_w13 must be [S, 2 * chunks * I, H] and shared_w2 [S, H, chunks * I]");
  PkMegaSecondB second{shared_w13.data_ptr(), shared_w2.data_ptr(), static_cast<int>(slabs),
                       static_cast<int>(chunks), static_cast<int>(w13.size(0))};
  auto forward = [&second](const void* const* x_ranks, int num_ranks, int64_t ld_x, const int32_t* src_route,
                           const int32_t* src_rank, int k, const int32_t* offsets, int groups, int64_t m_total,
                           int64_t hidden, int64_t i, const void* b13, const void* b2, void* x_pool, void* s, void* h,
                           void* o, int64_t num_tokens, const int32_t* r2p, float c, int32_t* counters, int sms,
                           void* stream) {
    return pk_mega_moe_fwd_bf16_second_b(x_ranks, num_ranks, ld_x, src_route, src_rank, k, offsets, groups, m_total,
                                         hidden, i, b13, b2, &second, x_pool, s, h, o, num_tokens, r2p, c, counters,
                                         sms, stream);
  };
  return fused_fwd(forward, op, x, pool_src_route, expert_offsets, w13, w2, top_k, save_h, clamp, keep_x_pool,
                   route_to_pool, topk_weights, num_sms, w13.size(0));
}

// The native sm_100a forward: PK_ERR_NOT_AVAILABLE (raised with its reason) on any other device and in a build
// without a Blackwell arch, before anything is launched.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> mega_moe_fused_fwd_sm100(
    Tensor x, Tensor pool_src_route, Tensor expert_offsets, Tensor w13, Tensor w2, int64_t top_k, bool save_h,
    double clamp, bool keep_x_pool, std::optional<Tensor> route_to_pool, std::optional<Tensor> topk_weights,
    int64_t num_sms) {
  return fused_fwd(&pk_mega_moe_fwd_bf16_sm100, "mega_moe_fused_fwd_sm100", x, pool_src_route, expert_offsets, w13,
                   w2, top_k, save_h, clamp, keep_x_pool, route_to_pool, topk_weights, num_sms);
}

}  // namespace

STABLE_TORCH_LIBRARY(prime_kernels, m) {
  m.def(
      "routing_plan(Tensor topk_idx, int num_experts, int block_m, int rank=0, int capacity=-1) -> "
      "(Tensor expert_counts, Tensor expert_offsets, Tensor pool_src_route, Tensor pool_src_rank, "
      "Tensor route_to_pool, Tensor num_invalid)");
  m.def("m_grouped_bf16_gemm_nt(Tensor a, Tensor b, Tensor group_offsets, int num_sms=0) -> Tensor");
  m.def("m_grouped_bf16_gemm_nn(Tensor a, Tensor b, Tensor group_offsets, int num_sms=0) -> Tensor");
  m.def("m_grouped_fp8_gemm_nt(Tensor a, Tensor sa, Tensor b, Tensor sb, Tensor group_offsets, int num_sms=0) -> Tensor");
  m.def("m_grouped_bf16_gemm_nt_gather(Tensor a, Tensor b, Tensor group_offsets, Tensor a_row_index, int m_total, "
        "int num_sms=0) -> Tensor");
  m.def("swiglu_fwd(Tensor h, Tensor num_rows, float clamp=-1.0) -> Tensor");
  m.def("swiglu_bwd(Tensor h, Tensor da, Tensor pool_src_route, Tensor topk_weights, Tensor num_rows, "
        "float clamp=-1.0) -> (Tensor dh, Tensor a, Tensor dt)");
  m.def("m_grouped_bf16_gemm_swiglu(Tensor a, Tensor w13, Tensor group_offsets, Tensor? a_row_index, int m_total, "
        "bool save_h, float clamp=0.0, int num_sms=0) -> (Tensor s, Tensor h)");
  m.def("m_grouped_bf16_gemm_swiglu_bwd(Tensor dy_pool, Tensor w2, Tensor group_offsets, Tensor h, "
        "Tensor pool_src_route, Tensor topk_weights, float clamp=0.0, int num_sms=0) -> (Tensor, Tensor, Tensor)");
  m.def("mega_moe_fused_fwd(Tensor x, Tensor pool_src_route, Tensor expert_offsets, Tensor w13, Tensor w2, "
        "int top_k, bool save_h, float clamp=0.0, bool keep_x_pool=False, Tensor? route_to_pool=None, "
        "Tensor? topk_weights=None, int num_sms=0) -> (Tensor s, Tensor h, Tensor o, Tensor x_pool, Tensor y)");
  m.def("mega_moe_fused_fwd_second_b(Tensor x, Tensor pool_src_route, Tensor expert_offsets, Tensor w13, Tensor w2, "
        "int top_k, bool save_h, float clamp=0.0, bool keep_x_pool=False, Tensor? route_to_pool=None, "
        "Tensor? topk_weights=None, int num_sms=0, *, Tensor shared_w13, Tensor shared_w2, int chunks) -> "
        "(Tensor s, Tensor h, Tensor o, Tensor x_pool, Tensor y)");
  m.def("mega_moe_fused_fwd_sm100(Tensor x, Tensor pool_src_route, Tensor expert_offsets, Tensor w13, Tensor w2, "
        "int top_k, bool save_h, float clamp=0.0, bool keep_x_pool=False, Tensor? route_to_pool=None, "
        "Tensor? topk_weights=None, int num_sms=0) -> (Tensor s, Tensor h, Tensor o, Tensor x_pool, Tensor y)");
  m.def("combine(Tensor slots, Tensor route_to_pool, Tensor? weights=None) -> Tensor");
  m.def("dispatch_rows_(Tensor src, Tensor route_to_pool, Tensor(a!) out) -> ()");
  m.def("k_grouped_bf16_gemm_tn(Tensor a, Tensor b, Tensor group_offsets, bool out_fp32=True, int num_sms=0) -> Tensor");
  m.def("k_grouped_bf16_gemm_tn_accumulate_(Tensor a, Tensor b, Tensor group_offsets, Tensor(c!) c, int num_sms=0) -> ()");
  m.def("k_grouped_fp8_gemm_tn(Tensor a, Tensor sa, Tensor b, Tensor sb, Tensor group_offsets, bool out_fp32=True, "
        "int num_sms=0) -> Tensor");
  m.def("k_grouped_fp8_gemm_tn_accumulate_(Tensor a, Tensor sa, Tensor b, Tensor sb, Tensor group_offsets, "
        "Tensor(c!) c, int num_sms=0) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(prime_kernels, CPU, m) {
  m.impl("routing_plan", TORCH_BOX(&routing_plan_cpu));
  m.impl("combine", TORCH_BOX(&combine_cpu));
  m.impl("dispatch_rows_", TORCH_BOX(&dispatch_rows_cpu));
}

STABLE_TORCH_LIBRARY_IMPL(prime_kernels, CUDA, m) {
  m.impl("routing_plan", TORCH_BOX(&routing_plan_cuda));
  m.impl("m_grouped_bf16_gemm_nt", TORCH_BOX(&m_grouped_bf16_gemm_nt));
  m.impl("m_grouped_bf16_gemm_nn", TORCH_BOX(&m_grouped_bf16_gemm_nn));
  m.impl("m_grouped_fp8_gemm_nt", TORCH_BOX(&m_grouped_fp8_gemm_nt));
  m.impl("m_grouped_bf16_gemm_nt_gather", TORCH_BOX(&m_grouped_bf16_gemm_nt_gather));
  m.impl("combine", TORCH_BOX(&combine_cuda));
  m.impl("dispatch_rows_", TORCH_BOX(&dispatch_rows_cuda));
  m.impl("swiglu_fwd", TORCH_BOX(&swiglu_fwd));
  m.impl("m_grouped_bf16_gemm_swiglu", TORCH_BOX(&m_grouped_bf16_gemm_swiglu));
  m.impl("swiglu_bwd", TORCH_BOX(&swiglu_bwd));
  m.impl("m_grouped_bf16_gemm_swiglu_bwd", TORCH_BOX(&m_grouped_bf16_gemm_swiglu_bwd));
  m.impl("mega_moe_fused_fwd", TORCH_BOX(&mega_moe_fused_fwd));
  m.impl("mega_moe_fused_fwd_second_b", TORCH_BOX(&mega_moe_fused_fwd_second_b));
  m.impl("mega_moe_fused_fwd_sm100", TORCH_BOX(&mega_moe_fused_fwd_sm100));
  m.impl("k_grouped_bf16_gemm_tn", TORCH_BOX(&k_grouped_bf16_gemm_tn));
  m.impl("k_grouped_bf16_gemm_tn_accumulate_", TORCH_BOX(&k_grouped_bf16_gemm_tn_accumulate_));
  m.impl("k_grouped_fp8_gemm_tn", TORCH_BOX(&k_grouped_fp8_gemm_tn));
  m.impl("k_grouped_fp8_gemm_tn_accumulate_", TORCH_BOX(&k_grouped_fp8_gemm_tn_accumulate_));
}
