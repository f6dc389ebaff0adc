// prime-kernels: host side of the sm90a fused Mega MoE backward (checks, tensor maps, launch).
#include "mega_moe_bwd.hpp"

#include "common/watchdog.hpp"
#include "host_utils.hpp"
#include "mega_moe_bwd.cuh"
#include "mega_moe_heuristics.hpp"
#include "swiglu_bwd_host.cuh"

namespace prime_kernels {
namespace sm90 {
using namespace host;

namespace {

// A pool-row operand [m_total, cols] read MN-major by the weight-gradient tiles: boxes of 64 columns x 64 rows.
int make_pool_mn_map(CUtensorMap* map, const void* base, int64_t cols, int64_t m_total, int64_t ld, char* err,
                     size_t err_len) {
  const uint64_t dims[2] = {(uint64_t)cols, (uint64_t)m_total};
  const uint64_t strides[1] = {(uint64_t)ld * 2};
  const uint32_t box[2] = {64, 64};
  return make_map(map, base, 2, dims, strides, box, err, err_len);
}

// A bf16 weight gradient [E, rows, cols] (contiguous) stored by TMA in 64 x 64 boxes, clipped at its edges.
int make_wgrad_store_map(CUtensorMap* map, void* base, int64_t rows, int64_t cols, int num_experts, char* err,
                         size_t err_len) {
  const uint64_t dims[3] = {(uint64_t)cols, (uint64_t)rows, (uint64_t)num_experts};
  const uint64_t strides[2] = {(uint64_t)cols * 2, (uint64_t)(rows * cols) * 2};
  const uint32_t box[3] = {64, 64, 1};
  return make_map(map, base, 3, dims, strides, box, err, err_len);
}

}  // namespace

int mega_moe_bwd_bf16(const MegaBwdArgs& a, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "mega_moe_bwd_bf16";
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
  if (a.lag < -1 || a.lag > kMegaBwdMaxLagHost)
    return fail(kGemmInvalidArgument, err, err_len, "%s: lag = %d, must be -1 (the heuristic's) or in [0, %d]", fn,
                a.lag, kMegaBwdMaxLagHost);
  if (a.wgrad < kMegaBwdWgradNone || a.wgrad > kMegaBwdWgradF32Add)
    return fail(kGemmInvalidArgument, err, err_len, "%s: wgrad = %d is not a MegaBwdWgrad", fn, a.wgrad);
  const bool with_wgrad = a.wgrad != kMegaBwdWgradNone;
  if (with_wgrad) {
    if ((m_total > 0 && a.x_pool == nullptr) || a.dw2 == nullptr || a.dw13 == nullptr)
      return fail(kGemmInvalidArgument, err, err_len, "%s: the weight gradients need x_pool, dw2 and dw13", fn);
    if (a.ldx < H || a.ldx % 8 != 0)
      return fail(kGemmInvalidArgument, err, err_len, "%s: ldx = %lld, must be >= hidden and a multiple of 8", fn,
                  (long long)a.ldx);
    if (!aligned16(a.x_pool) || !aligned16(a.dw2) || !aligned16(a.dw13))
      return fail(kGemmInvalidArgument, err, err_len, "%s: x_pool, dw2 and dw13 must be 16-byte aligned", fn);
  }
  // no pool rows: every expert's gradient is zero (nothing to add when accumulating), and no dgrad tile exists
  if (m_total == 0) {
    if (a.wgrad == kMegaBwdWgradBf16 || a.wgrad == kMegaBwdWgradF32) {
      const size_t elem = a.wgrad == kMegaBwdWgradBf16 ? 2 : 4;
      const size_t per_expert = static_cast<size_t>(H) * static_cast<size_t>(I) * elem;
      cudaError_t e = cudaMemsetAsync(a.dw2, 0, per_expert * num_experts, stream);
      if (e == cudaSuccess) e = cudaMemsetAsync(a.dw13, 0, 2 * per_expert * num_experts, stream);
      if (e != cudaSuccess)
        return fail(kGemmCudaError, err, err_len, "%s: cudaMemsetAsync: %s", fn, cudaGetErrorString(e));
    }
    return kGemmOk;
  }
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
  // The weight-gradient tiles' maps; without those tiles they are never read, and stand in as copies of dx's.
  CUtensorMap m_dy_mn = m_dx, m_aw_mn = m_dx, m_dh_mn = m_dx, m_x_mn = m_dx, m_dw2 = m_dx, m_dw13 = m_dx;
  if (with_wgrad) {
    if (int r = make_pool_mn_map(&m_dy_mn, a.l2.dy_pool, H, m_total, a.l2.lda, err, err_len)) return r;
    if (int r = make_pool_mn_map(&m_aw_mn, a.l2.aw, I, m_total, a.l2.ldaw, err, err_len)) return r;
    if (int r = make_pool_mn_map(&m_dh_mn, a.l2.dh, 2 * I, m_total, a.l2.lddh, err, err_len)) return r;
    if (int r = make_pool_mn_map(&m_x_mn, a.x_pool, H, m_total, a.ldx, err, err_len)) return r;
    if (a.wgrad == kMegaBwdWgradBf16) {
      if (int r = make_wgrad_store_map(&m_dw2, a.dw2, H, I, num_experts, err, err_len)) return r;
      if (int r = make_wgrad_store_map(&m_dw13, a.dw13, 2 * I, H, num_experts, err, err_len)) return r;
    }
  }
  MegaBwdParams p{};
  p.l2 = l.p;
  p.dx = reinterpret_cast<__nv_bfloat16*>(a.dx);
  p.lddx = a.lddx;
  p.hidden = static_cast<int32_t>(H);
  p.lag = a.lag >= 0 ? a.lag : mega_bwd_lag(m_total, num_experts, I, l.sms);
  p.wgrad_out = a.wgrad == kMegaBwdWgradNone   ? kMegaBwdNoWgrad
                : a.wgrad == kMegaBwdWgradBf16 ? static_cast<int32_t>(kOutBf16Store)
                : a.wgrad == kMegaBwdWgradF32  ? static_cast<int32_t>(kOutF32Store)
                                               : static_cast<int32_t>(kOutF32Accumulate);
  if (with_wgrad && a.wgrad != kMegaBwdWgradBf16) {
    p.dw2_f32 = static_cast<float*>(a.dw2);
    p.dw13_f32 = static_cast<float*>(a.dw13);
  }
  p.counters = a.counters;
  p.max_m_blocks = static_cast<int32_t>(max_m_blocks(m_total, num_experts));
  cudaError_t e = wait_guard_for_current_device(&p.wait_guard);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: %s", fn, cudaGetErrorString(e));
  e = cudaMemsetAsync(a.counters, 0, sizeof(int32_t) * mega_moe_bwd_counter_count(m_total, num_experts), stream);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: cudaMemsetAsync: %s", fn, cudaGetErrorString(e));
  // the grid: at most one CTA per task (the dgrad tiles of every m-block, then every expert's gradient tiles)
  int64_t tasks = max_m_blocks(m_total, num_experts) * ((I + 127) / 128 + (H + 127) / 128);
  if (with_wgrad) tasks += int64_t(num_experts) * ((H + 127) / 128) * ((I + 127) / 128) * 3;
  constexpr int kStages = 4;
  constexpr auto kernel = &mega_moe_bwd_kernel<kStages>;
  constexpr int smem = MegaBwdLayout<kStages>::kSmemBytes;
  e = set_max_dynamic_smem<kernel>(smem);
  if (e == cudaSuccess)
    e = launch_persistent<kernel>(kNumThreads, smem, tasks, l.sms, stream, l.a, l.b, l.h, l.dh, l.aw, m_dh_a, m_w13,
                                  m_dx, m_dy_mn, m_aw_mn, m_dh_mn, m_x_mn, m_dw2, m_dw13, p);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: %s", fn, cudaGetErrorString(e));
  return check_launch(fn, err, err_len);
}

}  // namespace sm90
}  // namespace prime_kernels
