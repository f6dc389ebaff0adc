// prime-kernels: host side of the sm90a blockwise-FP8 grouped GEMMs (argument checks, config, TMA maps, launch).
#include "grouped_gemm_fp8.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "fp8_maps.hpp"
#include "host_utils.hpp"
#include "m_blocks.hpp"
#include "k_grouped_gemm_fp8.cuh"
#include "m_grouped_gemm_fp8.cuh"
#include "swiglu_bwd_fp8.cuh"
#include "swiglu_fwd_fp8.cuh"

namespace prime_kernels {
namespace sm90 {
using namespace host;

static_assert(kFp8MaxGroups == kMaxGroups, "the argument check's group bound is the kernel's shared-memory bound");

int make_m_grouped_fp8_operand_maps(CUtensorMap* ma, CUtensorMap* mb, CUtensorMap* msa, const void* a, int64_t lda,
                                    const float* sa, int64_t ld_sa, const void* b, int64_t ldb,
                                    int64_t b_group_stride, int num_groups, int64_t m_total, int64_t n, int64_t k,
                                    char* err, size_t err_len, uint32_t b_box_rows, int64_t a_scale_block) {
  {
    const uint64_t dims[2] = {(uint64_t)k, (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)lda};
    const uint32_t box[2] = {128, 128};
    if (int r = make_map(ma, a, 2, dims, strides, box, err, err_len, CU_TENSOR_MAP_DATA_TYPE_UINT8)) return r;
  }
  {
    const int64_t gs = num_groups > 1 ? b_group_stride : n * ldb;
    const uint64_t dims[3] = {(uint64_t)k, (uint64_t)n, (uint64_t)num_groups};
    const uint64_t strides[2] = {(uint64_t)ldb, (uint64_t)gs};
    const uint32_t box[3] = {128, b_box_rows, 1};
    if (int r = make_map(mb, b, 3, dims, strides, box, err, err_len, CU_TENSOR_MAP_DATA_TYPE_UINT8)) return r;
  }
  // ceil: with k = 64 (mod 128) the last 128-wide k-block has one 64-wide scale block (a_scale_block 128: its 64
  // columns; 64: its second box falls past the map and loads zero, beside zero values)
  const uint64_t dims[2] = {(uint64_t)m_total, (uint64_t)((k + a_scale_block - 1) / a_scale_block)};
  const uint64_t strides[1] = {(uint64_t)ld_sa * 4};
  const uint32_t box[2] = {(uint32_t)MGroupedFp8Layout<128, 1>::kSaBoxRows, 1};
  return make_map(msa, sa, 2, dims, strides, box, err, err_len, CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
                  CU_TENSOR_MAP_SWIZZLE_NONE);
}

int m_grouped_fp8_gemm_nt(const MGroupedFp8GemmArgs& args, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "m_grouped_fp8_gemm_nt";
  if (int r = check_m_grouped_fp8_args(args, err, err_len)) return r;
  if (args.m_total == 0) return kGemmOk;
  const GroupedGemmConfig cfg =
      args.config ? *args.config : m_grouped_fp8_gemm_config(args.m_total, args.n, args.k, args.num_groups);
  int sms = 0;
  if (int r = device_sms(&sms, err, err_len)) return r;
  if (cfg.num_sms > 0 && cfg.num_sms < sms) sms = cfg.num_sms;

  constexpr int kBlockN = 128, kStages = 5;
  const int64_t m_total = args.m_total, n = args.n, k = args.k;
  CUtensorMap ma, mb, msa, md;
  if (int r = make_m_grouped_fp8_operand_maps(&ma, &mb, &msa, args.a, args.lda, args.sa, args.ld_sa, args.b, args.ldb,
                                              args.b_group_stride, args.num_groups, m_total, n, k, err, err_len, 128,
                                              args.a_scale_block))
    return r;
  {  // D: the BF16 kernel's output map (64 x 64 boxes, clipped at [m_total, n])
    const uint64_t dims[2] = {(uint64_t)n, (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)args.ldd * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&md, args.d, 2, dims, strides, box, err, err_len)) return r;
  }
  MGroupedFp8Params p{};
  p.l2_hints = kGemmL2Hints;
  p.check = common::device_check_record();
  p.d = reinterpret_cast<__nv_bfloat16*>(args.d);
  p.ldd = args.ldd;
  p.sb = args.sb;
  p.sb_group_stride = args.num_groups > 1 ? args.sb_group_stride : 0;
  p.sb_n_stride = args.sb_n_stride;
  p.group_offsets = args.group_offsets;
  p.m_total = (int32_t)m_total;
  p.n = (int32_t)n;
  p.k = (int32_t)k;
  p.num_groups = args.num_groups;
  const int64_t max_units = max_m_blocks(m_total, args.num_groups) * ((n + kBlockN - 1) / kBlockN);

