// prime-kernels: the sm90a blockwise-FP8 grouped GEMMs' host interface: their arguments, their validation (plain
// host C++, no CUDA headers: tests/cpp/fp8_gemm_args_check.cpp compiles it with the host compiler alone) and the
// launchers (grouped_gemm_fp8.cu; same status codes and err conventions as grouped_gemm.hpp).
//
//   m-grouped: D[m, n] = bf16( sum over kb of (A[m, kb] . B_g[n, kb]) * sa[m, kb] * sb_g[n / 128, kb] )  for m in
//     group g, kb a 128-wide block of K;
//   k-grouped: C_e[m, n] (+)= sum over expert e's 128-row token blocks kb of (A_t[m, kb] . B_t[n, kb]) * sa[kb, m] *
//     sb[kb, n]  (the weight gradients; A_t, B_t stored token axis contiguous).
// The layouts are written out in m_grouped_gemm_fp8.cuh, k_grouped_gemm_fp8.cuh and docs/fp8_gemm.md.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gemm_heuristics.hpp"
#include "status.hpp"

typedef struct CUstream_st* cudaStream_t;

namespace prime_kernels {
namespace sm90 {

struct MGroupedFp8GemmArgs {
  // e4m3 [m_total, k], row stride lda (bytes = elements; >= k, % 16 == 0), 16-byte aligned
  const void* a = nullptr;
  int64_t lda = 0;
  // fp32 A scales, K-block major: the scale of row m and k-block kb at sa[kb * ld_sa + m]; ld_sa >= m_total,
  // % 4 == 0 (TMA row pitch), 16-byte aligned
  const float* sa = nullptr;
  int64_t ld_sa = 0;
  // e4m3 [num_groups, n, k], K contiguous: group g at b + g * b_group_stride, row stride ldb (>= k, % 16 == 0;
  // b_group_stride >= n * ldb, % 16 == 0 when num_groups > 1), 16-byte aligned
  const void* b = nullptr;
  int64_t ldb = 0;
  int64_t b_group_stride = 0;
  // fp32 B scales [num_groups, ceil(n / 128), ceil(k / 128)]: block (nb, kb) of group g at
  // sb[g * sb_group_stride + nb * sb_n_stride + kb]; sb_n_stride >= ceil(k / 128), sb_group_stride >= ceil(n / 128) *
  // sb_n_stride when num_groups > 1; 4-byte aligned
  const float* sb = nullptr;
  int64_t sb_group_stride = 0;
  int64_t sb_n_stride = 0;
  // bf16 [m_total, n], row stride ldd (>= n, % 8 == 0), 16-byte aligned; only rows inside a group are written
  void* d = nullptr;
  int64_t ldd = 0;
  // device int32 [num_groups + 1], the BF16 m-grouped GEMM's contract (grouped_gemm.hpp), checked on the device
  const int32_t* group_offsets = nullptr;
  int num_groups = 0;
  int64_t m_total = 0;
  // n a multiple of 8 (>= 8); k a multiple of 64 (>= 64): every k-block is one scale block of A (two with
  // a_scale_block 64) and of B; with k = 64 (mod 128) the last k-block has 64 columns, the TMA loads fill the other
  // 64 with zeros (the maps carry the true k), so its products add nothing
  int64_t n = 0;
  int64_t k = 0;
  // null = m_grouped_fp8_gemm_config(); else it must be that config (num_sms may differ)
  const GroupedGemmConfig* config = nullptr;
  // A's scale block along K: 128, or 64 (one scale per row per 64 of K, sa[kb64 * ld_sa + m]; the FP8 forward's L2
  // operand, quantized 1 x 64 by the L1 epilogue)
  int a_scale_block = 128;
};

// k-grouped: the weight gradients of the recipe's qT operands. Host-side arguments of k_grouped_fp8_gemm_tn:
struct KGroupedFp8GemmArgs {
  // e4m3 [m, p_total], token axis contiguous, row stride lda (bytes = elements; >= p_total, % 16 == 0), 16-byte aligned
  const void* a = nullptr;
  int64_t lda = 0;
  // fp32 A scales, one per column m and 128-row token block kb at sa[kb * ld_sa + m] (kb < ceil(p_total / 128));
  // ld_sa >= m, % 4 == 0 (TMA row pitch), 16-byte aligned
  const float* sa = nullptr;
  int64_t ld_sa = 0;
  // e4m3 [n, p_total] and its scales sb[kb * ld_sb + n], as a and sa
  const void* b = nullptr;
  int64_t ldb = 0;
  const float* sb = nullptr;
  int64_t ld_sb = 0;
  // [num_groups, m, n] contiguous, 16-byte aligned; c_is_bf16 = false: fp32 (store, or add into the existing values
  // when accumulate = true); c_is_bf16 = true: bf16 store (accumulate must be false). An empty group gives C_e = 0
  // (store) or leaves C_e unchanged (accumulate).
  void* c = nullptr;
  bool c_is_bf16 = false;
  bool accumulate = false;
  // device int32 [num_groups + 1], 0 <= group_offsets[0] <= ... <= last <= p_total, every entry a multiple of 128 or
  // p_total (experts start on whole token blocks); checked on the device: offsets that break it make the kernel
  // write nothing (a device-check finding). 1 <= num_groups <= 1024.
  const int32_t* group_offsets = nullptr;
  int num_groups = 0;
  int64_t p_total = 0;
  // multiples of 8, >= 8
  int64_t m = 0;
  int64_t n = 0;
  // null = k_grouped_fp8_gemm_config(); else it must be that config (num_sms may differ)
  const GroupedGemmConfig* config = nullptr;
};

// The FP8 L2 dgrad with the SwiGLU backward and a quantizing epilogue (swiglu_bwd_fp8.cuh; precision "fp8_bwd"):
// da = G(qK(dy_pool), W2^T) per group, never stored; with w = route_weights[pool_src_route[m]] writes qK(dh, 128)
// along 2I, qT(dh) and qT(w * s) (docs/fp8.md), and the d topk_weights partials. Host-side arguments of
// m_grouped_fp8_gemm_swiglu_bwd:
struct SwigluBwdFp8GemmArgs {
  // A: e4m3 [m_total, hidden] and its scales, as MGroupedFp8GemmArgs' a / lda / sa / ld_sa (dispatch_rows_fp8's output)
  const void* dy_q = nullptr;
  int64_t lda = 0;
  const float* dy_sa = nullptr;
  int64_t ld_sa = 0;
  // B: W2^T e4m3 [num_groups, intermediate, hidden] (K contiguous) and its 128 x 128 block scales
  // [num_groups, intermediate / 128, hidden / 128], as MGroupedFp8GemmArgs' b / sb (the weight cache's transposed copy)
  const void* w2t_q = nullptr;
  int64_t ldb = 0;
  int64_t b_group_stride = 0;
  const float* w2t_sb = nullptr;
  int64_t sb_group_stride = 0;
  int64_t sb_n_stride = 0;
  // bf16 [m_total, 2 * intermediate] (the forward's saved gate | up), row stride ldh (>= 2I, % 2 == 0), 4-byte aligned
  const void* h = nullptr;
  int64_t ldh = 0;
  // as SwigluBwdGemmArgs
  const int32_t* pool_src_route = nullptr;
  const float* route_weights = nullptr;
  int64_t num_routes = 0;
  // qK(dh): e4m3 [m_total, 2I] (row stride ld_dh_q bytes, >= 2I, % 16 == 0) and fp32 scales at
  // dh_sa[j * ld_dh_sa + m] (ld_dh_sa >= m_total, % 4 == 0): m_grouped_fp8_gemm_nt's A. dg and du are each quantized
  // 1 x 128 along I from their first column. I a multiple of 128: j < 2I / 128, the grid along 2I. I = 64 (mod 128):
  // the last block of each half is 64 wide and the scales are written per 64 columns, j < 2I / 64 (a block's scale
  // in both of its slots), so that the L1 dgrad reads them with a_scale_block 64 (W13^T's 128-column blocks along
  // 2I then meet dh's every 64 columns).
  void* dh_q = nullptr;
  int64_t ld_dh_q = 0;
  float* dh_sa = nullptr;
  int64_t ld_dh_sa = 0;
  // qT(dh): e4m3 [2I, m_total] (row stride ld_dht_q bytes, >= m_total, % 16 == 0) and fp32 scales at
  // dht_s[b * ld_dht_s + c], b < ceil(m_total / 128) (ld_dht_s >= 2I): k_grouped_fp8_gemm_tn's operand
  void* dht_q = nullptr;
  int64_t ld_dht_q = 0;
  float* dht_s = nullptr;
  int64_t ld_dht_s = 0;
  // qT(w * s): e4m3 [I, m_total] and scales, as qT(dh) with I columns
  void* awt_q = nullptr;
  int64_t ld_awt_q = 0;
  float* awt_s = nullptr;
  int64_t ld_awt_s = 0;
  // fp32 [m_total, dt_ld] (dt_ld >= ceil(I / 128)): d topk_weights partials, one per 128 columns of I
  float* dt_part = nullptr;
  int64_t dt_ld = 0;
  // device int32 [num_groups + 1]: non-decreasing within [0, m_total], each a multiple of 128 or m_total (the
  // routing plan's layout with block_m = 128); checked on the device
  const int32_t* group_offsets = nullptr;
  int num_groups = 0;
  int64_t m_total = 0;
  // intermediate and hidden multiples of 64 (>= 64); I = 64 (mod 128) runs the kernel's tail instantiation (its last
  // tile holds 64 columns of I) and takes dh_sa per 64 columns (above)
  int64_t intermediate = 0;
  int64_t hidden = 0;
  float clamp_limit = 0.f;  // >= 0 (0 = no clamp)
  bool pow2_scales = false;
  int num_sms = 0;  // caps the grid (0 = every multiprocessor)
};

// The FP8 L1 GEMM with the SwiGLU forward and the quantization of s (swiglu_fwd_fp8.cuh; precision "fp8", reference
// F1-F3, F6): h = G(qK(x_pool), W13) per group in fp32, never stored as such; writes qK(s, 64) along I with
// s = silu(gate) * up on the fp32 h (gate and up clamped first with clamp_limit > 0), and (when h is given) h rounded
// to bf16 (with a clamp, by the masked rule: the backward's masks on it are the forward's). Host-side arguments of
// m_grouped_fp8_gemm_swiglu:
struct SwigluFwdFp8GemmArgs {
  // A: e4m3 [m_total, hidden] and its scales, as MGroupedFp8GemmArgs' a / lda / sa / ld_sa (dispatch_rows_fp8's output)
  const void* x_q = nullptr;
  int64_t lda = 0;
  const float* x_sa = nullptr;
  int64_t ld_sa = 0;
  // B: W13 e4m3 [num_groups, 2 * intermediate, hidden] (gate rows, then up rows; K contiguous) and its 128 x 128
  // block scales [num_groups, 2 * intermediate / 128, hidden / 128], as MGroupedFp8GemmArgs' b / sb
  const void* w13_q = nullptr;
  int64_t ldb = 0;
  int64_t b_group_stride = 0;
  const float* w13_sb = nullptr;
  int64_t sb_group_stride = 0;
  int64_t sb_n_stride = 0;
  // qK(s, 64): e4m3 [m_total, I] (row stride ld_s_q bytes, >= I, % 16 == 0) and fp32 scales at s_sa[j * ld_s_sa + m],
  // j < I / 64 (ld_s_sa >= m_total, % 4 == 0, 16-byte aligned): the L2 GEMM's A operand
  void* s_q = nullptr;
  int64_t ld_s_q = 0;
  float* s_sa = nullptr;
  int64_t ld_s_sa = 0;
  // bf16 [m_total, 2 * intermediate] gate | up (row stride ldh, >= 2I, even), 4-byte aligned; null: not written
  void* h = nullptr;
  int64_t ldh = 0;
  // device int32 [num_groups + 1], the m-grouped GEMM's contract; checked on the device
  const int32_t* group_offsets = nullptr;
  int num_groups = 0;
  int64_t m_total = 0;
  // intermediate and hidden multiples of 64 (>= 64)
  int64_t intermediate = 0;
  int64_t hidden = 0;
  bool pow2_scales = false;
  int num_sms = 0;  // caps the grid (0 = every multiprocessor)
  float clamp_limit = 0.f;  // finite and >= 0 (0 = no clamp)
};

namespace host {

constexpr int kFp8MaxGroups = 1024;  // = kMaxGroups (kernel_common.cuh; checked where the kernel is compiled)
constexpr int64_t kFp8MaxDim = (int64_t(1) << 31) - 1;

inline bool fp8_aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

// Every check the launcher makes before it touches the device, in the order it makes them; kGemmOk or
// kGemmInvalidArgument with the reason in err. m_total == 0 passes once the sizes are checked (nothing to launch).
inline int check_m_grouped_fp8_args(const MGroupedFp8GemmArgs& x, char* err, size_t err_len) {
  const char* fn = "m_grouped_fp8_gemm_nt";
  if (x.num_groups < 1 || x.num_groups > kFp8MaxGroups)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_groups = %d, must be in [1, %d]", fn, x.num_groups,
                kFp8MaxGroups);
  if (x.m_total < 0 || x.m_total > kFp8MaxDim || x.n < 8 || x.n > kFp8MaxDim || x.k < 64 || x.k > kFp8MaxDim)
    return fail(kGemmInvalidArgument, err, err_len, "%s: bad sizes m_total=%lld n=%lld k=%lld (n >= 8, k >= 64)", fn,
                (long long)x.m_total, (long long)x.n, (long long)x.k);
  if (x.n % 8 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: n (%lld) must be a multiple of 8", fn, (long long)x.n);
  if (x.k % 64 != 0)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: k (%lld) must be a multiple of 64 (one scale block per 128 of K, the last one 64 wide when k is "
                "64 mod 128)",
                fn, (long long)x.k);
  if (x.ldd < x.n || x.ldd % 8 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: ldd = %lld, must be >= n and a multiple of 8", fn,
                (long long)x.ldd);
  if (x.a_scale_block != 128 && x.a_scale_block != 64)
    return fail(kGemmInvalidArgument, err, err_len, "%s: a_scale_block = %d, must be 128 or 64", fn, x.a_scale_block);
  if (x.config != nullptr && !m_grouped_fp8_gemm_config_supported(*x.config))
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: unsupported config block_m=%d block_n=%d block_k=%d stages=%d async_epilogue=%d (built: 128 x 128 "
                "x 128, 5 stages, asynchronous epilogue)",
                fn, x.config->block_m, x.config->block_n, x.config->block_k, x.config->num_stages,
                x.config->async_epilogue);
  if (x.m_total == 0) return kGemmOk;
  if (x.a == nullptr || x.sa == nullptr || x.b == nullptr || x.sb == nullptr || x.d == nullptr ||
      x.group_offsets == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: null a, sa, b, sb, d or group_offsets", fn);
  if (!fp8_aligned(x.a, 16) || !fp8_aligned(x.b, 16) || !fp8_aligned(x.d, 16) || !fp8_aligned(x.sa, 16))
    return fail(kGemmInvalidArgument, err, err_len, "%s: a, b, d and sa must be 16-byte aligned", fn);
  if (!fp8_aligned(x.sb, 4)) return fail(kGemmInvalidArgument, err, err_len, "%s: sb must be 4-byte aligned", fn);
  if (x.lda < x.k || x.lda % 16 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: lda = %lld, must be >= k and a multiple of 16", fn,
                (long long)x.lda);
  if (x.ldb < x.k || x.ldb % 16 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: ldb = %lld, must be >= k and a multiple of 16", fn,
                (long long)x.ldb);
  if (x.num_groups > 1 && (x.b_group_stride < x.n * x.ldb || x.b_group_stride % 16 != 0))
    return fail(kGemmInvalidArgument, err, err_len, "%s: b_group_stride = %lld, must be >= %lld and a multiple of 16",
                fn, (long long)x.b_group_stride, (long long)(x.n * x.ldb));
  const int64_t k_blocks = (x.k + 127) / 128, n_blocks = (x.n + 127) / 128;
  if (x.ld_sa < x.m_total || x.ld_sa % 4 != 0 || x.ld_sa > kFp8MaxDim)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: ld_sa = %lld (sa's stride between k-blocks), must be >= m_total (%lld) and a multiple of 4", fn,
                (long long)x.ld_sa, (long long)x.m_total);
  if (x.sb_n_stride < k_blocks)
    return fail(kGemmInvalidArgument, err, err_len, "%s: sb_n_stride = %lld, must be >= ceil(k / 128) = %lld", fn,
                (long long)x.sb_n_stride, (long long)k_blocks);
  if (x.num_groups > 1 && x.sb_group_stride < n_blocks * x.sb_n_stride)
    return fail(kGemmInvalidArgument, err, err_len, "%s: sb_group_stride = %lld, must be >= %lld", fn,
                (long long)x.sb_group_stride, (long long)(n_blocks * x.sb_n_stride));
  const int64_t max_tiles = ((x.m_total + 127) / 128 + x.num_groups) * n_blocks;
  if (max_tiles > kFp8MaxDim) return fail(kGemmInvalidArgument, err, err_len, "%s: too many tiles", fn);
  return kGemmOk;
}

// Every check the k-grouped launcher makes before it touches the device, in the order it makes them; kGemmOk or
// kGemmInvalidArgument with the reason in err. p_total == 0 passes once the sizes and c are checked (the launcher
// then zeroes c, or leaves it as it is when accumulating, and launches nothing).
inline int check_k_grouped_fp8_args(const KGroupedFp8GemmArgs& x, char* err, size_t err_len) {
  const char* fn = "k_grouped_fp8_gemm_tn";
  if (x.num_groups < 1 || x.num_groups > kFp8MaxGroups)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_groups = %d, must be in [1, %d]", fn, x.num_groups,
                kFp8MaxGroups);
  if (x.p_total < 0 || x.p_total > kFp8MaxDim || x.m < 8 || x.m > kFp8MaxDim || x.n < 8 || x.n > kFp8MaxDim)
    return fail(kGemmInvalidArgument, err, err_len, "%s: bad sizes p_total=%lld m=%lld n=%lld (m, n >= 8)", fn,
                (long long)x.p_total, (long long)x.m, (long long)x.n);
  if (x.m % 8 != 0 || x.n % 8 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: m (%lld) and n (%lld) must be multiples of 8", fn,
                (long long)x.m, (long long)x.n);
  if ((int64_t)x.num_groups * x.m * x.n > (int64_t(1) << 40))
    return fail(kGemmInvalidArgument, err, err_len, "%s: output too large", fn);
  if (x.c_is_bf16 && x.accumulate)
    return fail(kGemmInvalidArgument, err, err_len, "%s: accumulate needs an fp32 output", fn);
  if (x.c == nullptr || !fp8_aligned(x.c, 16))
    return fail(kGemmInvalidArgument, err, err_len, "%s: c must be non-null and 16-byte aligned", fn);
  if (x.config != nullptr && !k_grouped_fp8_gemm_config_supported(*x.config, x.c_is_bf16))
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: unsupported config block_m=%d block_n=%d block_k=%d stages=%d async_epilogue=%d (built: 128 x 128 "
                "x 128, 5 stages for a bf16 output and 4 for fp32, TMA-store epilogue)",
                fn, x.config->block_m, x.config->block_n, x.config->block_k, x.config->num_stages,
                x.config->async_epilogue);
  if (x.p_total == 0) return kGemmOk;
  if (x.a == nullptr || x.sa == nullptr || x.b == nullptr || x.sb == nullptr || x.group_offsets == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: null a, sa, b, sb or group_offsets", fn);
  if (!fp8_aligned(x.a, 16) || !fp8_aligned(x.b, 16) || !fp8_aligned(x.sa, 16) || !fp8_aligned(x.sb, 16))
    return fail(kGemmInvalidArgument, err, err_len, "%s: a, b, sa and sb must be 16-byte aligned", fn);
  if (x.lda < x.p_total || x.lda % 16 != 0)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: lda = %lld, must be >= p_total (%lld, the token axis is contiguous) and a multiple of 16", fn,
                (long long)x.lda, (long long)x.p_total);
  if (x.ldb < x.p_total || x.ldb % 16 != 0)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: ldb = %lld, must be >= p_total (%lld, the token axis is contiguous) and a multiple of 16", fn,
                (long long)x.ldb, (long long)x.p_total);
  if (x.ld_sa < x.m || x.ld_sa % 4 != 0 || x.ld_sa > kFp8MaxDim)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: ld_sa = %lld (sa's stride between token blocks), must be >= m (%lld) and a multiple of 4", fn,
                (long long)x.ld_sa, (long long)x.m);
  if (x.ld_sb < x.n || x.ld_sb % 4 != 0 || x.ld_sb > kFp8MaxDim)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: ld_sb = %lld (sb's stride between token blocks), must be >= n (%lld) and a multiple of 4", fn,
                (long long)x.ld_sb, (long long)x.n);
  const int64_t tiles = (int64_t)x.num_groups * ((x.m + 127) / 128) * ((x.n + 127) / 128);
  if (tiles > kFp8MaxDim) return fail(kGemmInvalidArgument, err, err_len, "%s: too many tiles", fn);
  return kGemmOk;
}

// Every check the FP8 L2-dgrad launcher makes before it touches the device, in the order it makes them; kGemmOk or
// kGemmInvalidArgument with the reason in err. m_total == 0 passes once the sizes are checked (nothing to launch).
inline int check_swiglu_bwd_fp8_args(const SwigluBwdFp8GemmArgs& x, char* err, size_t err_len) {
  const char* fn = "m_grouped_fp8_gemm_swiglu_bwd";
  const int64_t I = x.intermediate, H = x.hidden, m = x.m_total;
  if (x.num_groups < 1 || x.num_groups > kFp8MaxGroups)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_groups = %d, must be in [1, %d]", fn, x.num_groups,
                kFp8MaxGroups);
  if (m < 0 || m > kFp8MaxDim || I < 64 || 2 * I > kFp8MaxDim || H < 64 || H > kFp8MaxDim)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: bad sizes m_total=%lld intermediate=%lld hidden=%lld (intermediate, hidden >= 64)", fn,
                (long long)m, (long long)I, (long long)H);
  if (I % 64 != 0 || H % 64 != 0)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: intermediate (%lld) and hidden (%lld) must be multiples of 64 (one scale block per 128 columns "
                "of dg and of du, one k-block per 128 of H; the last of each 64 wide when the size is 64 mod 128)",
                fn, (long long)I, (long long)H);
  if (!(x.clamp_limit >= 0.f))
    return fail(kGemmInvalidArgument, err, err_len, "%s: clamp_limit must be >= 0 (0 = no clamp)", fn);
  if (x.num_routes < 0 || x.num_routes > kFp8MaxDim)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_routes = %lld, must be in [0, 2^31)", fn,
                (long long)x.num_routes);
  if (x.num_sms < 0) return fail(kGemmInvalidArgument, err, err_len, "%s: num_sms = %d, must be >= 0", fn, x.num_sms);
  if (m == 0) return kGemmOk;
  if (x.dy_q == nullptr || x.dy_sa == nullptr || x.w2t_q == nullptr || x.w2t_sb == nullptr || x.h == nullptr ||
      x.pool_src_route == nullptr || (x.route_weights == nullptr && x.num_routes > 0) || x.dh_q == nullptr ||
      x.dh_sa == nullptr || x.dht_q == nullptr || x.dht_s == nullptr || x.awt_q == nullptr || x.awt_s == nullptr ||
      x.dt_part == nullptr || x.group_offsets == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: a pointer is null", fn);
  if (!fp8_aligned(x.dy_q, 16) || !fp8_aligned(x.dy_sa, 16) || !fp8_aligned(x.w2t_q, 16) || !fp8_aligned(x.dh_q, 16) ||
      !fp8_aligned(x.dht_q, 16) || !fp8_aligned(x.awt_q, 16))
    return fail(kGemmInvalidArgument, err, err_len, "%s: dy_q, dy_sa, w2t_q, dh_q, dht_q and awt_q must be 16-byte aligned",
                fn);
  if (!fp8_aligned(x.h, 4) || !fp8_aligned(x.w2t_sb, 4) || !fp8_aligned(x.dh_sa, 4) || !fp8_aligned(x.dht_s, 4) ||
      !fp8_aligned(x.awt_s, 4) || !fp8_aligned(x.dt_part, 4))
    return fail(kGemmInvalidArgument, err, err_len, "%s: h, the scales and dt_part must be 4-byte aligned", fn);
  if (x.lda < H || x.lda % 16 != 0 || x.ldb < H || x.ldb % 16 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: lda = %lld, ldb = %lld: must be >= hidden and multiples of 16",
                fn, (long long)x.lda, (long long)x.ldb);
  if (x.num_groups > 1 && (x.b_group_stride < I * x.ldb || x.b_group_stride % 16 != 0))
    return fail(kGemmInvalidArgument, err, err_len, "%s: b_group_stride = %lld, must be >= %lld and a multiple of 16",
                fn, (long long)x.b_group_stride, (long long)(I * x.ldb));
  const int64_t k_blocks = (H + 127) / 128, n_blocks = (I + 127) / 128, t_blocks = (m + 127) / 128;
  if (x.ld_sa < m || x.ld_sa % 4 != 0 || x.ld_sa > kFp8MaxDim)
    return fail(kGemmInvalidArgument, err, err_len, "%s: ld_sa = %lld, must be >= m_total (%lld) and a multiple of 4",
                fn, (long long)x.ld_sa, (long long)m);
  if (x.sb_n_stride < k_blocks || (x.num_groups > 1 && x.sb_group_stride < n_blocks * x.sb_n_stride))
    return fail(kGemmInvalidArgument, err, err_len, "%s: sb strides (%lld, %lld) do not cover [E, %lld, %lld]", fn,
                (long long)x.sb_group_stride, (long long)x.sb_n_stride, (long long)n_blocks, (long long)k_blocks);
  if (x.ldh < 2 * I || x.ldh % 2 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: ldh = %lld, must be >= 2 * intermediate and even", fn,
                (long long)x.ldh);
  if (x.ld_dh_q < 2 * I || x.ld_dh_q % 16 != 0 || x.ld_dh_sa < m || x.ld_dh_sa % 4 != 0)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: ld_dh_q = %lld (>= 2 * intermediate, a multiple of 16), ld_dh_sa = %lld (>= m_total, a multiple "
                "of 4)",
                fn, (long long)x.ld_dh_q, (long long)x.ld_dh_sa);
  if (x.ld_dht_q < m || x.ld_dht_q % 16 != 0 || x.ld_awt_q < m || x.ld_awt_q % 16 != 0)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: ld_dht_q = %lld, ld_awt_q = %lld: must be >= m_total (the token axis is contiguous) and multiples "
                "of 16",
                fn, (long long)x.ld_dht_q, (long long)x.ld_awt_q);
  if (x.ld_dht_s < 2 * I || x.ld_awt_s < I || x.dt_ld < n_blocks || x.dt_ld > kFp8MaxDim)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: ld_dht_s = %lld (>= 2 * intermediate), ld_awt_s = %lld (>= intermediate), dt_ld = %lld (>= %lld)",
                fn, (long long)x.ld_dht_s, (long long)x.ld_awt_s, (long long)x.dt_ld, (long long)n_blocks);
  if ((t_blocks + x.num_groups) * n_blocks > kFp8MaxDim)
    return fail(kGemmInvalidArgument, err, err_len, "%s: too many tiles", fn);
  return kGemmOk;
}

