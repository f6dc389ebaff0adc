// prime-kernels: host side of the sm90a fused FP8 Mega MoE backward (checks, tensor maps, launch).
#include "mega_moe_bwd_fp8.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "common/watchdog.hpp"
#include "fp8_maps.hpp"
#include "host_utils.hpp"
#include "mega_moe_bwd_fp8.cuh"
#include "mega_moe_heuristics.hpp"

namespace prime_kernels {
namespace sm90 {
using namespace host;

int mega_moe_bwd_fp8(const MegaBwdFp8Args& a, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "mega_moe_bwd_fp8";
  if (int r = check_swiglu_bwd_fp8_args(a.l2, err, err_len)) return r;
  const int64_t m_total = a.l2.m_total, H = a.l2.hidden, I = a.l2.intermediate;
  const int num_experts = a.l2.num_groups;
  if (I % 128 != 0)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: intermediate = %lld must be a multiple of 128 (m_grouped_fp8_gemm_swiglu_bwd and "
                "m_grouped_fp8_gemm_nt take 64)",
                fn, (long long)I);
  if (num_experts > kMegaBwdFp8MaxExpertsHost)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_groups = %d, must be at most %d", fn, num_experts,
                kMegaBwdFp8MaxExpertsHost);
  if (a.lag < -1 || a.lag > kMegaBwdMaxLagHost)
    return fail(kGemmInvalidArgument, err, err_len, "%s: lag = %d, must be -1 (the heuristic's) or in [0, %d]", fn,
                a.lag, kMegaBwdMaxLagHost);
  // The L1 dgrad's operands, checked as m_grouped_fp8_gemm_nt checks them (A = qK(dh) as the L2 dgrad writes it).
  MGroupedFp8GemmArgs l1{};
  l1.a = a.l2.dh_q;
  l1.lda = a.l2.ld_dh_q;
  l1.sa = a.l2.dh_sa;
  l1.ld_sa = a.l2.ld_dh_sa;
  l1.b = a.w13t_q;
  l1.ldb = a.ldb13;
  l1.b_group_stride = a.b13_group_stride;
  l1.sb = a.w13t_sb;
  l1.sb_group_stride = a.sb13_group_stride;
  l1.sb_n_stride = a.sb13_n_stride;
  l1.d = a.dx;
  l1.ldd = a.lddx;
  l1.group_offsets = a.l2.group_offsets;
  l1.num_groups = num_experts;
  l1.m_total = m_total;
  l1.n = H;
  l1.k = 2 * I;
  if (int r = check_m_grouped_fp8_args(l1, err, err_len)) return r;
  if (m_total == 0) return kGemmOk;
  if (a.counters == nullptr) return fail(kGemmInvalidArgument, err, err_len, "%s: counters is null", fn);
  int sms = 0;
  if (int r = device_sms(&sms, err, err_len)) return r;
  if (a.l2.num_sms > 0 && a.l2.num_sms < sms) sms = a.l2.num_sms;