  auto launch = [&](auto scale_blocks) -> int {
    constexpr int kAScaleBlocks = decltype(scale_blocks)::value;
    return launch_persistent_checked<&m_grouped_fp8_gemm_kernel<kBlockN, kStages, kAScaleBlocks>>(
        fn, kNumThreads, MGroupedFp8Layout<kBlockN, kStages, kAScaleBlocks>::kSmemBytes, max_units, sms, stream, err,
        err_len, ma, mb, msa, md, p);
  };
  // A quantized 1 x 64 (the FP8 forward's L2 operand): two scale blocks per 128-wide k-block
  if (args.a_scale_block == 64) return launch(std::integral_constant<int, 2>{});
  return launch(std::integral_constant<int, 1>{});
}

namespace {

// An e4m3 operand stored token axis contiguous ([rows, p_total], row stride ld bytes): 128 rows x 128 bytes of the
// token axis per box, 128-byte swizzle (the layout K-major wgmma reads); token columns past p_total load as zeros.
int make_token_major_map(CUtensorMap* map, const void* base, int64_t rows, int64_t p_total, int64_t ld, char* err,
                         size_t err_len) {
  const uint64_t dims[2] = {(uint64_t)p_total, (uint64_t)rows};
  const uint64_t strides[1] = {(uint64_t)ld};
  const uint32_t box[2] = {128, 128};
  return make_map(map, base, 2, dims, strides, box, err, err_len, CU_TENSOR_MAP_DATA_TYPE_UINT8);
}

// Its scales, one row of `cols` fp32 per 128-row token block (row stride ld floats): 128 of them per box, no swizzle.
int make_token_block_scale_map(CUtensorMap* map, const float* base, int64_t cols, int64_t p_total, int64_t ld,
                               char* err, size_t err_len) {
  const uint64_t dims[2] = {(uint64_t)cols, (uint64_t)((p_total + 127) / 128)};
  const uint64_t strides[1] = {(uint64_t)ld * 4};
  const uint32_t box[2] = {128, 1};
  return make_map(map, base, 2, dims, strides, box, err, err_len, CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
                  CU_TENSOR_MAP_SWIZZLE_NONE);
}

// The output C [E, M, N] (bf16 or fp32) as the epilogue's TMA stores write it: [E][M][N] in boxes of 64 rows and 128
// bytes of columns, 128-byte swizzle (epilogue.cuh's staging layout). m, n are multiples of 8 and c is 16-byte
// aligned (check_k_grouped_fp8_args), as the map's strides need.
int make_k_grouped_out_map(CUtensorMap* map, void* c, bool c_is_bf16, int64_t num_groups, int64_t m, int64_t n,
                           char* err, size_t err_len) {
  const uint64_t esize = c_is_bf16 ? 2 : 4;
  const uint64_t dims[3] = {(uint64_t)n, (uint64_t)m, (uint64_t)num_groups};
  const uint64_t strides[2] = {(uint64_t)n * esize, (uint64_t)(m * n) * esize};
  const uint32_t box[3] = {(uint32_t)(128 / esize), 64, 1};
  return make_map(map, c, 3, dims, strides, box, err, err_len,
                  c_is_bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32);
}

template <int kOut>
int launch_k_grouped_fp8(const CUtensorMap& ma, const CUtensorMap& mb, const CUtensorMap& msa, const CUtensorMap& msb,
                         const CUtensorMap& mc, const KGroupedFp8Params& p, int grid, cudaStream_t stream, char* err,
                         size_t err_len) {
  const char* fn = "k_grouped_fp8_gemm_tn";
  constexpr int kStages = k_grouped_fp8_stages(kOut);
  constexpr auto kernel = &k_grouped_fp8_gemm_kernel<kStages, kOut>;
  constexpr int smem = KGroupedFp8Layout<kStages, kOut>::kSmemBytes;
  cudaError_t e = set_max_dynamic_smem<kernel>(smem);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: cudaFuncSetAttribute: %s", fn, cudaGetErrorString(e));
  kernel<<<grid, kNumThreads, smem, stream>>>(ma, mb, msa, msb, mc, p);
  return check_launch(fn, err, err_len);
}

}  // namespace

int k_grouped_fp8_gemm_tn(const KGroupedFp8GemmArgs& args, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "k_grouped_fp8_gemm_tn";
  if (int r = check_k_grouped_fp8_args(args, err, err_len)) return r;
  const int64_t p_total = args.p_total, m = args.m, n = args.n;
  if (p_total == 0) {  // no token rows: every expert is empty (the BF16 k-grouped GEMM's rule)
    if (args.accumulate) return kGemmOk;
    const size_t c_bytes = (size_t)args.num_groups * m * n * (args.c_is_bf16 ? 2 : 4);
    const cudaError_t e = cudaMemsetAsync(args.c, 0, c_bytes, stream);
    if (e != cudaSuccess)
      return fail(kGemmCudaError, err, err_len, "%s: cudaMemsetAsync: %s", fn, cudaGetErrorString(e));
    return kGemmOk;
  }
  const GroupedGemmConfig cfg =
      args.config ? *args.config : k_grouped_fp8_gemm_config(m, n, p_total, args.num_groups, args.c_is_bf16);
  int sms = 0;
  if (int r = device_sms(&sms, err, err_len)) return r;
  if (cfg.num_sms > 0 && cfg.num_sms < sms) sms = cfg.num_sms;

  CUtensorMap ma, mb, msa, msb;
  if (int r = make_token_major_map(&ma, args.a, m, p_total, args.lda, err, err_len)) return r;
  if (int r = make_token_major_map(&mb, args.b, n, p_total, args.ldb, err, err_len)) return r;
  if (int r = make_token_block_scale_map(&msa, args.sa, m, p_total, args.ld_sa, err, err_len)) return r;
  if (int r = make_token_block_scale_map(&msb, args.sb, n, p_total, args.ld_sb, err, err_len)) return r;
  CUtensorMap mc;
  if (int r = make_k_grouped_out_map(&mc, args.c, args.c_is_bf16, args.num_groups, m, n, err, err_len)) return r;
  KGroupedFp8Params p{};
  p.group_offsets = args.group_offsets;
  p.p_total = (int32_t)p_total;
  p.m = (int32_t)m;
  p.n = (int32_t)n;
  p.num_groups = args.num_groups;
  p.m_blocks = (int32_t)((m + 127) / 128);
  p.tiles_per_group = p.m_blocks * (int32_t)((n + 127) / 128);
  p.num_tiles = p.tiles_per_group * args.num_groups;
  p.l2_hints = kKGroupedL2Hints;
  p.check = common::device_check_record();
  const int grid = p.num_tiles < sms ? p.num_tiles : sms;
  if (args.c_is_bf16) return launch_k_grouped_fp8<kOutBf16Store>(ma, mb, msa, msb, mc, p, grid, stream, err, err_len);
  if (args.accumulate)
    return launch_k_grouped_fp8<kOutF32Accumulate>(ma, mb, msa, msb, mc, p, grid, stream, err, err_len);
  return launch_k_grouped_fp8<kOutF32Store>(ma, mb, msa, msb, mc, p, grid, stream, err, err_len);
}

int m_grouped_fp8_gemm_swiglu_bwd(const SwigluBwdFp8GemmArgs& args, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "m_grouped_fp8_gemm_swiglu_bwd";
  if (int r = check_swiglu_bwd_fp8_args(args, err, err_len)) return r;
  if (args.m_total == 0) return kGemmOk;
  int sms = 0;
  if (int r = device_sms(&sms, err, err_len)) return r;
  if (args.num_sms > 0 && args.num_sms < sms) sms = args.num_sms;
  const int64_t m_total = args.m_total, I = args.intermediate, H = args.hidden;
  CUtensorMap ma, mb, msa;
  if (int r = make_m_grouped_fp8_operand_maps(&ma, &mb, &msa, args.dy_q, args.lda, args.dy_sa, args.ld_sa, args.w2t_q,
                                              args.ldb, args.b_group_stride, args.num_groups, m_total, I, H, err,
                                              err_len))
    return r;
  SwigluBwdFp8Params p{};
  p.l2_hints = kGemmL2Hints;
  p.check = common::device_check_record();
  p.sb = args.w2t_sb;
  p.sb_group_stride = args.num_groups > 1 ? args.sb_group_stride : 0;
  p.sb_n_stride = args.sb_n_stride;
  p.group_offsets = args.group_offsets;
  p.m_total = (int32_t)m_total;
  p.n = (int32_t)I;
  p.k = (int32_t)H;
  p.num_groups = args.num_groups;
  p.h = reinterpret_cast<const __nv_bfloat16*>(args.h);
  p.ldh = args.ldh;
  p.pool_src_route = args.pool_src_route;
  p.route_weights = args.route_weights;
  p.num_routes = (int32_t)args.num_routes;
  p.clamp = args.clamp_limit;
  p.pow2_scales = args.pow2_scales;
  p.dh_q = reinterpret_cast<uint8_t*>(args.dh_q);
  p.ld_dh_q = args.ld_dh_q;
  p.dh_sa = args.dh_sa;
  p.ld_dh_sa = args.ld_dh_sa;
  p.dht_q = reinterpret_cast<uint8_t*>(args.dht_q);
  p.ld_dht_q = args.ld_dht_q;
  p.dht_s = args.dht_s;
  p.ld_dht_s = args.ld_dht_s;
  p.awt_q = reinterpret_cast<uint8_t*>(args.awt_q);
  p.ld_awt_q = args.ld_awt_q;
  p.awt_s = args.awt_s;
  p.ld_awt_s = args.ld_awt_s;
  p.dt_part = args.dt_part;
  p.dt_ld = (int32_t)args.dt_ld;
  const int64_t max_units = max_m_blocks(m_total, args.num_groups) * ((I + 127) / 128);

  constexpr int kStages = 3;
  // I = 64 (mod 128): the instantiation whose last tile holds 64 columns of I (dh_sa per 64 columns)
  if (I % 128 != 0)
    return launch_persistent_checked<&m_grouped_fp8_swiglu_bwd_tail_kernel<kStages>>(
        fn, kNumThreads, SwigluBwdFp8Layout<kStages>::kSmemBytes, max_units, sms, stream, err, err_len, ma, mb, msa,
        p);
  return launch_persistent_checked<&m_grouped_fp8_swiglu_bwd_kernel<kStages>>(
      fn, kNumThreads, SwigluBwdFp8Layout<kStages>::kSmemBytes, max_units, sms, stream, err, err_len, ma, mb, msa, p);
}

int m_grouped_fp8_gemm_swiglu(const SwigluFwdFp8GemmArgs& args, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "m_grouped_fp8_gemm_swiglu";
  if (int r = check_swiglu_fwd_fp8_args(args, err, err_len)) return r;
  if (args.m_total == 0) return kGemmOk;
  int sms = 0;
  if (int r = device_sms(&sms, err, err_len)) return r;
  if (args.num_sms > 0 && args.num_sms < sms) sms = args.num_sms;
  const int64_t m_total = args.m_total, I = args.intermediate, H = args.hidden;
  CUtensorMap ma, mb, msa;
  // B in boxes of 64 rows: a tile's gate rows c and up rows I + c (m_grouped_fp8_produce's gate | up mode)
  if (int r = make_m_grouped_fp8_operand_maps(&ma, &mb, &msa, args.x_q, args.lda, args.x_sa, args.ld_sa, args.w13_q,
                                              args.ldb, args.b_group_stride, args.num_groups, m_total, 2 * I, H, err,
                                              err_len, kSwigluFwdFp8Block))
    return r;
  SwigluFwdFp8Params p{};
  p.l2_hints = kGemmL2Hints;
  p.check = common::device_check_record();
  p.sb = args.w13_sb;
  p.sb_group_stride = args.num_groups > 1 ? args.sb_group_stride : 0;
  p.sb_n_stride = args.sb_n_stride;
  p.group_offsets = args.group_offsets;
  p.m_total = (int32_t)m_total;
  p.n = (int32_t)I;
  p.k = (int32_t)H;
  p.num_groups = args.num_groups;
  p.pow2_scales = args.pow2_scales;
  p.h = reinterpret_cast<__nv_bfloat16*>(args.h);
  p.ldh = args.ldh;
  p.s_q = reinterpret_cast<uint8_t*>(args.s_q);
  p.ld_s_q = args.ld_s_q;
  p.s_sa = args.s_sa;
  p.ld_s_sa = args.ld_s_sa;
  const int64_t max_units = max_m_blocks(m_total, args.num_groups) * (I / kSwigluFwdFp8Block);

  // the FP8 GEMM's ring (m_grouped_fp8_gemm_nt's 5 stages, measured there)
  constexpr int kStages = 5;
  constexpr int kSmem = MGroupedFp8Layout<128, kStages>::kSmemBytes;
  if (args.clamp_limit > 0.f) {
    SwigluFwdFp8ClampParams pc{};
    static_cast<SwigluFwdFp8Params&>(pc) = p;
    pc.clamp = args.clamp_limit;
    bf16_clamp_neighbours(args.clamp_limit, &pc.clamp_below, &pc.clamp_above);
    return launch_persistent_checked<&m_grouped_fp8_swiglu_kernel<kStages, true>>(
        fn, kNumThreads, kSmem, max_units, sms, stream, err, err_len, ma, mb, msa, pc);
  }
  return launch_persistent_checked<&m_grouped_fp8_swiglu_kernel<kStages, false>>(
      fn, kNumThreads, kSmem, max_units, sms, stream, err, err_len, ma, mb, msa, p);
}

}  // namespace sm90
}  // namespace prime_kernels