// Every check the FP8 L1 launcher makes before it touches the device, in the order it makes them; kGemmOk or
// kGemmInvalidArgument with the reason in err. m_total == 0 passes once the sizes are checked (nothing to launch).
inline int check_swiglu_fwd_fp8_args(const SwigluFwdFp8GemmArgs& x, char* err, size_t err_len) {
  const char* fn = "m_grouped_fp8_gemm_swiglu";
  const int64_t I = x.intermediate, H = x.hidden, m = x.m_total;
  if (x.num_groups < 1 || x.num_groups > kFp8MaxGroups)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_groups = %d, must be in [1, %d]", fn, x.num_groups,
                kFp8MaxGroups);
  if (m < 0 || m > kFp8MaxDim || I < 64 || 2 * I > kFp8MaxDim || H < 64 || H > kFp8MaxDim)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: bad sizes m_total=%lld intermediate=%lld hidden=%lld (intermediate, hidden >= 64)", fn,
                (long long)m, (long long)I, (long long)H);
  if (I % 64 != 0 || H % 64 != 0)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: intermediate (%lld) and hidden (%lld) must be multiples of 64 (a tile's 64 gate and 64 up rows of "
                "W13 each lie in one 128 x 128 scale block; one k-block per 128 of H, the last one 64 wide when H is "
                "64 mod 128)",
                fn, (long long)I, (long long)H);
  if (x.num_sms < 0) return fail(kGemmInvalidArgument, err, err_len, "%s: num_sms = %d, must be >= 0", fn, x.num_sms);
  if (!(x.clamp_limit >= 0.f && x.clamp_limit <= 3.4e38f))
    return fail(kGemmInvalidArgument, err, err_len, "%s: clamp_limit = %g, must be finite and >= 0 (0 = no clamp)", fn,
                (double)x.clamp_limit);
  if (m == 0) return kGemmOk;
  if (x.x_q == nullptr || x.x_sa == nullptr || x.w13_q == nullptr || x.w13_sb == nullptr || x.s_q == nullptr ||
      x.s_sa == nullptr || x.group_offsets == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: null x_q, x_sa, w13_q, w13_sb, s_q, s_sa or group_offsets",
                fn);
  if (!fp8_aligned(x.x_q, 16) || !fp8_aligned(x.x_sa, 16) || !fp8_aligned(x.w13_q, 16) || !fp8_aligned(x.s_q, 16) ||
      !fp8_aligned(x.s_sa, 16))
    return fail(kGemmInvalidArgument, err, err_len, "%s: x_q, x_sa, w13_q, s_q and s_sa must be 16-byte aligned", fn);
  if (!fp8_aligned(x.w13_sb, 4) || (x.h != nullptr && !fp8_aligned(x.h, 4)))
    return fail(kGemmInvalidArgument, err, err_len, "%s: w13_sb and h must be 4-byte aligned", fn);
  if (x.lda < H || x.lda % 16 != 0 || x.ldb < H || x.ldb % 16 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: lda = %lld, ldb = %lld: must be >= hidden and multiples of 16",
                fn, (long long)x.lda, (long long)x.ldb);
  if (x.num_groups > 1 && (x.b_group_stride < 2 * I * x.ldb || x.b_group_stride % 16 != 0))
    return fail(kGemmInvalidArgument, err, err_len, "%s: b_group_stride = %lld, must be >= %lld and a multiple of 16",
                fn, (long long)x.b_group_stride, (long long)(2 * I * x.ldb));
  const int64_t k_blocks = (H + 127) / 128, n_blocks = 2 * I / 128, t_blocks = (m + 127) / 128;
  if (x.ld_sa < m || x.ld_sa % 4 != 0 || x.ld_sa > kFp8MaxDim)
    return fail(kGemmInvalidArgument, err, err_len, "%s: ld_sa = %lld, must be >= m_total (%lld) and a multiple of 4",
                fn, (long long)x.ld_sa, (long long)m);
  if (x.sb_n_stride < k_blocks || (x.num_groups > 1 && x.sb_group_stride < n_blocks * x.sb_n_stride))
    return fail(kGemmInvalidArgument, err, err_len, "%s: sb strides (%lld, %lld) do not cover [E, %lld, %lld]", fn,
                (long long)x.sb_group_stride, (long long)x.sb_n_stride, (long long)n_blocks, (long long)k_blocks);
  if (x.ld_s_q < I || x.ld_s_q % 16 != 0 || x.ld_s_sa < m || x.ld_s_sa % 4 != 0 || x.ld_s_sa > kFp8MaxDim)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: ld_s_q = %lld (>= intermediate, a multiple of 16), ld_s_sa = %lld (>= m_total, a multiple of 4)",
                fn, (long long)x.ld_s_q, (long long)x.ld_s_sa);
  if (x.h != nullptr && (x.ldh < 2 * I || x.ldh % 2 != 0))
    return fail(kGemmInvalidArgument, err, err_len, "%s: ldh = %lld, must be >= 2 * intermediate and even", fn,
                (long long)x.ldh);
  if ((t_blocks + x.num_groups) * (I / 64) > kFp8MaxDim)
    return fail(kGemmInvalidArgument, err, err_len, "%s: too many tiles", fn);
  return kGemmOk;
}

}  // namespace host

// Validates (check_m_grouped_fp8_args), returns without a launch when m_total == 0, else launches on stream.
int m_grouped_fp8_gemm_nt(const MGroupedFp8GemmArgs& args, cudaStream_t stream, char* err, size_t err_len);
// Validates (check_k_grouped_fp8_args); p_total == 0 zeroes c (or leaves it, accumulating) on stream; else launches.
int k_grouped_fp8_gemm_tn(const KGroupedFp8GemmArgs& args, cudaStream_t stream, char* err, size_t err_len);
// Validates (check_swiglu_bwd_fp8_args), returns without a launch when m_total == 0, else launches on stream.
int m_grouped_fp8_gemm_swiglu_bwd(const SwigluBwdFp8GemmArgs& args, cudaStream_t stream, char* err, size_t err_len);
// Validates (check_swiglu_fwd_fp8_args), returns without a launch when m_total == 0, else launches on stream.
int m_grouped_fp8_gemm_swiglu(const SwigluFwdFp8GemmArgs& args, cudaStream_t stream, char* err, size_t err_len);

}  // namespace sm90
}  // namespace prime_kernels
