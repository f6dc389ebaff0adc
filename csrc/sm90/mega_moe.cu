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

namespace {

// The maps of `groups` experts' weights, bf16 and contiguous: w13 [groups, 2 * inter, hidden] (gate rows, then up rows)
// in 128-row boxes, w2 [groups, hidden, inter] in 256-row boxes.
int make_weight_maps(const void* w13, const void* w2, int64_t hidden, int64_t inter, int64_t groups, CUtensorMap* m_w13,
                     CUtensorMap* m_w2, char* err, size_t err_len) {
  {
    const uint64_t dims[3] = {(uint64_t)hidden, (uint64_t)(2 * inter), (uint64_t)groups};
    const uint64_t strides[2] = {(uint64_t)hidden * 2, (uint64_t)(2 * inter * hidden * 2)};
    const uint32_t box[3] = {64, 128u, 1};
    if (int r = make_map(m_w13, w13, 3, dims, strides, box, err, err_len)) return r;
  }
  const uint64_t dims[3] = {(uint64_t)inter, (uint64_t)hidden, (uint64_t)groups};
  const uint64_t strides[2] = {(uint64_t)inter * 2, (uint64_t)(hidden * inter * 2)};
  const uint32_t box[3] = {64, 256u, 1};
  return make_map(m_w2, w2, 3, dims, strides, box, err, err_len);
}

// Checks one rank's arguments and makes its tensor maps and kernel parameters; *empty: no pool rows (nothing to
// launch for this rank). kGemmOk or the error, before anything touches the device.
// b_groups: the experts w13 and w2 hold (the first groups; all of them without a second B).
int prepare_rank(const MegaFwdArgs& a, int b_groups, MegaFwdMaps* maps, MegaFwdParams* out, bool* empty,
                 const char* fn, char* err, size_t err_len) {
  *empty = false;
  if (a.num_ranks < 1 || a.num_ranks > kMegaMaxRanks || a.x_ranks == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_ranks = %d, must be in [1, %d]", fn, a.num_ranks,
                kMegaMaxRanks);
  if (int r = check_mega_fwd_sizes(a, kMegaMaxExperts, fn, err, err_len)) return r;
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
  if (a.o_slots != nullptr) {
    if (a.ld_slots < a.hidden || a.ld_slots % 8 != 0)
      return fail(kGemmInvalidArgument, err, err_len, "%s: ld_slots = %lld, must be >= hidden and a multiple of 8",
                  fn, (long long)a.ld_slots);
    for (int r = 0; r < a.num_ranks; ++r)
      if (a.o_slots[r] == nullptr || !aligned16(a.o_slots[r]))
        return fail(kGemmInvalidArgument, err, err_len, "%s: o_slots[%d] is null or not 16-byte aligned", fn, r);
  }
  if (a.m_total == 0) {  // no pool rows: nothing to compute
    *empty = true;
    return kGemmOk;
  }
  for (int r = 0; r < a.num_ranks; ++r)
    if (a.x_ranks[r] == nullptr || !aligned16(a.x_ranks[r]))
      return fail(kGemmInvalidArgument, err, err_len, "%s: x_ranks[%d] is null or not 16-byte aligned", fn, r);
  if (int r = check_mega_fwd_pointers(a, a.counters == nullptr, fn, err, err_len)) return r;
  CUtensorMap& m_xpool = maps->xpool;
  CUtensorMap& m_w13 = maps->w13;
  CUtensorMap& m_s = maps->s;
  CUtensorMap& m_w2 = maps->w2;
  CUtensorMap& m_h = maps->h;
  CUtensorMap& m_o = maps->o;
  {
    const uint64_t dims[2] = {(uint64_t)a.hidden, (uint64_t)a.m_total};
    const uint64_t strides[1] = {(uint64_t)a.hidden * 2};
    const uint32_t box[2] = {64, 128};
    if (int r = make_map(&m_xpool, a.x_pool, 2, dims, strides, box, err, err_len)) return r;
  }
  if (int r = make_weight_maps(a.w13, a.w2, a.hidden, a.inter, b_groups, &m_w13, &m_w2, err, err_len)) return r;
  {
    const uint64_t dims[2] = {(uint64_t)a.inter, (uint64_t)a.m_total};
    const uint64_t strides[1] = {(uint64_t)a.inter * 2};
    const uint32_t box[2] = {64, 128};
    if (int r = make_map(&m_s, a.s, 2, dims, strides, box, err, err_len)) return r;
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
  CUtensorMap& m_s_st = maps->s_st;  // s as the L1 epilogue stores it: 64-row boxes
  {
    const uint64_t dims[2] = {(uint64_t)a.inter, (uint64_t)a.m_total};
    const uint64_t strides[1] = {(uint64_t)a.inter * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&m_s_st, a.s, 2, dims, strides, box, err, err_len)) return r;
  }

  MegaFwdParams& p = *out;
  p = MegaFwdParams{};
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
  if (a.o_slots != nullptr)
    for (int r = 0; r < a.num_ranks; ++r) p.o_slots[r] = static_cast<__nv_bfloat16*>(a.o_slots[r]);
  p.ld_slots = a.ld_slots;
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
  // The L2 hand-off TMA-stores whole tiles to o; pushed rows go out one by one from the consumers' staging.
  p.handoff = a.o_slots != nullptr ? (cfg.handoff & ~2) : cfg.handoff;
  p.l2_hints = cfg.l2_hints;
  cudaError_t e = wait_guard_for_current_device(&p.wait_guard);
  if (e != cudaSuccess)
    return fail(kGemmCudaError, err, err_len, "%s: allocating the wait record: %s", fn, cudaGetErrorString(e));
  p.check = common::device_check_record();

  return kGemmOk;
}

cudaError_t zero_counters(const MegaFwdArgs& a, cudaStream_t stream) {
  return cudaMemsetAsync(a.counters, 0, sizeof(int32_t) * mega_moe_fwd_counter_count(a.m_total, a.num_experts),
                         stream);
}

// The one instantiation of each kernel is kMegaFwdStages x kMegaFwdDispatchSlots (mega_moe_heuristics.hpp).
constexpr int kFwdSmem = MegaFwdLayout<kMegaFwdStages, kMegaFwdDispatchSlots>::kSmemBytes;

// Zeroes a's counters, then launches one rank's forward kernel on one CTA per SM (a.num_sms caps them). Any number of
// CTAs may run at once (the kernel claims its work: mega_moe_fwd.cuh).
template <auto kKernel, typename... Args>
int launch_one_rank(const MegaFwdArgs& a, cudaStream_t stream, const char* fn, char* err, size_t err_len,
                    const Args&... args) {
  int sms = 0;
  if (int r = device_sms(&sms, err, err_len)) return r;
  if (a.num_sms > 0 && a.num_sms < sms) sms = a.num_sms;
  cudaError_t e = zero_counters(a, stream);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: cudaMemsetAsync: %s", fn, cudaGetErrorString(e));
  e = set_max_dynamic_smem<kKernel>(kFwdSmem);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "cudaFuncSetAttribute: %s", cudaGetErrorString(e));
  kKernel<<<sms, kNumThreads, kFwdSmem, stream>>>(args...);
  return check_launch(fn, err, err_len);
}

}  // namespace

