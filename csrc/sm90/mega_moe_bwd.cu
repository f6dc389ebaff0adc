// prime-kernels: host side of the sm90a fused Mega MoE backward's dgrad kernel (checks, tensor maps, launch).
#include "mega_moe_bwd.hpp"

#include "common/watchdog.hpp"
#include "host_utils.hpp"
#include "mega_moe_bwd.cuh"
#include "mega_moe_heuristics.hpp"
#include "swiglu_bwd_host.cuh"

namespace prime_kernels {
namespace sm90 {
using namespace host;

int mega_moe_bwd_dgrad_bf16(const MegaBwdDgradArgs& a, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "mega_moe_bwd_dgrad_bf16";
  SwigluBwdLaunch l;
  if (int r = prepare_swiglu_bwd(a.l2, fn, &l, err, err_len)) return r;
  const int64_t m_total = a.l2.m_total, H = a.l2.hidden, I = a.l2.intermediate;
  const int num_experts = a.l2.num_groups;
  if (H % 64 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: hidden = %lld must be a multiple of 64", fn, (long long)H);
  if (a.ldw13 < H || a.ldw13 % 8 != 0 || a.lddx < H || a.lddx % 8 != 0)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: row strides must cover their rows and be multiples of 8 (ldw13 %lld, lddx %lld)", fn,
                (long long)a.ldw13, (long long)a.lddx);
  if (num_experts > 1 && (a.w13_group_stride < 2 * I * a.ldw13 || a.w13_group_stride % 8 != 0))
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: w13_group_stride = %lld, must be >= 2 * intermediate * ldw13, multiple of 8", fn,
                (long long)a.w13_group_stride);
  if (m_total == 0) return kGemmOk;
  if (a.w13 == nullptr || a.dx == nullptr || a.counters == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: a pointer is null", fn);
  if (!aligned16(a.w13) || !aligned16(a.dx))
    return fail(kGemmInvalidArgument, err, err_len, "%s: w13 and dx must be 16-byte aligned", fn);
  CUtensorMap m_dh_a, m_w13, m_dx;
  {
    const uint64_t dims[2] = {(uint64_t)(2 * I), (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)a.l2.lddh * 2};
    const uint32_t box[2] = {64, 128};
    if (int r = make_map(&m_dh_a, a.l2.dh, 2, dims, strides, box, err, err_len)) return r;
  }
  {
    const int64_t gs = num_experts > 1 ? a.w13_group_stride : 2 * I * a.ldw13;
    const uint64_t dims[3] = {(uint64_t)H, (uint64_t)(2 * I), (uint64_t)num_experts};
    const uint64_t strides[2] = {(uint64_t)a.ldw13 * 2, (uint64_t)gs * 2};
    const uint32_t box[3] = {64, 64, 1};
    if (int r = make_map(&m_w13, a.w13, 3, dims, strides, box, err, err_len)) return r;
  }
  {
    const uint64_t dims[2] = {(uint64_t)H, (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)a.lddx * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&m_dx, a.dx, 2, dims, strides, box, err, err_len)) return r;
  }
  MegaBwdDgradParams p{};
  p.l2 = l.p;
  p.dx = reinterpret_cast<__nv_bfloat16*>(a.dx);
  p.lddx = a.lddx;
  p.hidden = static_cast<int32_t>(H);
  p.lag = mega_bwd_lag(m_total, num_experts, I, l.sms);
  p.counters = a.counters;
  p.max_m_blocks = static_cast<int32_t>(max_m_blocks(m_total, num_experts));
  cudaError_t e = wait_guard_for_current_device(&p.wait_guard);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: %s", fn, cudaGetErrorString(e));
  e = cudaMemsetAsync(a.counters, 0, sizeof(int32_t) * mega_moe_bwd_dgrad_counter_count(m_total, num_experts), stream);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: cudaMemsetAsync: %s", fn, cudaGetErrorString(e));
  const int64_t tasks = max_m_blocks(m_total, num_experts) * ((I + 127) / 128 + (H + 127) / 128);
  constexpr int kStages = 4;
  constexpr auto kernel = &mega_moe_bwd_dgrad_kernel<kStages>;
  constexpr int smem = MegaBwdLayout<kStages>::kSmemBytes;
  e = set_max_dynamic_smem<kernel>(smem);
  if (e == cudaSuccess)
    e = launch_persistent<kernel>(kNumThreads, smem, tasks, l.sms, stream, l.a, l.b, l.h, l.dh, l.aw, m_dh_a, m_w13,
                                  m_dx, p);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: %s", fn, cudaGetErrorString(e));
  return check_launch(fn, err, err_len);
}

}  // namespace sm90
}  // namespace prime_kernels
