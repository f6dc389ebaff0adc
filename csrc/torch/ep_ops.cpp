// torch.ops.prime_kernels ops of expert parallelism over peer memory (CUDA only):
//   ep_barrier_(signals, kind, played, phase): the enter / exit barrier of csrc/common/ep_signal.hpp; signals holds
//     every rank's signal block (uint8 [pk_ep_signals_bytes()], zeroed once at allocation, never reset), in rank order.
//   mega_moe_fused_fwd_ranks(...): the fused forwards of the played ranks in one launch, each reading its pool rows
//     from every rank's staged x and pushing its L2 rows into their source ranks' combine slots (slots[r] [>= T_max *
//     top_k, H]: row token * top_k + k of rank r). Per played rank (in the order of pool_src_route etc.) it returns h
//     ([m_total, 2I] with save_h, else [0, 2I]) and x_pool (the dispatched rows, [m_total, H]: the backward's operand
//     of dW13); s is a temporary.
//   peer_rows_(pool, peers, src_route, src_rank, route_divisor, gather): csrc/common/peer_rows.hpp over tensors.
//   m_grouped_bf16_gemm_nn_to_routes_(a, b, group_offsets, slots, pool_src_route, pool_src_rank, num_sms): the
//     m-grouped "nn" GEMM whose rows go to their source ranks' slots (pk_m_grouped_bf16_gemm_nn_to_routes).
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "api/prime_kernels_api.h"
#include "torch/shim_common.hpp"

namespace {

using namespace prime_kernels::torch_shim;

constexpr int kMaxRanks = 8;

void ep_barrier_(std::vector<Tensor> signals, int64_t kind, std::vector<int64_t> played, int64_t phase) {
  const char* op = "ep_barrier_";
  check_core(pk_device_check(), op);
  const int64_t num_ranks = static_cast<int64_t>(signals.size());
  STD_TORCH_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "prime_kernels.", op, ": ", num_ranks,
                  " signal blocks, must be 1..", kMaxRanks);
  STD_TORCH_CHECK(!played.empty() && static_cast<int64_t>(played.size()) <= num_ranks, "prime_kernels.", op,
                  ": played must name 1..", num_ranks, " ranks");
  void* ptrs[kMaxRanks];
  for (int64_t r = 0; r < num_ranks; ++r) {
    const Tensor& s = signals[r];
    STD_TORCH_CHECK(s.is_cuda() && s.scalar_type() == ScalarType::Byte && s.dim() == 1 && s.is_contiguous() &&
                        s.size(0) >= pk_ep_signals_bytes(),
                    "prime_kernels.", op, ": signals[", r, "] must be a contiguous CUDA uint8 tensor of at least ",
                    pk_ep_signals_bytes(), " bytes");
    ptrs[r] = s.data_ptr();
  }
  int32_t ranks[kMaxRanks];
  for (size_t i = 0; i < played.size(); ++i) ranks[i] = static_cast<int32_t>(played[i]);
  const int32_t device = signals[0].get_device_index();
  torch::stable::accelerator::DeviceGuard guard(device);
  check_core(pk_ep_barrier(ptrs, static_cast<int>(num_ranks), static_cast<int>(kind), static_cast<int>(phase), ranks,
                           static_cast<int>(played.size()), current_cuda_stream(device)),
             op);
}