int mega_moe_fwd_bf16(const MegaFwdArgs& a, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "mega_moe_fwd_bf16";
  MegaFwdMaps maps;
  MegaFwdParams p;
  bool empty = false;
  if (int r = prepare_rank(a, a.num_experts, &maps, &p, &empty, fn, err, err_len)) return r;
  if (empty) return kGemmOk;
  constexpr auto kernel = &mega_moe_fwd_kernel<kMegaFwdStages, kMegaFwdDispatchSlots>;
  return launch_one_rank<kernel>(a, stream, fn, err, err_len, maps, p);
}

int mega_moe_fwd_bf16_second_b(const MegaFwdArgs& a, const MegaFwdSecondBArgs& b, cudaStream_t stream, char* err,
                               size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "mega_moe_fwd_bf16_second_b";
  if (a.num_ranks != 1 || a.pool_src_rank != nullptr || a.o_slots != nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: one rank only (num_ranks 1, no pool_src_rank, no o_slots)",
                fn);
  if (b.slabs < 1 || b.chunks < 1 || b.num_b_groups < 1 || b.w13b == nullptr || b.w2b == nullptr ||
      !aligned16(b.w13b) || !aligned16(b.w2b) ||
      int64_t(b.num_b_groups) + int64_t(b.slabs) * b.chunks != a.num_experts)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: second B: slabs %d, chunks %d, num_b_groups %d must be >= 1 with num_b_groups + slabs * chunks "
                "= num_experts (%d), and w13b / w2b non-null and 16-byte aligned",
                fn, b.slabs, b.chunks, b.num_b_groups, a.num_experts);
  if (int64_t(b.chunks) * a.inter > kMaxDim)
    return fail(kGemmInvalidArgument, err, err_len, "%s: chunks * inter = %lld is too large", fn,
                (long long)(int64_t(b.chunks) * a.inter));
  MegaFwdMaps maps;
  MegaFwdParams p;
  bool empty = false;
  if (int r = prepare_rank(a, b.num_b_groups, &maps, &p, &empty, fn, err, err_len)) return r;
  if (empty) return kGemmOk;
  MegaFwdSecondB second{};
  second.num_b_groups = b.num_b_groups;
  second.chunks = b.chunks;
  if (int r = make_weight_maps(b.w13b, b.w2b, a.hidden, int64_t(b.chunks) * a.inter, b.slabs, &second.w13b,
                               &second.w2b, err, err_len))
    return r;
  constexpr auto kernel = &mega_moe_fwd_second_b_kernel<kMegaFwdStages, kMegaFwdDispatchSlots>;
  return launch_one_rank<kernel>(a, stream, fn, err, err_len, maps, p, second);
}

