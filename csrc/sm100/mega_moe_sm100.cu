// prime-kernels: host side of the sm_100a BF16 fused MoE forward (checks, tensor maps, the launches).
// The tensor maps, the SM count, error strings and the checks both fused forwards make of their common arguments are
// sm90's host_utils.hpp (plain host code: one cuTensorMapEncodeTiled entry point, through the driver, for the whole
// library).
#include "mega_moe_sm100.hpp"

#include "common/device_check.hpp"
#include "dispatch_pool_sm100.cuh"
#include "mega_moe_fwd_sm100.cuh"
#include "mega_moe_heuristics_sm100.hpp"
#include "sm90/host_utils.hpp"
#include "sm90/m_blocks.hpp"

namespace prime_kernels {
namespace sm100 {
using namespace sm90::host;
using sm90::kGemmInvalidArgument;
using sm90::kGemmOk;

namespace {

int check_args(const MegaFwdSm100Args& a, const char* fn, char* err, size_t err_len) {
  if (int r = check_mega_fwd_sizes(a, kMegaSm100MaxExperts, fn, err, err_len)) return r;
  if (a.num_tokens < 0 || a.num_tokens * a.top_k >= (int64_t(1) << 31))
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_tokens = %lld, num_tokens * top_k must be < 2^31", fn,
                (long long)a.num_tokens);
  if (a.num_tokens > 0 && (a.ld_x < a.hidden || a.ld_x % 8 != 0))
    return fail(kGemmInvalidArgument, err, err_len, "%s: ld_x = %lld, must be >= hidden and a multiple of 8", fn,
                (long long)a.ld_x);
  if (!(a.clamp >= 0.f)) return fail(kGemmInvalidArgument, err, err_len, "%s: clamp must be >= 0 (0 = none)", fn);
  if (a.num_sms < 0) return fail(kGemmInvalidArgument, err, err_len, "%s: num_sms = %d, must be >= 0", fn, a.num_sms);
  if (a.m_total == 0) return kGemmOk;
  if (a.num_tokens > 0 && (a.x == nullptr || !aligned16(a.x)))
    return fail(kGemmInvalidArgument, err, err_len, "%s: x is null or not 16-byte aligned", fn);
  return check_mega_fwd_pointers(a, false, fn, err, err_len);
}

// The tensor maps of the two GEMM launches (mega_moe_fwd_sm100.cuh, MegaFwdSm100Maps).
int make_maps(const MegaFwdSm100Args& a, MegaFwdSm100Maps* l1, MegaFwdSm100Maps* l2, char* err, size_t err_len) {
  const uint64_t H = static_cast<uint64_t>(a.hidden), I = static_cast<uint64_t>(a.inter);
  const uint64_t M = static_cast<uint64_t>(a.m_total), E = static_cast<uint64_t>(a.num_experts);
  {
    // The gather4 map over the token rows: box 64 x 1 (the form gather4 needs). With no tokens every gathered
    // row index is -1, so any valid one-row map will do: w13's first row.
    const bool none = a.num_tokens == 0;
    const uint64_t dims[2] = {H, none ? 1 : static_cast<uint64_t>(a.num_tokens)};
    const uint64_t strides[1] = {none ? H * 2 : static_cast<uint64_t>(a.ld_x) * 2};
    const uint32_t box[2] = {64, 1};
    if (int r = make_map(&l1->a, none ? a.w13 : a.x, 2, dims, strides, box, err, err_len)) return r;
  }
  {
    const uint64_t dims[3] = {H, 2 * I, E};
    const uint64_t strides[2] = {H * 2, 2 * I * H * 2};
    const uint32_t box[3] = {64, 128, 1};
    if (int r = make_map(&l1->b, a.w13, 3, dims, strides, box, err, err_len)) return r;
  }
  {
    const uint64_t dims[2] = {I, M};
    const uint64_t strides[1] = {I * 2};
    const uint32_t box[2] = {64, 128};
    if (int r = make_map(&l2->a, a.s, 2, dims, strides, box, err, err_len)) return r;
  }
  {
    const uint64_t dims[3] = {I, H, E};
    const uint64_t strides[2] = {I * 2, H * I * 2};
    const uint32_t box[3] = {64, 256, 1};
    if (int r = make_map(&l2->b, a.w2, 3, dims, strides, box, err, err_len)) return r;
  }
  // The epilogue's stores: one warp's 32 rows by 32 columns, in the 64-byte swizzle its staging boxes use.
  const uint32_t out_box[2] = {32, 32};
  auto store_map = [&](CUtensorMap* m, const void* base, uint64_t cols) {
    const uint64_t dims[2] = {cols, M};
    const uint64_t strides[1] = {cols * 2};
    return make_map(m, base, 2, dims, strides, out_box, err, err_len, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                    CU_TENSOR_MAP_SWIZZLE_64B);
  };
  if (int r = store_map(&l1->c, a.s, I)) return r;
  if (a.h != nullptr) {
    if (int r = store_map(&l1->d, a.h, 2 * I)) return r;
  }
  if (int r = store_map(&l2->c, a.o, H)) return r;
  return kGemmOk;
}

// The kernel's tile constants are fixed in its code; the heuristics name them.
static_assert(kMegaSm100BlockM == 128 && kMegaSm100BlockK == 64 && kMegaSm100L1BlockN == 128 &&
                  kMegaSm100L2BlockN == 256 && kMegaSm100AccStages == 2 &&
                  kMegaSm100TmemCols == kMegaSm100TmemAlloc && kMegaSm100AccCols == 256,
              "mega_moe_fwd_sm100.cuh is written for these tiles");

// The one instantiation of each phase (mega_moe_heuristics_sm100.hpp).
constexpr int kGemmSmem = MegaFwdSm100Layout<kMegaSm100Stages>::kSmemBytes;

// A persistent launch: one CTA per SM, fewer when the tile bound is smaller (mega_moe_tiles_sm100.cuh strides
// the tiles over whatever grid runs).
template <auto kKernel>
int launch_gemm(const char* fn, int64_t tiles, int sms, const MegaFwdSm100Maps& maps, const MegaFwdSm100Params& p,
                cudaStream_t stream, char* err, size_t err_len) {
  return launch_persistent_checked<kKernel>(fn, kMegaSm100Threads, kGemmSmem, tiles, sms, stream, err, err_len, maps,
                                            p);
}

}  // namespace

int mega_moe_fwd_bf16_sm100(const MegaFwdSm100Args& a, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "mega_moe_fwd_bf16_sm100";
  if (int r = check_args(a, fn, err, err_len)) return r;
  if (a.m_total == 0) return kGemmOk;
  const MegaFwdSm100Config cfg = mega_fwd_sm100_config(a.hidden, a.inter);
  const int64_t m_blocks = sm90::max_m_blocks(a.m_total, a.num_experts);
  const int64_t l1_ctas = m_blocks * cfg.l1_n_blocks, l2_ctas = m_blocks * cfg.l2_n_blocks;
  if (l1_ctas > kMaxDim || l2_ctas > kMaxDim)
    return fail(kGemmInvalidArgument, err, err_len, "%s: m_total = %lld is too large for one launch", fn,
                (long long)a.m_total);
  MegaFwdSm100Maps l1_maps{}, l2_maps{};
  if (int r = make_maps(a, &l1_maps, &l2_maps, err, err_len)) return r;
  int sms = 0;
  // The kernels are built for 100a, 103a or 100f; which of those the device takes is the C ABI's check (api.cpp).
  if (int r = device_sms_of(10, -1, fn, "sm_100", &sms, err, err_len)) return r;
  if (a.num_sms > 0 && a.num_sms < sms) sms = a.num_sms;

  DispatchPoolSm100Params d{};
  d.x = static_cast<const __nv_bfloat16*>(a.x);
  d.ld_x = a.ld_x;
  d.pool_src_route = a.pool_src_route;
  d.top_k = a.top_k;
  d.num_tokens = static_cast<int32_t>(a.num_tokens);
  d.expert_offsets = a.expert_offsets;
  d.num_experts = a.num_experts;
  d.m_total = static_cast<int32_t>(a.m_total);
  d.hidden = static_cast<int32_t>(a.hidden);
  d.x_pool = static_cast<__nv_bfloat16*>(a.x_pool);
  d.check = common::device_check_record();

  MegaFwdSm100Params p{};
  p.expert_offsets = a.expert_offsets;
  p.num_experts = a.num_experts;
  p.m_total = static_cast<int32_t>(a.m_total);
  p.hidden = static_cast<int32_t>(a.hidden);
  p.inter = static_cast<int32_t>(a.inter);
  p.s = static_cast<__nv_bfloat16*>(a.s);
  p.h = static_cast<__nv_bfloat16*>(a.h);
  p.o = static_cast<__nv_bfloat16*>(a.o);
  p.pool_src_route = a.pool_src_route;
  p.top_k = a.top_k;
  p.num_tokens = static_cast<int32_t>(a.num_tokens);
  p.clamp = a.clamp;
  if (a.clamp > 0.f) bf16_clamp_neighbours(a.clamp, &p.clamp_below, &p.clamp_above);
  p.check = d.check;

  // The L1 launch gathers its A rows from x itself, so x_pool is written only for the caller: by the dispatch
  // launch (a few warps per SM walk the pool rows, a grid-stride loop: any grid size is correct), unless o is
  // x_pool, whose rows the L2 launch overwrites in full anyway (the contract: the dispatched rows are then gone).
  if (a.x_pool != a.o) {
    const int64_t want = (a.m_total + kDispatchPoolThreads / 32 - 1) / (kDispatchPoolThreads / 32);
    const int dispatch_ctas = static_cast<int>(want < 4 * static_cast<int64_t>(sms) ? want : 4 * sms);
    mega_dispatch_pool_sm100_kernel<<<dispatch_ctas, kDispatchPoolThreads, 0, stream>>>(d);
    if (int r = check_launch(fn, err, err_len)) return r;
  }

  p.n_blocks = cfg.l1_n_blocks;
  p.k_blocks = static_cast<int32_t>(a.hidden / 64);
  if (int r = launch_gemm<&mega_moe_fwd_sm100_kernel<1, kMegaSm100Stages>>(fn, l1_ctas, sms, l1_maps, p, stream, err,
                                                                             err_len))
    return r;
  p.n_blocks = cfg.l2_n_blocks;
  p.k_blocks = static_cast<int32_t>(a.inter / 64);
  return launch_gemm<&mega_moe_fwd_sm100_kernel<2, kMegaSm100Stages>>(fn, l2_ctas, sms, l2_maps, p, stream, err,
                                                                        err_len);
}

}  // namespace sm100
}  // namespace prime_kernels