std::tuple<std::vector<Tensor>, std::vector<Tensor>> mega_moe_fused_fwd_ranks(std::vector<Tensor> x_ranks, std::vector<Tensor> slots,
                                             std::vector<Tensor> pool_src_route, std::vector<Tensor> pool_src_rank,
                                             std::vector<Tensor> expert_offsets, std::vector<Tensor> w13,
                                             std::vector<Tensor> w2, int64_t top_k, bool save_h, double clamp,
                                             int64_t num_sms) {
  const char* op = "mega_moe_fused_fwd_ranks";
  check_core(pk_device_check(), op);
  const size_t num_ranks = x_ranks.size(), played = pool_src_route.size();
  STD_TORCH_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks && slots.size() == num_ranks, "prime_kernels.", op,
                  ": x_ranks and slots must hold one tensor per rank (1..", kMaxRanks, ")");
  STD_TORCH_CHECK(played >= 1 && played <= num_ranks && pool_src_rank.size() == played &&
                      expert_offsets.size() == played && w13.size() == played && w2.size() == played,
                  "prime_kernels.", op, ": pool_src_route, pool_src_rank, expert_offsets, w13 and w2 must hold one "
                  "tensor per played rank (1..number of ranks)");
  STD_TORCH_CHECK(top_k >= 1, "prime_kernels.", op, ": top_k must be >= 1");
  STD_TORCH_CHECK(num_sms >= 0 && num_sms <= (int64_t(1) << 20), "prime_kernels.", op, ": num_sms = ", num_sms,
                  ", must be >= 1 (or 0: every SM)");
  const Tensor& x0 = x_ranks[0];
  check_bf16_cuda(x0, op, "x_ranks[0]", 2);
  const int64_t num_tokens = x0.size(0), hidden = x0.size(1);
  const void* x_ptrs[kMaxRanks];
  void* slot_ptrs[kMaxRanks];
  int64_t ld_slots = 0;
  for (size_t r = 0; r < num_ranks; ++r) {
    check_bf16_cuda(x_ranks[r], op, "x_ranks", 2);
    check_bf16_cuda(slots[r], op, "slots", 2);
    check_same_device(x_ranks[r], x0, op, "x_ranks");
    check_same_device(slots[r], x0, op, "slots");
    STD_TORCH_CHECK(x_ranks[r].size(0) == num_tokens && x_ranks[r].size(1) == hidden &&
                        x_ranks[r].stride(0) == x0.stride(0),
                    "prime_kernels.", op, ": every rank's x must be [", num_tokens, ", ", hidden,
                    "] with the same row stride");
    STD_TORCH_CHECK(slots[r].size(0) >= num_tokens * top_k && slots[r].size(1) == hidden &&
                        (r == 0 || slots[r].stride(0) == slots[0].stride(0)),
                    "prime_kernels.", op, ": every rank's slots must be [>= ", num_tokens * top_k, ", ", hidden,
                    "] with the same row stride");
    x_ptrs[r] = x_ranks[r].data_ptr();
    slot_ptrs[r] = slots[r].data_ptr();
    ld_slots = slots[r].stride(0);
  }
  torch::stable::accelerator::DeviceGuard guard(x0.get_device_index());
  std::vector<Tensor> h_out, x_pool_out, keep;  // keep: the temporaries, alive until the launch is queued
  pk_mega_fwd_rank args[kMaxRanks] = {};
  for (size_t i = 0; i < played; ++i) {
    check_bf16_cuda(w13[i], op, "w13", 3);
    check_bf16_cuda(w2[i], op, "w2", 3);
    STD_TORCH_CHECK(w13[i].is_contiguous() && w2[i].is_contiguous(), "prime_kernels.", op,
                    ": w13 and w2 must be contiguous");
    check_same_device(w13[i], x0, op, "w13");
    check_same_device(w2[i], x0, op, "w2");
    const int32_t num_experts = check_offsets(expert_offsets[i], x0, op);
    STD_TORCH_CHECK(w13[i].size(0) == num_experts && w13[i].size(2) == hidden && w13[i].size(1) % 2 == 0,
                    "prime_kernels.", op, ": w13 must be [num_experts, 2I, hidden]");
    const int64_t inter = w13[i].size(1) / 2;
    STD_TORCH_CHECK(w2[i].size(0) == num_experts && w2[i].size(1) == hidden && w2[i].size(2) == inter,
                    "prime_kernels.", op, ": w2 must be [num_experts, hidden, I]");
    check_int32_vector(pool_src_route[i], x0, op, "pool_src_route");
    check_int32_vector(pool_src_rank[i], x0, op, "pool_src_rank");
    const int64_t m_total = pool_src_route[i].size(0);
    STD_TORCH_CHECK(pool_src_rank[i].size(0) == m_total, "prime_kernels.", op,
                    ": pool_src_rank must have pool_src_route's length");
    Tensor x_pool = new_tensor(x0, {m_total, hidden}, ScalarType::BFloat16);  // o's too (never written: pushed)
    Tensor s = new_tensor(x0, {m_total, inter}, ScalarType::BFloat16);
    Tensor h = new_tensor(x0, {save_h ? m_total : 0, 2 * inter}, ScalarType::BFloat16);
    Tensor counters = new_tensor(x0, {pk_mega_moe_fwd_counter_count(m_total, num_experts)}, ScalarType::Int);
    pk_mega_fwd_rank& a = args[i];
    a.x_ranks = x_ptrs;
    a.num_ranks = static_cast<int>(num_ranks);
    a.ld_x = x0.stride(0);
    a.pool_src_route = static_cast<const int32_t*>(pool_src_route[i].data_ptr());
    a.pool_src_rank = static_cast<const int32_t*>(pool_src_rank[i].data_ptr());
    a.top_k = static_cast<int>(top_k);
    a.expert_offsets = static_cast<const int32_t*>(expert_offsets[i].data_ptr());
    a.num_experts = num_experts;
    a.m_total = m_total;
    a.hidden = hidden;
    a.inter = inter;
    a.w13 = w13[i].data_ptr();
    a.w2 = w2[i].data_ptr();
    a.x_pool = x_pool.data_ptr();
    a.s = s.data_ptr();
    a.h = save_h ? h.data_ptr() : nullptr;
    a.o = x_pool.data_ptr();
    a.o_slots = slot_ptrs;
    a.ld_slots = ld_slots;
    a.num_tokens = num_tokens;
    a.route_to_pool = nullptr;
    a.clamp = static_cast<float>(clamp);
    a.counters = static_cast<int32_t*>(counters.data_ptr());
    h_out.push_back(h);
    x_pool_out.push_back(x_pool);
    keep.push_back(s);
    keep.push_back(counters);
  }
  check_core(pk_mega_moe_fwd_bf16_ranks(args, static_cast<int>(played), static_cast<int>(num_sms),
                                        current_cuda_stream(x0.get_device_index())),
             op);
  return {h_out, x_pool_out};
}

