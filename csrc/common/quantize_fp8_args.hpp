// prime-kernels: the arguments of the quantizing producers of the blockwise-FP8 recipe and their validation
// (plain host C++, no CUDA headers: tests/cpp/quantize_fp8_args_check.cpp compiles it with the host compiler alone).
//
//   dispatch_rows_fp8: the dispatch of token rows into the pool with qK(., 128): q[p] = e4m3 of src[t] in 1 x 128
//     blocks along H for every route p = route_to_pool[t, k], the scales K-block major, the layout
//     m_grouped_fp8_gemm_nt reads its A operand in (recipe steps F1 and B1's qK(dy_p, 128)).
//   quantize_tokens_fp8: qT of pool rows for the weight-gradient GEMMs: v [rows, cols] -> e4m3 [cols, rows] (token
//     axis contiguous) with one scale per column and 128-row block of each expert, the layout k_grouped_fp8_gemm_tn
//     reads (recipe steps B1's qT(dy_e) and B10's x rows).
// Both round as python/prime_kernels/mega/fp8.py does (csrc/common/fp8_quant_math.cuh).
#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>

namespace prime_kernels::common {

// Routes are -1 (masked: nothing written) or a pool row in [0, num_rows). The CUDA kernel skips any other route
// and notes it in the device-check record; the host loop runs only after every route was found valid.
struct DispatchRowsFp8Args {
  const void* src = nullptr;  // bf16 [num_tokens, >= hidden], row stride ld_src (elements)
  int64_t ld_src = 0;
  const int32_t* route_to_pool = nullptr;  // [num_tokens, top_k]
  int64_t num_tokens = 0;
  int64_t top_k = 0;
  int64_t hidden = 0;  // a multiple of 64 (hidden = 64 mod 128: the last block is 64 columns wide)
  void* q = nullptr;   // e4m3 [num_rows, >= hidden], row stride ld_q (bytes; a multiple of 16), 16-byte aligned
  int64_t ld_q = 0;
  // fp32: the scale of pool row p and 128-column block j (j < ceil(hidden / 128)) at sa[j * ld_sa + p]; ld_sa >=
  // num_rows, a multiple of 4, sa 16-byte aligned (m_grouped_fp8_gemm_nt's A scales)
  float* sa = nullptr;
  int64_t ld_sa = 0;
  int64_t num_rows = 0;
  bool pow2_scales = false;
};

// A layer's weights [num_mats, rows, cols] in 128 x 128 tiles (fp8.quantize_weight): e4m3 values and one fp32 scale
// per tile. Every array contiguous.
struct QuantizeWeightFp8Args {
  const void* w = nullptr;  // bf16 [num_mats, rows, cols], 16-byte aligned
  int64_t num_mats = 0;
  int64_t rows = 0;         // a multiple of 128
  int64_t cols = 0;         // a multiple of 128
  void* q = nullptr;        // e4m3 [num_mats, rows, cols], 16-byte aligned
  float* scale = nullptr;   // [num_mats, rows / 128, cols / 128]
  bool pow2_scales = false;
};

// The transposed copy of a weight's e4m3 tiles (fp8.QuantizedWeight.transposed): qt[m, c, r] = q[m, r, c], byte for
// byte. Both arrays contiguous.
struct TransposeTilesFp8Args {
  const void* q = nullptr;  // e4m3 [num_mats, rows, cols], 16-byte aligned
  int64_t num_mats = 0;
  int64_t rows = 0;         // a multiple of 128
  int64_t cols = 0;         // a multiple of 128
  void* qt = nullptr;       // e4m3 [num_mats, cols, rows], 16-byte aligned
};

// Expert e owns pool rows [expert_offsets[e], expert_offsets[e + 1]); its first expert_counts[e] rows are its
// tokens, the rest padding, quantized as zeros whatever they hold. Rows in no expert quantize as zeros as well.
// The layout rule (checked by the kernel on the device, by the host loop's caller on the host):
// 0 <= offsets[0] <= ... <= offsets[E] <= rows, every offset a multiple of 128 or rows (so every 128-row block
// belongs to one expert at most and the block grid starts at each expert's first row), and
// 0 <= counts[e] <= offsets[e + 1] - offsets[e].
// Gathering (src_route != null): v holds token rows instead, bf16 [num_tokens, >= cols], and pool row r is token row
// src_route[r] / top_k (the routing plan's pool_src_route, route = token * top_k + k): the pool is never written out.
// A live row with a negative route is read as zeros; a route >= num_tokens * top_k on a live row is a device finding
// (read as zeros) or fails the host call before anything is written.
struct QuantizeTokensFp8Args {
  const void* v = nullptr;  // bf16 [rows, >= cols] (or [num_tokens, >= cols] when gathering), row stride ld_v
  int64_t ld_v = 0;
  int64_t rows = 0;  // pool rows, < 2^31
  int64_t cols = 0;  // a multiple of 8
  const int32_t* expert_offsets = nullptr;  // [num_experts + 1]
  const int32_t* expert_counts = nullptr;   // [num_experts]
  int num_experts = 0;
  void* q = nullptr;  // e4m3 [cols, >= rows], row stride ld_q (bytes; a multiple of 16), 16-byte aligned
  int64_t ld_q = 0;
  // fp32: the scale of column c and 128-row block b at scale[b * ld_scale + c] (b < ceil(rows / 128));
  // ld_scale >= cols, a multiple of 4, scale 16-byte aligned (k_grouped_fp8_gemm_tn's scales)
  float* scale = nullptr;
  int64_t ld_scale = 0;
  bool pow2_scales = false;
  const int32_t* src_route = nullptr;  // [rows], or null: v is the pool
  int64_t num_tokens = 0;
  int64_t top_k = 1;
  // Null: v is bf16. Else v is e4m3 (ld_v in bytes) quantized 1 x 128 along cols, the scale of v's row r and
  // column block j at v_scale[r * v_scale_row_stride + j * v_scale_block_stride]; each value is read as
  // bf16(e4m3 * scale) (the fp32 product rounded once), the bf16 pool a dequantization would give.
  const float* v_scale = nullptr;
  int64_t v_scale_row_stride = 0;
  int64_t v_scale_block_stride = 0;
};

constexpr int kQuantizeMaxExperts = 1024;             // the k-grouped FP8 GEMM's most groups
constexpr int64_t kQuantizeMaxRows = (int64_t(1) << 31) - 1;
constexpr int64_t kQuantizeTokensMaxCols = int64_t(65535) * 64;  // grid y: one CTA column per 64 columns

namespace quantize_host {

inline int invalid(char* err, size_t err_len, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
inline int invalid(char* err, size_t err_len, const char* fmt, ...) {
  if (err != nullptr && err_len > 0) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
  }
  return 1;
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// 0 if the stride `name` is >= `min` (the size named min_name) and a multiple of `multiple`, else 1 and the reason.
inline int check_stride(char* err, size_t err_len, const char* fn, const char* name, int64_t ld, const char* min_name,
                        int64_t min, int multiple) {
  if (ld >= min && ld % multiple == 0) return 0;
  return invalid(err, err_len, "%s: %s = %lld, must be >= %s (%lld) and a multiple of %d", fn, name, (long long)ld,
                 min_name, (long long)min, multiple);
}

// Every check made before anything is launched or written, in order: 0, or 1 with the reason in err. on_device adds
// the alignment of the bf16 input (read with 16-byte loads); the outputs' layout is the GEMMs' on both paths.
inline int check_dispatch_rows_fp8_args(const DispatchRowsFp8Args& x, bool on_device, char* err, size_t err_len) {
  const char* fn = "dispatch_rows_fp8";
  if (x.num_tokens < 0 || x.top_k < 1 || x.hidden < 0 || x.num_rows < 0 || x.num_rows > kQuantizeMaxRows)
    return invalid(err, err_len,
                   "%s: need num_tokens >= 0, top_k >= 1, hidden >= 0, 0 <= num_rows < 2^31 (got %lld, %lld, %lld, "
                   "%lld)",
                   fn, (long long)x.num_tokens, (long long)x.top_k, (long long)x.hidden, (long long)x.num_rows);
  if (x.hidden % 64 != 0)
    return invalid(err, err_len,
                   "%s: hidden (%lld) must be a multiple of 64 (one fp32 scale per 1 x 128 block, the last block 64 "
                   "wide when hidden is 64 mod 128)",
                   fn, (long long)x.hidden);
  if (check_stride(err, err_len, fn, "ld_src", x.ld_src, "hidden", x.hidden, 8) ||
      check_stride(err, err_len, fn, "ld_q", x.ld_q, "hidden", x.hidden, 16) ||
      check_stride(err, err_len, fn, "ld_sa", x.ld_sa, "num_rows", x.num_rows, 4))
    return 1;
  if (x.num_tokens == 0 || x.hidden == 0) return 0;  // nothing to read or write
  if (x.src == nullptr || x.route_to_pool == nullptr || (x.num_rows > 0 && (x.q == nullptr || x.sa == nullptr)))
    return invalid(err, err_len, "%s: null src, route_to_pool, q or sa", fn);
  if (on_device && !aligned16(x.src)) return invalid(err, err_len, "%s: src must be 16-byte aligned", fn);
  if (!aligned16(x.q) || !aligned16(x.sa)) return invalid(err, err_len, "%s: q and sa must be 16-byte aligned", fn);
  return 0;
}

inline int check_quantize_tokens_fp8_args(const QuantizeTokensFp8Args& x, bool on_device, char* err,
                                          size_t err_len) {
  const char* fn = "quantize_tokens_fp8";
  if (x.num_experts < 1 || x.num_experts > kQuantizeMaxExperts)
    return invalid(err, err_len, "%s: num_experts = %d, must be in [1, %d]", fn, x.num_experts, kQuantizeMaxExperts);
  if (x.rows < 0 || x.rows > kQuantizeMaxRows || x.cols < 0 || x.cols > kQuantizeTokensMaxCols)
    return invalid(err, err_len, "%s: bad sizes rows=%lld cols=%lld (0 <= rows < 2^31, 0 <= cols <= %lld)", fn,
                   (long long)x.rows, (long long)x.cols, (long long)kQuantizeTokensMaxCols);
  if (x.cols % 8 != 0)
    return invalid(err, err_len, "%s: cols (%lld) must be a multiple of 8", fn, (long long)x.cols);
  if (x.src_route != nullptr && (x.num_tokens < 0 || x.top_k < 1 || x.num_tokens * x.top_k > kQuantizeMaxRows))
    return invalid(err, err_len, "%s: gathering needs num_tokens >= 0, top_k >= 1, routes < 2^31 (got %lld, %lld)", fn,
                   (long long)x.num_tokens, (long long)x.top_k);
  if (check_stride(err, err_len, fn, "ld_v", x.ld_v, "cols", x.cols, 8) ||
      check_stride(err, err_len, fn, "ld_q", x.ld_q, "rows", x.rows, 16) ||
      check_stride(err, err_len, fn, "ld_scale", x.ld_scale, "cols", x.cols, 4))
    return 1;
  if (x.rows == 0 || x.cols == 0) return 0;  // nothing to read or write
  const bool no_rows_to_read = x.src_route != nullptr && x.num_tokens == 0;  // a gather from no tokens reads zeros
  if ((x.v == nullptr && !no_rows_to_read) || x.expert_offsets == nullptr || x.expert_counts == nullptr ||
      x.q == nullptr || x.scale == nullptr)
    return invalid(err, err_len, "%s: null v, expert_offsets, expert_counts, q or scale", fn);
  if (x.v_scale != nullptr && (x.cols % 128 != 0 || x.v_scale_row_stride < 0 || x.v_scale_block_stride < 0))
    return invalid(err, err_len, "%s: e4m3 v needs cols (%lld) a multiple of 128 (its scale blocks) and non-negative "
                   "scale strides", fn, (long long)x.cols);
  if (on_device && !aligned16(x.v)) return invalid(err, err_len, "%s: v must be 16-byte aligned", fn);
  if (!aligned16(x.q) || !aligned16(x.scale))
    return invalid(err, err_len, "%s: q and scale must be 16-byte aligned", fn);
  return 0;
}

// The sizes of a stack of matrices in whole 128 x 128 tiles (a grid of cols/128 x rows/128 x num_mats CTAs): 0, or
// 1 with the reason in err.
inline int check_weight_tiles(const char* fn, int64_t num_mats, int64_t rows, int64_t cols, char* err,
                              size_t err_len) {
  if (num_mats < 0 || num_mats > 65535 || rows < 0 || rows > kQuantizeMaxRows || cols < 0 || cols > kQuantizeMaxRows)
    return invalid(err, err_len, "%s: bad sizes num_mats=%lld rows=%lld cols=%lld (num_mats <= 65535, rows and cols "
                   "< 2^31)", fn, (long long)num_mats, (long long)rows, (long long)cols);
  if (rows % 128 != 0 || cols % 128 != 0)
    return invalid(err, err_len, "%s: rows (%lld) and cols (%lld) must be multiples of 128 (whole 128 x 128 tiles)", fn,
                   (long long)rows, (long long)cols);
  return 0;
}

inline int check_quantize_weight_fp8_args(const QuantizeWeightFp8Args& x, bool on_device, char* err, size_t err_len) {
  const char* fn = "quantize_weight_fp8";
  if (const int rc = check_weight_tiles(fn, x.num_mats, x.rows, x.cols, err, err_len); rc != 0) return rc;
  if (x.num_mats == 0 || x.rows == 0 || x.cols == 0) return 0;  // nothing to read or write
  if (x.w == nullptr || x.q == nullptr || x.scale == nullptr)
    return invalid(err, err_len, "%s: null w, q or scale", fn);
  if ((on_device && !aligned16(x.w)) || !aligned16(x.q))
    return invalid(err, err_len, "%s: w and q must be 16-byte aligned", fn);
  return 0;
}

inline int check_transpose_tiles_fp8_args(const TransposeTilesFp8Args& x, bool /*on_device*/, char* err,
                                          size_t err_len) {
  const char* fn = "transpose_tiles_fp8";
  if (const int rc = check_weight_tiles(fn, x.num_mats, x.rows, x.cols, err, err_len); rc != 0) return rc;
  if (x.num_mats == 0 || x.rows == 0 || x.cols == 0) return 0;
  if (x.q == nullptr || x.qt == nullptr) return invalid(err, err_len, "%s: null q or qt", fn);
  if (!aligned16(x.q) || !aligned16(x.qt)) return invalid(err, err_len, "%s: q and qt must be 16-byte aligned", fn);
  if (x.q == x.qt) return invalid(err, err_len, "%s: qt must not be q (the copy is not in place)", fn);
  return 0;
}

// A gathering call's routes on host arrays: every live row's route < num_tokens * top_k (negative: a zero row).
// 0, or 1 with the first offending row in err. The layout must have passed check_pool_layout.
inline int check_pool_routes(const int32_t* src_route, const int32_t* offsets, const int32_t* counts,
                             int num_experts, int64_t num_routes, char* err, size_t err_len) {
  for (int e = 0; e < num_experts; ++e)
    for (int64_t r = offsets[e]; r < offsets[e] + counts[e]; ++r)
      if (src_route[r] >= num_routes)
        return invalid(err, err_len,
                       "quantize_tokens_fp8: pool_src_route[%lld] = %d is past the %lld routes (num_tokens * top_k)",
                       (long long)r, src_route[r], (long long)num_routes);
  return 0;
}

// The layout rule above on host arrays: 0, or 1 with the first offending entry in err.
inline int check_pool_layout(const int32_t* offsets, const int32_t* counts, int num_experts, int64_t rows,
                             char* err, size_t err_len) {
  const char* fn = "quantize_tokens_fp8";
  for (int e = 0; e <= num_experts; ++e) {
    const int64_t o = offsets[e], prev = e > 0 ? offsets[e - 1] : 0;
    if (o < prev || o > rows || (o % 128 != 0 && o != rows))
      return invalid(err, err_len,
                     "%s: expert_offsets[%d] = %lld: offsets must be non-decreasing within [0, %lld], each a "
                     "multiple of 128 or %lld",
                     fn, e, (long long)o, (long long)rows, (long long)rows);
  }
  for (int e = 0; e < num_experts; ++e)
    if (counts[e] < 0 || counts[e] > offsets[e + 1] - offsets[e])
      return invalid(err, err_len, "%s: expert_counts[%d] = %d is outside [0, %d] (expert %d's pool rows)", fn, e,
                     counts[e], offsets[e + 1] - offsets[e], e);
  return 0;
}

}  // namespace quantize_host
}  // namespace prime_kernels::common
