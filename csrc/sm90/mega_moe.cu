// prime-kernels: host side of the sm90a fused Mega MoE forward (checks, tensor maps, launch).
#include "mega_moe.hpp"

#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/watchdog.hpp"
#include "host_utils.hpp"
#include "mega_moe_fwd.cuh"

namespace deep_gemm {
namespace sm90 {
using namespace host;

namespace {
// 3 stages of 128x256x64 (48 KB each) + the 32 KB half-width staging tile leave room for 11 dispatch slots of
// 4 KB; the three dispatch warps use 3 each.
constexpr int kFwdStages = 3;
constexpr int kFwdDispatchSlots = 9;
// The share of the pool (percent of m_total, first rows) dispatched in pool order; the rest goes token by token
// (MegaFwdParams::disp_split_row).
int dispatch_split_pct(int64_t inter) {
  int64_t pct = (kMegaFwdDispatchSplitAt768 * 768 + inter - 1) / inter;
  if (pct < kMegaFwdDispatchSplitMin) pct = kMegaFwdDispatchSplitMin;
  return static_cast<int>(pct > 100 ? 100 : pct);
}
}  // namespace

int mega_moe_fwd_bf16(const void* const* x_ranks, int num_ranks, int64_t ld_x, const int32_t* pool_src_route,
                      const int32_t* pool_src_rank, int top_k, const int32_t* expert_offsets, int num_experts,
                      int64_t m_total, int64_t hidden, int64_t inter, const void* w13, const void* w2, void* x_pool,
                      void* s, void* h, void* o, int64_t num_tokens, const int32_t* route_to_pool, float clamp,
                      int32_t* counters, int num_sms, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "mega_moe_fwd_bf16";
  if (num_ranks < 1 || num_ranks > kMegaMaxRanks || x_ranks == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_ranks = %d, must be in [1, %d]", fn, num_ranks,
                kMegaMaxRanks);
  if (num_experts < 1 || num_experts > kMegaMaxExperts)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_experts = %d, must be in [1, %d]", fn, num_experts,
                kMegaMaxExperts);
  if (top_k < 1) return fail(kGemmInvalidArgument, err, err_len, "%s: top_k = %d, must be >= 1", fn, top_k);
  if (m_total < 0 || m_total > kMaxDim || hidden < 64 || hidden % 64 != 0 || hidden > 65536 || inter < 64 ||
      inter % 64 != 0 || 2 * inter > kMaxDim)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: bad sizes m_total=%lld hidden=%lld inter=%lld (hidden and inter multiples of 64)", fn,
                (long long)m_total, (long long)hidden, (long long)inter);
  if (ld_x < hidden || ld_x % 8 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: ld_x = %lld, must be >= hidden and a multiple of 8", fn,
                (long long)ld_x);
  if (m_total * ((hidden * 2 + kDispatchSlotBytes - 1) / kDispatchSlotBytes) > kMaxDim)
    return fail(kGemmInvalidArgument, err, err_len, "%s: m_total = %lld is too large for this hidden size", fn,
                (long long)m_total);
  if (!(clamp >= 0.f)) return fail(kGemmInvalidArgument, err, err_len, "%s: clamp must be >= 0 (0 = none)", fn);
  if (num_tokens < 0 || num_tokens * top_k >= (int64_t(1) << 31))
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_tokens = %lld, num_tokens * top_k must be < 2^31", fn,
                (long long)num_tokens);
  if (num_sms < 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_sms = %d, must be >= 1 (or 0: every SM)", fn, num_sms);
  if (m_total == 0) return kGemmOk;  // no pool rows: nothing to compute
  for (int r = 0; r < num_ranks; ++r)
    if (x_ranks[r] == nullptr || !aligned16(x_ranks[r]))
      return fail(kGemmInvalidArgument, err, err_len, "%s: x_ranks[%d] is null or not 16-byte aligned", fn, r);
  if (pool_src_route == nullptr || expert_offsets == nullptr || counters == nullptr || w13 == nullptr ||
      w2 == nullptr || x_pool == nullptr || s == nullptr || o == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: null pointer argument", fn);
  if (!aligned16(w13) || !aligned16(w2) || !aligned16(x_pool) || !aligned16(s) || !aligned16(o) ||
      (h != nullptr && !aligned16(h)))
    return fail(kGemmInvalidArgument, err, err_len, "%s: w13, w2, x_pool, s, h and o must be 16-byte aligned", fn);
  int sms = 0;
  if (int r = device_sms(&sms, err, err_len)) return r;
  if (num_sms > 0 && num_sms < sms) sms = num_sms;

  CUtensorMap m_xpool, m_w13, m_s, m_w2, m_h, m_o;
  {
    const uint64_t dims[2] = {(uint64_t)hidden, (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)hidden * 2};
    const uint32_t box[2] = {64, 128};
    if (int r = make_map(&m_xpool, x_pool, 2, dims, strides, box, err, err_len)) return r;
  }
  {
    const uint64_t dims[3] = {(uint64_t)hidden, (uint64_t)(2 * inter), (uint64_t)num_experts};
    const uint64_t strides[2] = {(uint64_t)hidden * 2, (uint64_t)(2 * inter * hidden * 2)};
    const uint32_t box[3] = {64, 128u, 1};
    if (int r = make_map(&m_w13, w13, 3, dims, strides, box, err, err_len)) return r;
  }
  {
    const uint64_t dims[2] = {(uint64_t)inter, (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)inter * 2};
    const uint32_t box[2] = {64, 128};
    if (int r = make_map(&m_s, s, 2, dims, strides, box, err, err_len)) return r;
  }
  {
    const uint64_t dims[3] = {(uint64_t)inter, (uint64_t)hidden, (uint64_t)num_experts};
    const uint64_t strides[2] = {(uint64_t)inter * 2, (uint64_t)(hidden * inter * 2)};
    const uint32_t box[3] = {64, 256u, 1};
    if (int r = make_map(&m_w2, w2, 3, dims, strides, box, err, err_len)) return r;
  }
  if (h != nullptr) {
    const uint64_t dims[2] = {(uint64_t)(2 * inter), (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)(2 * inter) * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&m_h, h, 2, dims, strides, box, err, err_len)) return r;
  }
  {
    const uint64_t dims[2] = {(uint64_t)hidden, (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)hidden * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&m_o, o, 2, dims, strides, box, err, err_len)) return r;
  }
  if (h == nullptr) m_h = m_o;  // never used
  CUtensorMap m_s_st;  // s as the L1 epilogue stores it: 64-row boxes
  {
    const uint64_t dims[2] = {(uint64_t)inter, (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)inter * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&m_s_st, s, 2, dims, strides, box, err, err_len)) return r;
  }

  MegaFwdParams p{};
  for (int r = 0; r < num_ranks; ++r) p.x_ranks[r] = static_cast<const __nv_bfloat16*>(x_ranks[r]);
  p.num_ranks = num_ranks;
  p.ld_x = ld_x;
  p.pool_src_route = pool_src_route;
  p.pool_src_rank = pool_src_rank;
  p.top_k = top_k;
  p.expert_offsets = expert_offsets;
  p.num_experts = num_experts;
  p.m_total = (int32_t)m_total;
  p.hidden = (int32_t)hidden;
  p.inter = (int32_t)inter;
  p.x_pool = static_cast<__nv_bfloat16*>(x_pool);
  p.s = static_cast<__nv_bfloat16*>(s);
  p.h = static_cast<__nv_bfloat16*>(h);
  p.o = static_cast<__nv_bfloat16*>(o);
  p.clamp = clamp;
  if (clamp > 0.f) {
    // bf16 neighbours of clamp (positive: the next value up / down is the bit pattern + / - 1)
    const __nv_bfloat16 r = __float2bfloat16_rn(clamp);
    uint16_t bits;
    memcpy(&bits, &r, 2);
    auto from_bits = [](uint16_t b) {
      __nv_bfloat16 v;
      memcpy(&v, &b, 2);
      return __bfloat162float(v);
    };
    const float rf = from_bits(bits);
    p.clamp_below = rf < clamp ? rf : from_bits(static_cast<uint16_t>(bits - 1));
    p.clamp_above = rf > clamp ? rf : from_bits(static_cast<uint16_t>(bits + 1));
  }
  // The rows past disp_split_row are dispatched token by token (single rank; MegaFwdParams::disp_split_row).
  const int split_pct = dispatch_split_pct(inter);
  const bool token_major = route_to_pool != nullptr && num_ranks == 1 && pool_src_rank == nullptr && top_k <= 32 &&
                           split_pct < 100;
  p.disp_split_row = token_major ? static_cast<int32_t>(m_total * split_pct / 100) : INT32_MAX;
  p.route_to_pool = route_to_pool;
  p.num_tokens = static_cast<int32_t>(num_tokens);
  p.counters = counters;
  p.max_m_blocks = (int32_t)max_m_blocks(m_total, num_experts);
  p.handoff = kMegaFwdHandoff;
  p.l2_hints = kMegaFwdL2Hints;
  cudaError_t e = wait_guard_for_current_device(&p.wait_guard);
  if (e != cudaSuccess)
    return fail(kGemmCudaError, err, err_len, "%s: allocating the wait record: %s", fn, cudaGetErrorString(e));
  p.check = common::device_check_record();

  const int64_t num_counters = mega_moe_fwd_counter_count(m_total, num_experts);
  e = cudaMemsetAsync(counters, 0, sizeof(int32_t) * num_counters, stream);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: cudaMemsetAsync: %s", fn, cudaGetErrorString(e));
  // Any number of CTAs may run at once (the kernel claims its work: mega_moe_fwd.cuh), one per SM at most.
  constexpr auto kernel = &mega_moe_fwd_kernel<kFwdStages, kFwdDispatchSlots>;
  constexpr int smem = MegaFwdLayout<kFwdStages, kFwdDispatchSlots>::kSmemBytes;
  e = set_max_dynamic_smem<kernel>(smem);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "cudaFuncSetAttribute: %s", cudaGetErrorString(e));
  kernel<<<sms, kNumThreads, smem, stream>>>(m_xpool, m_w13, m_s, m_w2, m_h, m_o, m_s_st, p);
  return check_launch(fn, err, err_len);
}

}  // namespace sm90
}  // namespace deep_gemm