// row_bytes and the strides of a pool or peer tensor (2-D rows, or 1-D: one element a row)
void row_layout(const Tensor& t, const char* op, const char* name, int64_t* row_bytes, int64_t* ld) {
  STD_TORCH_CHECK(t.is_cuda() && (t.dim() == 1 || t.dim() == 2) && t.stride(t.dim() - 1) == 1, "prime_kernels.", op,
                  ": ", name, " must be a 1-D or 2-D CUDA tensor with unit stride in its last dim");
  const int64_t elem = t.element_size();
  *row_bytes = (t.dim() == 2 ? t.size(1) : 1) * elem;
  *ld = (t.dim() == 2 ? (t.size(0) > 1 ? t.stride(0) : t.size(1)) : 1) * elem;
}

void peer_rows_(Tensor pool, std::vector<Tensor> peers, Tensor src_route, Tensor src_rank, int64_t route_divisor,
                bool gather) {
  const char* op = "peer_rows_";
  check_core(pk_device_check(), op);
  const int64_t num_ranks = static_cast<int64_t>(peers.size());
  STD_TORCH_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "prime_kernels.", op, ": ", num_ranks,
                  " peer buffers, must be 1..", kMaxRanks);
  int64_t row_bytes = 0, ld_pool = 0;
  row_layout(pool, op, "pool", &row_bytes, &ld_pool);
  const int64_t num_rows = pool.size(0);
  check_int32_vector(src_route, pool, op, "src_route");
  check_int32_vector(src_rank, pool, op, "src_rank");
  STD_TORCH_CHECK(src_route.size(0) >= num_rows && src_rank.size(0) >= num_rows, "prime_kernels.", op,
                  ": src_route and src_rank need an entry per pool row");
  void* ptrs[kMaxRanks];
  int64_t ld_peer = 0, peer_rows = 0;
  for (int64_t r = 0; r < num_ranks; ++r) {
    int64_t rb = 0, ld = 0;
    row_layout(peers[r], op, "peers", &rb, &ld);
    STD_TORCH_CHECK(peers[r].scalar_type() == pool.scalar_type() && rb == row_bytes && peers[r].dim() == pool.dim() &&
                        (r == 0 || (ld == ld_peer && peers[r].size(0) == peer_rows)),
                    "prime_kernels.", op, ": every peer buffer must have the pool's dtype and row size, and the same "
                    "rows and row stride");
    check_same_device(peers[r], pool, op, "peers");
    ld_peer = ld;
    peer_rows = peers[r].size(0);
    ptrs[r] = peers[r].data_ptr();
  }
  torch::stable::accelerator::DeviceGuard guard(pool.get_device_index());
  check_core(pk_peer_rows(pool.data_ptr(), ld_pool, ptrs, static_cast<int>(num_ranks), ld_peer, peer_rows, num_rows,
                          row_bytes, static_cast<const int32_t*>(src_route.data_ptr()),
                          static_cast<const int32_t*>(src_rank.data_ptr()), static_cast<int>(route_divisor),
                          gather ? 1 : 0, current_cuda_stream(pool.get_device_index())),
             op);
}

