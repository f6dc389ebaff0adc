// prime-kernels: host side of the sm90a fused Mega MoE forward in FP8 (checks, tensor maps, launch).
#include <cuda.h>

#include <cstdint>

#include "common/quantize_fp8.hpp"
#include "common/quantize_fp8_args.hpp"
#include "common/watchdog.hpp"
#include "fp8_maps.hpp"
#include "gemm_heuristics.hpp"
#include "host_utils.hpp"
#include "mega_moe.hpp"
#include "mega_moe_fwd_fp8.cuh"
#include "mega_moe_heuristics.hpp"

namespace prime_kernels {
namespace sm90 {
using namespace host;

namespace {

int check_mega_fwd_fp8_args(const MegaFwdFp8Args& a, char* err, size_t err_len) {
  const char* fn = "mega_moe_fwd_fp8";
  if (a.num_experts < 1 || a.num_experts > kMegaMaxExperts)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_experts = %d, must be in [1, %d]", fn, a.num_experts,
                kMegaMaxExperts);
  if (a.top_k < 1) return fail(kGemmInvalidArgument, err, err_len, "%s: top_k = %d, must be >= 1", fn, a.top_k);
  if (a.m_total < 0 || a.m_total > kMaxDim || a.hidden < 128 || a.hidden % 128 != 0 || a.hidden > 65536 ||
      a.inter < 128 || a.inter % 128 != 0 || 2 * a.inter > kMaxDim)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: bad sizes m_total=%lld hidden=%lld inter=%lld (hidden and inter multiples of 128: the weights' "
                "128 x 128 scale blocks)",
                fn, (long long)a.m_total, (long long)a.hidden, (long long)a.inter);
  if (a.m_total * ((a.hidden * 2 + kDispatchSlotBytes - 1) / kDispatchSlotBytes) > kMaxDim)
    return fail(kGemmInvalidArgument, err, err_len, "%s: m_total = %lld is too large for this hidden size", fn,
                (long long)a.m_total);
  if (a.num_tokens < 0 || a.num_tokens * a.top_k >= (int64_t(1) << 31))
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_tokens = %lld, num_tokens * top_k must be < 2^31", fn,
                (long long)a.num_tokens);
  if (a.num_tokens > 0 && (a.x == nullptr || !aligned16(a.x) || a.ld_x < a.hidden || a.ld_x % 8 != 0))
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: x must be 16-byte aligned with ld_x (%lld) >= hidden and a multiple of 8", fn, (long long)a.ld_x);
  if (a.num_sms < 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_sms = %d, must be >= 1 (or 0: every SM)", fn, a.num_sms);
  if (a.m_total == 0) return kGemmOk;
  if (a.num_tokens > 0 && a.route_to_pool == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: null route_to_pool", fn);
  if (a.pool_src_route == nullptr || a.expert_offsets == nullptr || a.counters == nullptr || a.w13_q == nullptr ||
      a.w13_sb == nullptr || a.w2_q == nullptr || a.w2_sb == nullptr || a.x_q == nullptr || a.x_sa == nullptr ||
      a.s_q == nullptr || a.s_sa == nullptr || a.o == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: null pointer argument", fn);
  if (!aligned16(a.w13_q) || !aligned16(a.w2_q) || !aligned16(a.x_q) || !aligned16(a.x_sa) || !aligned16(a.s_q) ||
      !aligned16(a.s_sa) || !aligned16(a.o) || (a.h != nullptr && !aligned16(a.h)))
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: w13_q, w2_q, x_q, x_sa, s_q, s_sa, h and o must be 16-byte aligned", fn);
  if (reinterpret_cast<uintptr_t>(a.w13_sb) % 4 != 0 || reinterpret_cast<uintptr_t>(a.w2_sb) % 4 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: w13_sb and w2_sb must be 4-byte aligned", fn);
  if (a.ld_x_q < a.hidden || a.ld_x_q % 16 != 0 || a.ld_x_q > kMaxDim)
    return fail(kGemmInvalidArgument, err, err_len, "%s: ld_x_q = %lld, must be >= hidden and a multiple of 16", fn,
                (long long)a.ld_x_q);
  if (a.ld_x_sa < a.m_total || a.ld_x_sa % 4 != 0 || a.ld_x_sa > kMaxDim || a.ld_s_sa < a.m_total ||
      a.ld_s_sa % 4 != 0 || a.ld_s_sa > kMaxDim)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: ld_x_sa = %lld, ld_s_sa = %lld: must be >= m_total (%lld) and multiples of 4", fn,
                (long long)a.ld_x_sa, (long long)a.ld_s_sa, (long long)a.m_total);
  const int64_t hb = a.hidden / 128, ib = a.inter / 128;
  if (a.w13_sb_n_stride < hb || a.w13_sb_group_stride < 2 * ib * a.w13_sb_n_stride || a.w2_sb_n_stride < ib ||
      a.w2_sb_group_stride < hb * a.w2_sb_n_stride)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: the weights' scale strides do not cover [E, 2I / 128, H / 128] and [E, H / 128, I / 128]", fn);
  return kGemmOk;
}

}  // namespace

int mega_moe_fwd_fp8(const MegaFwdFp8Args& a, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "mega_moe_fwd_fp8";
  if (int r = check_mega_fwd_fp8_args(a, err, err_len)) return r;
  if (a.m_total == 0) return kGemmOk;  // no pool rows: nothing to compute
  int sms = 0;
  if (int r = device_sms(&sms, err, err_len)) return r;
  if (a.num_sms > 0 && a.num_sms < sms) sms = a.num_sms;
  const int64_t m = a.m_total, H = a.hidden, I = a.inter;
  const int E = a.num_experts;

  // L1: A = x_q, B = W13 in 64-row boxes (a tile's gate rows n0.. and up rows I + n0..), A's 1 x 128 scales;
  // L2: A = s_q, B = W2 in 128-row boxes, A's 1 x 64 scales (two boxes per 128-wide k-block)
  CUtensorMap m_xq, m_w13, m_xsa, m_sq, m_w2, m_ssa, m_o;
  if (int r = make_m_grouped_fp8_operand_maps(&m_xq, &m_w13, &m_xsa, a.x_q, a.ld_x_q, a.x_sa, a.ld_x_sa, a.w13_q, H,
                                              2 * I * H, E, m, 2 * I, H, err, err_len, kSwigluFwdFp8Block, 128))
    return r;
  if (int r = make_m_grouped_fp8_operand_maps(&m_sq, &m_w2, &m_ssa, a.s_q, I, a.s_sa, a.ld_s_sa, a.w2_q, I, H * I, E,
                                              m, H, I, err, err_len, 128, 64))
    return r;
  {  // o: the FP8 GEMM's output map (64 x 64 boxes, clipped at [m_total, hidden])
    const uint64_t dims[2] = {(uint64_t)H, (uint64_t)m};
    const uint64_t strides[1] = {(uint64_t)H * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&m_o, a.o, 2, dims, strides, box, err, err_len)) return r;
  }

  // The L1 epilogue's stores: h's gate and up boxes (64 x 64 bf16, 128-byte swizzle, the staging tile's layout), s
  // (64 rows x 64 bytes) and its 64 scales of one 1 x 64 block column (no swizzle)
  CUtensorMap m_h = m_o, m_sq_st, m_ssa_st;
  if (a.h != nullptr) {
    const uint64_t dims[2] = {(uint64_t)(2 * I), (uint64_t)m};
    const uint64_t strides[1] = {(uint64_t)(2 * I) * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&m_h, a.h, 2, dims, strides, box, err, err_len)) return r;
  }
  {
    const uint64_t dims[2] = {(uint64_t)I, (uint64_t)m};
    const uint64_t strides[1] = {(uint64_t)I};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&m_sq_st, a.s_q, 2, dims, strides, box, err, err_len, CU_TENSOR_MAP_DATA_TYPE_UINT8,
                         CU_TENSOR_MAP_SWIZZLE_NONE))
      return r;
  }
  {
    const uint64_t dims[2] = {(uint64_t)m, (uint64_t)(I / 64)};
    const uint64_t strides[1] = {(uint64_t)a.ld_s_sa * 4};
    const uint32_t box[2] = {64, 1};
    if (int r = make_map(&m_ssa_st, a.s_sa, 2, dims, strides, box, err, err_len, CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
                         CU_TENSOR_MAP_SWIZZLE_NONE))
      return r;
  }

  MegaFwdFp8Params p{};
  p.x = static_cast<const __nv_bfloat16*>(a.x);
  p.ld_x = a.ld_x;
  p.pool_src_route = a.pool_src_route;
  p.route_to_pool = a.route_to_pool;
  p.top_k = a.top_k;
  p.num_tokens = static_cast<int32_t>(a.num_tokens);
  p.expert_offsets = a.expert_offsets;
  p.num_experts = E;
  p.m_total = static_cast<int32_t>(m);
  p.hidden = static_cast<int32_t>(H);
  p.inter = static_cast<int32_t>(I);
  p.x_q = static_cast<uint8_t*>(a.x_q);
  p.ld_x_q = a.ld_x_q;
  p.x_sa = a.x_sa;
  p.ld_x_sa = a.ld_x_sa;
  p.l1.l2_hints = kGemmL2Hints;
  p.l1.check = common::device_check_record();
  p.l1.sb = a.w13_sb;
  p.l1.sb_group_stride = a.w13_sb_group_stride;
  p.l1.sb_n_stride = a.w13_sb_n_stride;
  p.l1.group_offsets = a.expert_offsets;
  p.l1.m_total = static_cast<int32_t>(m);
  p.l1.n = static_cast<int32_t>(I);
  p.l1.k = static_cast<int32_t>(H);
  p.l1.num_groups = E;
  p.l1.pow2_scales = a.pow2_scales;
  p.l1.h = static_cast<__nv_bfloat16*>(a.h);
  p.l1.ldh = 2 * I;
  p.l1.s_q = static_cast<uint8_t*>(a.s_q);
  p.l1.ld_s_q = I;
  p.l1.s_sa = a.s_sa;
  p.l1.ld_s_sa = a.ld_s_sa;
  p.l2.l2_hints = kGemmL2Hints;
  p.l2.check = p.l1.check;
  p.l2.d = static_cast<__nv_bfloat16*>(a.o);
  p.l2.ldd = H;
  p.l2.sb = a.w2_sb;
  p.l2.sb_group_stride = a.w2_sb_group_stride;
  p.l2.sb_n_stride = a.w2_sb_n_stride;
  p.l2.group_offsets = a.expert_offsets;
  p.l2.m_total = static_cast<int32_t>(m);
  p.l2.n = static_cast<int32_t>(H);
  p.l2.k = static_cast<int32_t>(I);
  p.l2.num_groups = E;
  p.counters = a.counters;
  p.max_m_blocks = static_cast<int32_t>(max_m_blocks(m, E));
  p.l2_hints = kGemmL2Hints;
  cudaError_t e = wait_guard_for_current_device(&p.wait_guard);
  if (e != cudaSuccess)
    return fail(kGemmCudaError, err, err_len, "%s: allocating the wait record: %s", fn, cudaGetErrorString(e));
  p.check = p.l1.check;

  if (a.num_tokens > 0) {  // the token rows into the pool, each quantized once (every row read by L1 is written)
    common::DispatchRowsFp8Args d;
    d.src = a.x;
    d.ld_src = a.ld_x;
    d.route_to_pool = a.route_to_pool;
    d.num_tokens = a.num_tokens;
    d.top_k = a.top_k;
    d.hidden = H;
    d.q = a.x_q;
    d.ld_q = a.ld_x_q;
    d.sa = a.x_sa;
    d.ld_sa = a.ld_x_sa;
    d.num_rows = m;
    d.pow2_scales = a.pow2_scales;
    if (common::quantize_host::check_dispatch_rows_fp8_args(d, true, err, err_len)) return kGemmInvalidArgument;
    e = common::launch_dispatch_rows_fp8(d, stream);
    if (e != cudaSuccess)
      return fail(kGemmCudaError, err, err_len, "%s: the dispatch launch: %s", fn, cudaGetErrorString(e));
  }
  e = cudaMemsetAsync(a.counters, 0, sizeof(int32_t) * mega_moe_fwd_counter_count(m, E), stream);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: cudaMemsetAsync: %s", fn, cudaGetErrorString(e));
  // Any number of CTAs may run at once (the kernel claims its work: mega_moe_fwd_fp8.cuh), one per SM at most.
  constexpr auto kernel = &mega_moe_fwd_fp8_kernel<kMegaFwdFp8Stages>;
  constexpr int smem = MegaFwdFp8Layout<kMegaFwdFp8Stages>::kSmemBytes;
  e = set_max_dynamic_smem<kernel>(smem);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "cudaFuncSetAttribute: %s", cudaGetErrorString(e));
  kernel<<<sms, kNumThreads, smem, stream>>>(m_xq, m_xsa, m_w13, m_sq, m_ssa, m_w2, m_o, m_h, m_sq_st, m_ssa_st, p);
  return check_launch(fn, err, err_len);
}

}  // namespace sm90
}  // namespace prime_kernels
