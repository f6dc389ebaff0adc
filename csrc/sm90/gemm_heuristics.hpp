// prime-kernels: tile configurations for the sm90 grouped-GEMM kernels.
// Plain host C++ (no CUDA headers needed).
#pragma once

#include <cstdint>

namespace prime_kernels {
namespace sm90 {

// One kernel instantiation. block_m and block_k are fixed at 128 and 64 today; block_n, num_stages and
// async_epilogue pick the instantiation. num_sms = 0 means "all multiprocessors of the device". Every kernel runs
// one CTA per tile (2-CTA clusters multicasting B measured 1-4% slower, docs/performance.md) and gathers rows of A
// by cp.async (per-row TMA boxes measured 1.4x slower, docs/performance.md).
struct GroupedGemmConfig {
  int block_m = 128;
  int block_n = 256;
  int block_k = 64;
  int num_stages = 4;
  int num_sms = 0;
  // 0: the consumer warpgroups store their tile themselves, from registers (the k-grouped fp32 outputs);
  // 1: asynchronous epilogue: consumers drop the tile into a full-tile staging buffer and move on, 3 store
  //    warps of the producer warpgroup write it out (bf16 outputs only; costs one pipeline stage of smem).
  int async_epilogue = 0;
};

// L2 cache-hint bits of the grouped GEMMs (bit 0: output stores evict_first; bit 3: the reused operand loads
// evict_last; a clear bit: no hint). Measured on the H200, layer forward + backward steady state, 4 rounds
// (docs/performance.md): the m-grouped GEMMs and the L2 dgrad + SwiGLU backward with 9 (weight loads evict_last: every
// m-block of a band reads each B tile in turn; output stores evict_first: a later kernel reads them only after far
// more than L2 holds has streamed through) against 0: 30B 7.48-7.53 -> 7.42-7.43 ms, 235B 27.56-27.58 ->
// 26.99-27.04 ms. The k-grouped GEMM with 8 (A and B loads evict_last: every tile of an expert re-reads its rows)
// against 0: 30B 7.71-7.76 -> 7.57-7.59 ms, 235B 27.88-27.96 -> 27.49-27.56 ms; its C stores evict_first (bit 0)
// changed nothing, so that bit stays clear.
constexpr int32_t kGemmL2Hints = 9;
constexpr int32_t kKGroupedL2Hints = 8;

// The SwiGLU GEMM's default tiles (m_grouped_bf16_gemm_swiglu): 128 x 256 (gate | up of 128 columns of I), 3
// stages, the asynchronous epilogue, as the shared rule below picks for a bf16 output.
inline GroupedGemmConfig swiglu_gemm_config() {
  GroupedGemmConfig c;
  c.block_n = 256;
  c.num_stages = 3;
  c.async_epilogue = 1;
  return c;
}

// Instantiated (block_n, num_stages, async_epilogue): (128, 5, 1), (256, 3, 1) for bf16 outputs; (128, 6, 0),
// (256, 4, 0) for the k-grouped kernel's fp32 outputs only.
inline bool grouped_gemm_config_supported(const GroupedGemmConfig& c) {
  if (c.block_m != 128 || c.block_k != 64 || c.num_sms < 0) return false;
  if (c.async_epilogue == 0) return (c.block_n == 128 && c.num_stages == 6) || (c.block_n == 256 && c.num_stages == 4);
  if (c.async_epilogue == 1) return (c.block_n == 128 && c.num_stages == 5) || (c.block_n == 256 && c.num_stages == 3);
  return false;
}

// Shared rule for both kernels. Measured on H200 (docs/performance.md): 128x256 tiles beat 128x128 at every MoE
// shape (they halve the shared-memory operand traffic per FLOP against 128x128), and the asynchronous epilogue
// with 3 stages beats the synchronous one with 4 (20 of 24 passes). Narrow or ragged N (a last column block
// more than a quarter empty) falls back to 128-wide tiles.
inline GroupedGemmConfig grouped_gemm_config_for_n(int64_t n, bool bf16_out) {
  GroupedGemmConfig c;
  const int64_t waste256 = (256 - n % 256) % 256;
  const bool wide = !(n <= 128 || waste256 > 64);
  c.block_n = wide ? 256 : 128;
  c.async_epilogue = bf16_out ? 1 : 0;
  c.num_stages = wide ? (bf16_out ? 3 : 4) : (bf16_out ? 5 : 6);
  return c;
}

// m-grouped: D[M_total, N] = A[M_total, K] @ B_g^T (bf16 out).
inline GroupedGemmConfig m_grouped_gemm_config(int64_t m_total, int64_t n, int64_t k, int num_groups) {
  (void)m_total;
  (void)k;
  (void)num_groups;
  return grouped_gemm_config_for_n(n, true);
}

// m-grouped blockwise FP8 (m_grouped_fp8_gemm_nt, m_grouped_gemm_fp8.cuh): the one instantiation there is.
//   block_m = 128: two consumer warpgroups of m64 wgmma, as the BF16 kernel.
//   block_n = 128: B's scales are per 128 x 128 block, so a 128-wide tile needs one B scale per k-block (a wider
//     tile would need one per 128 columns, and the promotion one multiply per column group more).
//   block_k = 128: the promotion interval of the recipe (one scale per 128 of K), so each stage is one promotion.
//   num_stages = 5: the most that fit (5 x 32.5 KB of A, B and A's scales, plus the 32 KB bf16 staging tile of the
//     asynchronous epilogue, within 227 KB); more stages hide more load latency.
//   async_epilogue = 1: the BF16 kernel's epilogue, the only one this kernel has.
// Not measured on a GPU yet: these are the structural choices, not tuned ones.
inline GroupedGemmConfig m_grouped_fp8_gemm_config(int64_t m_total, int64_t n, int64_t k, int num_groups) {
  (void)m_total;
  (void)n;
  (void)k;
  (void)num_groups;
  GroupedGemmConfig c;
  c.block_m = 128;
  c.block_n = 128;
  c.block_k = 128;
  c.num_stages = 5;
  c.async_epilogue = 1;
  return c;
}
// A kernel built for one config takes exactly that config, whatever num_sms (it only bounds the grid).
inline bool is_built_config(const GroupedGemmConfig& c, const GroupedGemmConfig& built) {
  return c.block_m == built.block_m && c.block_n == built.block_n && c.block_k == built.block_k &&
         c.num_stages == built.num_stages && c.async_epilogue == built.async_epilogue && c.num_sms >= 0;
}
inline bool m_grouped_fp8_gemm_config_supported(const GroupedGemmConfig& c) {
  return is_built_config(c, m_grouped_fp8_gemm_config(0, 0, 0, 0));
}

// k-grouped blockwise FP8 (k_grouped_fp8_gemm_tn, k_grouped_gemm_fp8.cuh): the one tile shape there is, one
// instantiation per output kind.
//   block_m = block_n = 128: both operands carry one scale per row of C per k-block, so the promotion multiplies
//     every accumulator by its own row x column scale; a 128 x 256 tile would need 128 accumulator registers plus
//     the partials per consumer thread, more than the 232 a consumer has.
//   block_k = 128: the token block of the recipe's qT scales, so each stage is one promotion.
//   async_epilogue = 1: the tile is staged in shared memory and written by TMA stores (fp32 adds for an
//     accumulator) while the next tile's MMAs run. With 1024 token rows per expert a tile has only 8 k-blocks, and
//     the register stores held the consumers in lg_throttle stalls: ncu on the H200 (30B dW13, T = 16384) showed the
//     tensor pipe active 33% of the time, against 64% for the m-grouped FP8 kernel's TMA-store epilogue.
//   num_stages = 5 for a bf16 output, 4 for fp32: what fits beside the 32 (64) KB staging tile
//     (k_grouped_fp8_stages).
inline GroupedGemmConfig k_grouped_fp8_gemm_config(int64_t m, int64_t n, int64_t p_total, int num_groups,
                                                   bool c_is_bf16) {
  (void)m;
  (void)n;
  (void)p_total;
  (void)num_groups;
  GroupedGemmConfig c;
  c.block_m = 128;
  c.block_n = 128;
  c.block_k = 128;
  c.num_stages = c_is_bf16 ? 5 : 4;
  c.async_epilogue = 1;
  return c;
}
inline bool k_grouped_fp8_gemm_config_supported(const GroupedGemmConfig& c, bool c_is_bf16) {
  return is_built_config(c, k_grouped_fp8_gemm_config(0, 0, 0, 0, c_is_bf16));
}

// k-grouped: C_e[M, N] = A_e^T @ B_e with K_e = rows of expert e. c_is_bf16 = false (fp32 store/accumulate)
// only has the synchronous epilogue. bf16 weight gradients take the asynchronous 3-stage config: it led the
// 4-stage synchronous one on 7 of 8 wgrad passes, by 2-5% at 235B (docs/performance.md).
inline GroupedGemmConfig k_grouped_gemm_config(int64_t m, int64_t n, int64_t p_total, int num_groups,
                                               bool c_is_bf16) {
  (void)m;
  (void)p_total;
  (void)num_groups;
  return grouped_gemm_config_for_n(n, c_is_bf16);
}

}  // namespace sm90
}  // namespace prime_kernels