  CUtensorMap m_dy, m_w2t, m_dy_sa, m_dh, m_w13t, m_dh_sa, m_dx;
  if (int r = make_m_grouped_fp8_operand_maps(&m_dy, &m_w2t, &m_dy_sa, a.l2.dy_q, a.l2.lda, a.l2.dy_sa, a.l2.ld_sa,
                                              a.l2.w2t_q, a.l2.ldb, a.l2.b_group_stride, num_experts, m_total, I, H,
                                              err, err_len, 128, 128))
    return r;
  if (int r = make_m_grouped_fp8_operand_maps(&m_dh, &m_w13t, &m_dh_sa, a.l2.dh_q, a.l2.ld_dh_q, a.l2.dh_sa,
                                              a.l2.ld_dh_sa, a.w13t_q, a.ldb13, a.b13_group_stride, num_experts,
                                              m_total, H, 2 * I, err, err_len, 128, 128))
    return r;
  {  // dX: the BF16 m-grouped output map (64 x 64 boxes, clipped at [m_total, H])
    const uint64_t dims[2] = {(uint64_t)H, (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)a.lddx * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&m_dx, a.dx, 2, dims, strides, box, err, err_len)) return r;
  }
  MegaBwdFp8Params p{};
  SwigluBwdFp8Params& g = p.l2;
  g.l2_hints = kGemmL2Hints;
  g.check = common::device_check_record();
  g.sb = a.l2.w2t_sb;
  g.sb_group_stride = num_experts > 1 ? a.l2.sb_group_stride : 0;
  g.sb_n_stride = a.l2.sb_n_stride;
  g.group_offsets = a.l2.group_offsets;
  g.m_total = (int32_t)m_total;
  g.n = (int32_t)I;
  g.k = (int32_t)H;
  g.num_groups = num_experts;
  g.h = reinterpret_cast<const __nv_bfloat16*>(a.l2.h);
  g.ldh = a.l2.ldh;
  g.pool_src_route = a.l2.pool_src_route;
  g.route_weights = a.l2.route_weights;
  g.num_routes = (int32_t)a.l2.num_routes;
  g.clamp = a.l2.clamp_limit;
  g.pow2_scales = a.l2.pow2_scales;
  g.dh_q = reinterpret_cast<uint8_t*>(a.l2.dh_q);
  g.ld_dh_q = a.l2.ld_dh_q;
  g.dh_sa = a.l2.dh_sa;
  g.ld_dh_sa = a.l2.ld_dh_sa;
  g.dht_q = reinterpret_cast<uint8_t*>(a.l2.dht_q);
  g.ld_dht_q = a.l2.ld_dht_q;
  g.dht_s = a.l2.dht_s;
  g.ld_dht_s = a.l2.ld_dht_s;
  g.awt_q = reinterpret_cast<uint8_t*>(a.l2.awt_q);
  g.ld_awt_q = a.l2.ld_awt_q;
  g.awt_s = a.l2.awt_s;
  g.ld_awt_s = a.l2.ld_awt_s;
  g.dt_part = a.l2.dt_part;
  g.dt_ld = (int32_t)a.l2.dt_ld;
  p.sb13 = a.w13t_sb;
  p.sb13_group_stride = num_experts > 1 ? a.sb13_group_stride : 0;
  p.sb13_n_stride = a.sb13_n_stride;
  p.dx = reinterpret_cast<__nv_bfloat16*>(a.dx);
  p.lddx = a.lddx;
  p.hidden = (int32_t)H;
  p.lag = a.lag >= 0 ? a.lag : mega_bwd_lag(m_total, num_experts, I, sms);
  p.counters = a.counters;
  p.max_m_blocks = (int32_t)max_m_blocks(m_total, num_experts);
  cudaError_t e = wait_guard_for_current_device(&p.wait_guard);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: %s", fn, cudaGetErrorString(e));
  e = cudaMemsetAsync(a.counters, 0, sizeof(int32_t) * mega_moe_bwd_fp8_counter_count(m_total, num_experts), stream);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: cudaMemsetAsync: %s", fn, cudaGetErrorString(e));
  // the grid: at most one CTA per task (the dgrad tiles of every m-block)
  const int64_t tasks = max_m_blocks(m_total, num_experts) * ((I + 127) / 128 + (H + 127) / 128);
  constexpr int kStages = 4;  // (3 stages, the two-launch L2 dgrad's: 1.10-1.20x the two launches' time)
  return launch_persistent_checked<&mega_moe_bwd_fp8_kernel<kStages>>(
      fn, kNumThreads, MegaBwdFp8Layout<kStages>::kSmemBytes, tasks, sms, stream, err, err_len, m_dy, m_w2t, m_dy_sa,
      m_dh, m_w13t, m_dh_sa, m_dx, p);
}

}  // namespace sm90
}  // namespace prime_kernels
