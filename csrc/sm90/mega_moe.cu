// prime-kernels: host side of the sm90a fused Mega MoE forward (checks, tensor maps, launch).
#include "mega_moe.hpp"

#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/combine.hpp"
#include "host_utils.hpp"
#include "mega_moe_fwd.cuh"
#include "mega_moe_fwd_pp.cuh"

namespace deep_gemm {
namespace sm90 {
using namespace host;

namespace {
// The cooperative kernel (the default): 3 stages of 128x256x64 (48 KB each) + the 32 KB half-width staging
// tile leave room for 11 dispatch slots of 4 KB; the three dispatch warps use 3 each.
constexpr int kFwdStages = 3;
constexpr int kFwdDispatchSlots = 9;
// The ping-pong kernel: 4 stages of 128x128x64 (32 KB each), 2 x 16 KB staging, the same 9 dispatch slots.
constexpr int kFwdPPStages = 4;
// Where the combine runs: PK_MEGA_FWD_COMBINE=kernel reduces each token inside the ping-pong forward kernel as
// its last L2 tile lands (measured slower: bench/NOTES.md, f10); otherwise the standalone combine kernel runs
// right after the forward, on the same stream. Development aid, read at every call.
bool combine_in_kernel() {
  const char* v = std::getenv("PK_MEGA_FWD_COMBINE");
  return v != nullptr && std::strcmp(v, "kernel") == 0;
}
// Which kernel runs: the cooperative one (mega_moe_fwd.cuh: both consumer warpgroups on one 128 x 256 tile;
// measured faster with h and in the steady state, bench/NOTES.md session 6), or the ping-pong one
// (mega_moe_fwd_pp.cuh) with PK_MEGA_FWD_KERNEL=pingpong or the in-kernel combine, which only it has.
// Development aid, read at every call, so that one process can time both.
bool use_cooperative() {
  const char* v = std::getenv("PK_MEGA_FWD_KERNEL");
  return !(v != nullptr && std::strcmp(v, "pingpong") == 0) && !combine_in_kernel();
}
// The cooperative kernel's epilogue hand-offs to the dispatch warps once they are done (MegaFwdParams::handoff
// bits; bench/NOTES.md, sessions 9 and 15): kMegaFwdHandoff unless PK_MEGA_FWD_HANDOFF names other bits
// (development aid, read at every call, for A/B timing).
int32_t handoff_bits() {
  const char* v = std::getenv("PK_MEGA_FWD_HANDOFF");
  return v != nullptr ? static_cast<int32_t>(std::atoi(v)) & 3 : kMegaFwdHandoff;
}
// The share of the pool (percent of m_total, first rows) dispatched in pool order; the rest goes token by token
// (MegaFwdParams::disp_split_row). The token-major rows all land near the end of the dispatch, so the L1 tiles must
// not reach them sooner: the tiles' time per dispatched row grows with inter, hence the default share
// kMegaFwdDispatchSplitAt768 * 768 / inter (at least kMegaFwdDispatchSplitMin; 100 = all in pool order).
// PK_MEGA_FWD_DISPATCH_SPLIT names another share (development aid, read at every call).
int dispatch_split_pct(int64_t inter) {
  const char* v = std::getenv("PK_MEGA_FWD_DISPATCH_SPLIT");
  int64_t pct = v != nullptr ? std::atoi(v) : (kMegaFwdDispatchSplitAt768 * 768 + inter - 1) / inter;
  if (v == nullptr && pct < kMegaFwdDispatchSplitMin) pct = kMegaFwdDispatchSplitMin;
  return static_cast<int>(pct < 0 ? 0 : (pct > 100 ? 100 : pct));
}
}  // namespace

bool mega_moe_fwd_combines_in_kernel() { return combine_in_kernel(); }

int mega_moe_fwd_bf16(const void* const* x_ranks, int num_ranks, int64_t ld_x, const int32_t* pool_src_route,
                      const int32_t* pool_src_rank, int top_k, const int32_t* expert_offsets, int num_experts,
                      int64_t m_total, int64_t hidden, int64_t inter, const void* w13, const void* w2, void* x_pool,
                      void* s, void* h, void* o, int64_t num_tokens, const int32_t* route_to_pool,
                      const float* topk_weights, void* y, float clamp, int32_t* counters, int num_sms,
                      cudaStream_t stream, char* err, size_t err_len) {
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
  if (route_to_pool != nullptr && (num_tokens < 0 || num_tokens * top_k >= (int64_t(1) << 31)))
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_tokens = %lld, num_tokens * top_k must be < 2^31", fn,
                (long long)num_tokens);
  if (y != nullptr && route_to_pool == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: y needs route_to_pool", fn);
  const bool combine = y != nullptr;
  if (combine) {
    if (!aligned16(y)) return fail(kGemmInvalidArgument, err, err_len, "%s: y is not 16-byte aligned", fn);
    if (y == o || y == x_pool || y == s || (h != nullptr && y == h))
      return fail(kGemmInvalidArgument, err, err_len, "%s: y must not alias x_pool, s, h or o", fn);
  }
  if (m_total == 0) {  // no pool rows: every token of y (if asked) has no route
    if (combine && num_tokens > 0) {
      const cudaError_t e = cudaMemsetAsync(y, 0, static_cast<size_t>(num_tokens) * hidden * 2, stream);
      if (e != cudaSuccess)
        return fail(kGemmCudaError, err, err_len, "%s: cudaMemsetAsync: %s", fn, cudaGetErrorString(e));
    }
    return kGemmOk;
  }
  for (int r = 0; r < num_ranks; ++r)
    if (x_ranks[r] == nullptr || !aligned16(x_ranks[r]))
      return fail(kGemmInvalidArgument, err, err_len, "%s: x_ranks[%d] is null or not 16-byte aligned", fn, r);
  if (pool_src_route == nullptr || expert_offsets == nullptr || counters == nullptr || w13 == nullptr ||
      w2 == nullptr || x_pool == nullptr || s == nullptr || o == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: null pointer argument", fn);
  if (!aligned16(w13) || !aligned16(w2) || !aligned16(x_pool) || !aligned16(s) || !aligned16(o) ||
      (h != nullptr && !aligned16(h)))
    return fail(kGemmInvalidArgument, err, err_len, "%s: w13, w2, x_pool, s, h and o must be 16-byte aligned", fn);
  const bool cooperative = use_cooperative();
  const bool fused_combine = combine && combine_in_kernel();  // implies the ping-pong kernel (use_cooperative)
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
    const uint32_t box[3] = {64, cooperative ? 128u : 64u, 1};
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
    const uint32_t box[3] = {64, cooperative ? 256u : 128u, 1};
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
  CUtensorMap m_s_st;  // s as the cooperative kernel's L1 epilogue stores it: 64-row boxes
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
  p.num_tokens = route_to_pool != nullptr ? static_cast<int32_t>(num_tokens) : 0;
  p.topk_weights = topk_weights;
  p.y = fused_combine ? static_cast<__nv_bfloat16*>(y) : nullptr;
  p.counters = counters;
  p.max_m_blocks = (int32_t)max_m_blocks(m_total, num_experts);
  p.token_ctr = counters + 2 * p.max_m_blocks;  // after the dispatch and L1 counters
  // Development aid: PK_MEGA_FWD_STATS=1 synchronizes after the launch and prints per-role clock figures
  // (average over CTAs, in microseconds at the SM clock of 1.98 GHz max) to stderr.
  static const bool kStats = std::getenv("PK_MEGA_FWD_STATS") != nullptr;
  static long long* stats_buf = nullptr;
  if (kStats && stats_buf == nullptr && cudaMalloc(&stats_buf, sizeof(long long) * 1024 * kStatsPerCta) != cudaSuccess)
    stats_buf = nullptr;
  p.stats = kStats ? stats_buf : nullptr;
  p.handoff = cooperative ? handoff_bits() : 0;
  p.l2_hints = l2_hints_from_env("PK_MEGA_FWD_L2HINT", kMegaFwdL2Hints);
  if (p.stats != nullptr) cudaMemsetAsync(p.stats, 0, sizeof(long long) * 1024 * kStatsPerCta, stream);
  // PK_MEGA_FWD_STATS=dispatch: the dispatch alone, no GEMM tiles (results are not computed; timing only)
  // PK_MEGA_FWD_STATS=d<bits>: bits 1-3 of MegaFwdParams::dispatch_only (d0 = the dispatch alone)
  // PK_MEGA_FWD_STATS=nodispatch: the tiles alone, every m-block marked dispatched (x_pool not written)
  p.dispatch_only = kStats && std::getenv("PK_MEGA_FWD_STATS")[0] == 'd'
                        ? 1 | (std::atoi(std::getenv("PK_MEGA_FWD_STATS") + 1) << 1)
                        : (kStats && std::strcmp(std::getenv("PK_MEGA_FWD_STATS"), "nodispatch") == 0 ? 16 : 0);

  const int64_t num_counters =
      mega_moe_fwd_counter_count(m_total, num_experts, p.y != nullptr ? num_tokens : 0, hidden);
  cudaError_t e = cudaMemsetAsync(counters, 0, sizeof(int32_t) * num_counters, stream);
  if (e == cudaSuccess && (p.dispatch_only & 16))
    e = cudaMemsetAsync(counters, 0x7f, sizeof(int32_t) * p.max_m_blocks, stream);  // every m-block "dispatched"
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: cudaMemsetAsync: %s", fn, cudaGetErrorString(e));
  // Every CTA must be resident at once (tiles wait for tiles of other CTAs): one per SM at most.
  auto launch_pp = [&](auto stages, auto slots) -> cudaError_t {
    constexpr auto kernel = &mega_moe_fwd_pp_kernel<decltype(stages)::value, decltype(slots)::value>;
    constexpr int smem = MegaFwdPPLayout<decltype(stages)::value, decltype(slots)::value>::kSmemBytes;
    const cudaError_t r = set_max_dynamic_smem<kernel>(smem);
    if (r == cudaSuccess) kernel<<<sms, kNumThreads, smem, stream>>>(m_xpool, m_w13, m_s, m_w2, m_h, m_o, p);
    return r;
  };
  if (!cooperative) {
    // Development aid: PK_MEGA_FWD_PP_STAGES=5 trades 3 dispatch slots for a 5th stage (read at every call).
    const char* st = std::getenv("PK_MEGA_FWD_PP_STAGES");
    e = st != nullptr && st[0] == '5'
            ? launch_pp(std::integral_constant<int, 5>{}, std::integral_constant<int, 6>{})
            : launch_pp(std::integral_constant<int, kFwdPPStages>{}, std::integral_constant<int, kFwdDispatchSlots>{});
    if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "cudaFuncSetAttribute: %s", cudaGetErrorString(e));
  } else {
    constexpr auto kernel = &mega_moe_fwd_kernel<kFwdStages, kFwdDispatchSlots>;
    constexpr int smem = MegaFwdLayout<kFwdStages, kFwdDispatchSlots>::kSmemBytes;
    e = set_max_dynamic_smem<kernel>(smem);
    if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "cudaFuncSetAttribute: %s", cudaGetErrorString(e));
    kernel<<<sms, kNumThreads, smem, stream>>>(m_xpool, m_w13, m_s, m_w2, m_h, m_o, m_s_st, p);
  }
  if (combine && !fused_combine && num_tokens > 0) {
    if (int r = check_launch(fn, err, err_len)) return r;
    const common::CombineArgs c{o, hidden, route_to_pool, topk_weights, num_tokens, top_k, hidden, y, hidden};
    e = common::launch_combine(c, stream);
    if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: combine: %s", fn, cudaGetErrorString(e));
  }
  if (p.stats != nullptr && cudaStreamSynchronize(stream) == cudaSuccess) {
    std::vector<long long> st(static_cast<size_t>(sms) * kStatsPerCta);
    cudaMemcpy(st.data(), p.stats, st.size() * sizeof(long long), cudaMemcpyDeviceToHost);
    double avg[kStatsPerCta] = {0}, mx[kStatsPerCta] = {0};
    for (int b = 0; b < sms; ++b)
      for (int i = 0; i < kStatsPerCta; ++i) {
        avg[i] += st[b * kStatsPerCta + i] / 1980.0 / sms;
        mx[i] = mx[i] > st[b * kStatsPerCta + i] / 1980.0 ? mx[i] : st[b * kStatsPerCta + i] / 1980.0;
      }
    fprintf(stderr,
            "mega_fwd stats (us avg/max): wait_dispatch %.0f/%.0f wait_l1 %.0f/%.0f producer_end %.0f/%.0f "
            "dispatch_end %.0f/%.0f consumer_end %.0f/%.0f %.0f/%.0f epilogue_l1 %.0f/%.0f epilogue_l2 %.0f/%.0f "
            "producer_wait_free_stage %.0f/%.0f\n",
            avg[0], mx[0], avg[1], mx[1], avg[2], mx[2], avg[3], mx[3], avg[4], mx[4], avg[5], mx[5], avg[6], mx[6],
            avg[7], mx[7], avg[16], mx[16]);
    if (!cooperative)
      fprintf(stderr,
              "mega_fwd pp stats (us avg per CTA, wg0 / wg1): turn wait %.0f / %.0f mainloop %.0f / %.0f "
              "epilogue L1 %.0f / %.0f epilogue L2 %.0f / %.0f\n",
              avg[8], avg[9], avg[10], avg[11], avg[12], avg[13], avg[14], avg[15]);
  }
  return check_launch(fn, err, err_len);
}

}  // namespace sm90
}  // namespace deep_gemm