// dX rows of a rank's pool straight into their source ranks' combine slots: a [m_total, k] @ b_g [k, n] per group,
// row m to slots[pool_src_rank[m]] at row pool_src_route[m] (slots: every rank's [>= num_routes, n] bf16 buffer,
// the same rows and stride on every rank).
void m_grouped_bf16_gemm_nn_to_routes_(Tensor a, Tensor b, Tensor group_offsets, std::vector<Tensor> slots,
                                       Tensor pool_src_route, Tensor pool_src_rank, int64_t num_sms) {
  const char* op = "m_grouped_bf16_gemm_nn_to_routes_";
  const int sms = check_num_sms(num_sms, op);
  check_bf16_cuda(a, op, "a", 2);
  check_bf16_cuda(b, op, "b", 3);
  check_same_device(b, a, op, "b");
  const int32_t num_groups = check_offsets(group_offsets, a, op);
  STD_TORCH_CHECK(b.size(0) == num_groups && b.size(1) == a.size(1), "prime_kernels.", op, ": b must be [",
                  num_groups, ", ", a.size(1), ", n] (a group per offset, a's K rows)");
  const int64_t n = b.size(2);
  const int64_t num_ranks = static_cast<int64_t>(slots.size());
  STD_TORCH_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "prime_kernels.", op, ": ", num_ranks,
                  " slot buffers, must be 1..", kMaxRanks);
  check_int32_vector(pool_src_route, a, op, "pool_src_route");
  check_int32_vector(pool_src_rank, a, op, "pool_src_rank");
  STD_TORCH_CHECK(pool_src_route.size(0) >= a.size(0) && pool_src_rank.size(0) >= a.size(0), "prime_kernels.", op,
                  ": pool_src_route and pool_src_rank need an entry per row of a");
  void* ptrs[kMaxRanks];
  for (int64_t r = 0; r < num_ranks; ++r) {
    check_bf16_cuda(slots[r], op, "slots", 2);
    check_same_device(slots[r], a, op, "slots");
    STD_TORCH_CHECK(slots[r].size(1) == n && slots[r].size(0) == slots[0].size(0) &&
                        slots[r].stride(0) == slots[0].stride(0),
                    "prime_kernels.", op, ": every slot buffer must be [rows, ", n, "] with the same rows and stride");
    ptrs[r] = slots[r].data_ptr();
  }
  torch::stable::accelerator::DeviceGuard guard(a.get_device_index());
  check_core(pk_m_grouped_bf16_gemm_nn_to_routes(
                 a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(1), b.stride(0), ptrs, static_cast<int>(num_ranks),
                 slots[0].size(0) > 1 ? slots[0].stride(0) : n, static_cast<const int32_t*>(pool_src_route.data_ptr()),
                 static_cast<const int32_t*>(pool_src_rank.data_ptr()), slots[0].size(0),
                 static_cast<const int32_t*>(group_offsets.data_ptr()), num_groups, a.size(0), n, a.size(1), sms,
                 current_cuda_stream(a.get_device_index())),
             op);
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(prime_kernels, m) {
  m.def("ep_barrier_(Tensor(a!)[] signals, int kind, int[] played, int phase=0) -> ()");
  m.def("mega_moe_fused_fwd_ranks(Tensor[] x_ranks, Tensor(a!)[] slots, Tensor[] pool_src_route, "
        "Tensor[] pool_src_rank, Tensor[] expert_offsets, Tensor[] w13, Tensor[] w2, int top_k, bool save_h, "
        "float clamp=0.0, int num_sms=0) -> (Tensor[] h, Tensor[] x_pool)");
  m.def("peer_rows_(Tensor(a!) pool, Tensor(b!)[] peers, Tensor src_route, Tensor src_rank, int route_divisor, "
        "bool gather) -> ()");
  m.def("m_grouped_bf16_gemm_nn_to_routes_(Tensor a, Tensor b, Tensor group_offsets, Tensor(a!)[] slots, "
        "Tensor pool_src_route, Tensor pool_src_rank, int num_sms=0) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(prime_kernels, CUDA, m) {
  m.impl("ep_barrier_", TORCH_BOX(&ep_barrier_));
  m.impl("mega_moe_fused_fwd_ranks", TORCH_BOX(&mega_moe_fused_fwd_ranks));
  m.impl("peer_rows_", TORCH_BOX(&peer_rows_));
  m.impl("m_grouped_bf16_gemm_nn_to_routes_", TORCH_BOX(&m_grouped_bf16_gemm_nn_to_routes_));
}