static_assert(kMegaFwdMaxLaunchRanks == kMegaMaxRanks, "the launch holds one pointer table per rank");

int mega_moe_fwd_bf16_ranks(const MegaFwdArgs* ranks, int num_ranks, int num_sms, cudaStream_t stream, char* err,
                            size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "mega_moe_fwd_bf16_ranks";
  if (ranks == nullptr || num_ranks < 1 || num_ranks > kMegaMaxRanks)
    return fail(kGemmInvalidArgument, err, err_len, "%s: %d ranks, must be in [1, %d]", fn, num_ranks, kMegaMaxRanks);
  if (num_sms < 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_sms = %d, must be >= 1 (or 0: every SM)", fn, num_sms);
  // Ranks without pool rows take no CTAs: the launch's slots hold the others, each with its own parameters.
  MegaFwdRanksLaunch launch{};  // ~10 KB of kernel parameters (sm90 takes up to 32 KB)
  int used = 0;
  for (int r = 0; r < num_ranks; ++r) {
    bool empty = false;
    if (int rc = prepare_rank(ranks[r], ranks[r].num_experts, &launch.maps[used], &launch.p[used], &empty, fn, err,
                              err_len))
      return rc;
    if (!empty) ++used;
  }
  if (used == 0) return kGemmOk;
  int sms = 0;
  if (int r = device_sms(&sms, err, err_len)) return r;
  if (num_sms > 0 && num_sms < sms) sms = num_sms;
  launch.num_ranks = used;
  launch.ctas_per_rank = sms / used > 0 ? sms / used : 1;
  for (int r = 0; r < num_ranks; ++r) {
    if (ranks[r].m_total == 0) continue;
    const cudaError_t e = zero_counters(ranks[r], stream);
    if (e != cudaSuccess)
      return fail(kGemmCudaError, err, err_len, "%s: cudaMemsetAsync: %s", fn, cudaGetErrorString(e));
  }
  constexpr auto kernel = &mega_moe_fwd_ranks_kernel<kMegaFwdStages, kMegaFwdDispatchSlots>;
  const cudaError_t e = set_max_dynamic_smem<kernel>(kFwdSmem);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "cudaFuncSetAttribute: %s", cudaGetErrorString(e));
  kernel<<<used * launch.ctas_per_rank, kNumThreads, kFwdSmem, stream>>>(launch);
  return check_launch(fn, err, err_len);
}

}  // namespace sm90
}  // namespace prime_kernels
