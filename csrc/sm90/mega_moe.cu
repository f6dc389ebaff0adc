// prime-kernels: host side of the sm90a fused Mega MoE forward (checks, tensor maps, launch).
#include "mega_moe.hpp"

#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/watchdog.hpp"
#include "host_utils.hpp"
#include "mega_moe_fwd.cuh"
#include "mega_moe_heuristics.hpp"

namespace prime_kernels {
namespace sm90 {
using namespace host;

int mega_moe_fwd_bf16(const MegaFwdArgs& a, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "mega_moe_fwd_bf16";
  if (a.num_ranks < 1 || a.num_ranks > kMegaMaxRanks || a.x_ranks == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_ranks = %d, must be in [1, %d]", fn, a.num_ranks,
                kMegaMaxRanks);
  if (a.num_experts < 1 || a.num_experts > kMegaMaxExperts)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_experts = %d, must be in [1, %d]", fn, a.num_experts,
                kMegaMaxExperts);
  if (a.top_k < 1) return fail(kGemmInvalidArgument, err, err_len, "%s: top_k = %d, must be >= 1", fn, a.top_k);
  if (a.m_total < 0 || a.m_total > kMaxDim || a.hidden < 64 || a.hidden % 64 != 0 || a.hidden > 65536 ||
      a.inter < 64 || a.inter % 64 != 0 || 2 * a.inter > kMaxDim)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: bad sizes m_total=%lld hidden=%lld inter=%lld (hidden and inter multiples of 64)", fn,
                (long long)a.m_total, (long long)a.hidden, (long long)a.inter);
  if (a.ld_x < a.hidden || a.ld_x % 8 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: ld_x = %lld, must be >= hidden and a multiple of 8", fn,
                (long long)a.ld_x);
  if (a.m_total * ((a.hidden * 2 + kDispatchSlotBytes - 1) / kDispatchSlotBytes) > kMaxDim)
    return fail(kGemmInvalidArgument, err, err_len, "%s: m_total = %lld is too large for this hidden size", fn,
                (long long)a.m_total);
  if (!(a.clamp >= 0.f)) return fail(kGemmInvalidArgument, err, err_len, "%s: clamp must be >= 0 (0 = none)", fn);
  if (a.num_tokens < 0 || a.num_tokens * a.top_k >= (int64_t(1) << 31))
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_tokens = %lld, num_tokens * top_k must be < 2^31", fn,
                (long long)a.num_tokens);
  if (a.num_sms < 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_sms = %d, must be >= 1 (or 0: every SM)", fn, a.num_sms);
  if (a.m_total == 0) return kGemmOk;  // no pool rows: nothing to compute
  for (int r = 0; r < a.num_ranks; ++r)
    if (a.x_ranks[r] == nullptr || !aligned16(a.x_ranks[r]))
      return fail(kGemmInvalidArgument, err, err_len, "%s: x_ranks[%d] is null or not 16-byte aligned", fn, r);
  if (a.pool_src_route == nullptr || a.expert_offsets == nullptr || a.counters == nullptr || a.w13 == nullptr ||
      a.w2 == nullptr || a.x_pool == nullptr || a.s == nullptr || a.o == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: null pointer argument", fn);
  if (!aligned16(a.w13) || !aligned16(a.w2) || !aligned16(a.x_pool) || !aligned16(a.s) || !aligned16(a.o) ||
      (a.h != nullptr && !aligned16(a.h)))
    return fail(kGemmInvalidArgument, err, err_len, "%s: w13, w2, x_pool, s, h and o must be 16-byte aligned", fn);
  int sms = 0;
  if (int r = device_sms(&sms, err, err_len)) return r;
  if (a.num_sms > 0 && a.num_sms < sms) sms = a.num_sms;

  CUtensorMap m_xpool, m_w13, m_s, m_w2, m_h, m_o;
  {
    const uint64_t dims[2] = {(uint64_t)a.hidden, (uint64_t)a.m_total};
    const uint64_t strides[1] = {(uint64_t)a.hidden * 2};
    const uint32_t box[2] = {64, 128};
    if (int r = make_map(&m_xpool, a.x_pool, 2, dims, strides, box, err, err_len)) return r;
  }
  {
    const uint64_t dims[3] = {(uint64_t)a.hidden, (uint64_t)(2 * a.inter), (uint64_t)a.num_experts};
    const uint64_t strides[2] = {(uint64_t)a.hidden * 2, (uint64_t)(2 * a.inter * a.hidden * 2)};
    const uint32_t box[3] = {64, 128u, 1};
    if (int r = make_map(&m_w13, a.w13, 3, dims, strides, box, err, err_len)) return r;
  }
  {
    const uint64_t dims[2] = {(uint64_t)a.inter, (uint64_t)a.m_total};
    const uint64_t strides[1] = {(uint64_t)a.inter * 2};
    const uint32_t box[2] = {64, 128};
    if (int r = make_map(&m_s, a.s, 2, dims, strides, box, err, err_len)) return r;
  }
  {
    const uint64_t dims[3] = {(uint64_t)a.inter, (uint64_t)a.hidden, (uint64_t)a.num_experts};
    const uint64_t strides[2] = {(uint64_t)a.inter * 2, (uint64_t)(a.hidden * a.inter * 2)};
    const uint32_t box[3] = {64, 256u, 1};
    if (int r = make_map(&m_w2, a.w2, 3, dims, strides, box, err, err_len)) return r;
  }
  if (a.h != nullptr) {
    const uint64_t dims[2] = {(uint64_t)(2 * a.inter), (uint64_t)a.m_total};
    const uint64_t strides[1] = {(uint64_t)(2 * a.inter) * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&m_h, a.h, 2, dims, strides, box, err, err_len)) return r;
  }
  {
    const uint64_t dims[2] = {(uint64_t)a.hidden, (uint64_t)a.m_total};
    const uint64_t strides[1] = {(uint64_t)a.hidden * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&m_o, a.o, 2, dims, strides, box, err, err_len)) return r;
  }
  if (a.h == nullptr) m_h = m_o;  // never used
  CUtensorMap m_s_st;  // s as the L1 epilogue stores it: 64-row boxes
  {
    const uint64_t dims[2] = {(uint64_t)a.inter, (uint64_t)a.m_total};
    const uint64_t strides[1] = {(uint64_t)a.inter * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&m_s_st, a.s, 2, dims, strides, box, err, err_len)) return r;
  }

  MegaFwdParams p{};
  for (int r = 0; r < a.num_ranks; ++r) p.x_ranks[r] = static_cast<const __nv_bfloat16*>(a.x_ranks[r]);
  p.num_ranks = a.num_ranks;
  p.ld_x = a.ld_x;
  p.pool_src_route = a.pool_src_route;
  p.pool_src_rank = a.pool_src_rank;
  p.top_k = a.top_k;
  p.expert_offsets = a.expert_offsets;
  p.num_experts = a.num_experts;
  p.m_total = (int32_t)a.m_total;
  p.hidden = (int32_t)a.hidden;
  p.inter = (int32_t)a.inter;
  p.x_pool = static_cast<__nv_bfloat16*>(a.x_pool);
  p.s = static_cast<__nv_bfloat16*>(a.s);
  p.h = static_cast<__nv_bfloat16*>(a.h);
  p.o = static_cast<__nv_bfloat16*>(a.o);
  p.clamp = a.clamp;
  if (a.clamp > 0.f) bf16_clamp_neighbours(a.clamp, &p.clamp_below, &p.clamp_above);
  // The rows past disp_split_row are dispatched token by token (single rank; MegaFwdParams::disp_split_row).
  const MegaFwdConfig cfg = mega_fwd_config(a.inter);
  const bool token_major = a.route_to_pool != nullptr && a.num_ranks == 1 && a.pool_src_rank == nullptr &&
                           a.top_k <= 32 && cfg.dispatch_split_pct < 100;
  p.disp_split_row = token_major ? static_cast<int32_t>(a.m_total * cfg.dispatch_split_pct / 100) : INT32_MAX;
  p.route_to_pool = a.route_to_pool;
  p.num_tokens = static_cast<int32_t>(a.num_tokens);
  p.counters = a.counters;
  p.max_m_blocks = (int32_t)max_m_blocks(a.m_total, a.num_experts);
  p.handoff = cfg.handoff;
  p.l2_hints = cfg.l2_hints;
  cudaError_t e = wait_guard_for_current_device(&p.wait_guard);
  if (e != cudaSuccess)
    return fail(kGemmCudaError, err, err_len, "%s: allocating the wait record: %s", fn, cudaGetErrorString(e));
  p.check = common::device_check_record();

  const int64_t num_counters = mega_moe_fwd_counter_count(a.m_total, a.num_experts);
  e = cudaMemsetAsync(a.counters, 0, sizeof(int32_t) * num_counters, stream);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: cudaMemsetAsync: %s", fn, cudaGetErrorString(e));
  // Any number of CTAs may run at once (the kernel claims its work: mega_moe_fwd.cuh), one per SM at most. The one
  // instantiation is cfg.num_stages x cfg.dispatch_slots.
  constexpr auto kernel = &mega_moe_fwd_kernel<kMegaFwdStages, kMegaFwdDispatchSlots>;
  constexpr int smem = MegaFwdLayout<kMegaFwdStages, kMegaFwdDispatchSlots>::kSmemBytes;
  e = set_max_dynamic_smem<kernel>(smem);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "cudaFuncSetAttribute: %s", cudaGetErrorString(e));
  kernel<<<sms, kNumThreads, smem, stream>>>(m_xpool, m_w13, m_s, m_w2, m_h, m_o, m_s_st, p);
  return check_launch(fn, err, err_len);
}

}  // namespace sm90
}  // namespace prime_kernels
