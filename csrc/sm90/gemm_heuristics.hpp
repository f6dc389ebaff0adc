// prime-kernels: tile configurations for the sm90 grouped-GEMM kernels.
// Plain host C++ (no CUDA headers needed).
#pragma once

#include <cstdint>

namespace deep_gemm {
namespace sm90 {

// One kernel instantiation. block_m and block_k are fixed at 128 and 64 today; block_n and num_stages pick
// the instantiation. num_sms = 0 means "all multiprocessors of the device".
struct GroupedGemmConfig {
  int block_m = 128;
  int block_n = 256;
  int block_k = 64;
  int num_stages = 4;
  int num_sms = 0;
  // 0: the consumer warpgroups store their tile themselves (through a small staging tile);
  // 1: asynchronous epilogue: consumers drop the tile into a full-tile staging buffer and move on, 3 store
  //    warps of the producer warpgroup write it out (bf16 outputs only; costs one pipeline stage of smem).
  int async_epilogue = 0;
  // m-grouped only: 1, or 2 = clusters of two CTAs on adjacent m-blocks that multicast the shared B tile.
  int cluster_m = 1;
};

// Instantiated (block_n, num_stages, async_epilogue): (128, 6, 0), (256, 4, 0), (128, 5, 1), (256, 3, 1).
inline bool grouped_gemm_config_supported(const GroupedGemmConfig& c) {
  if (c.block_m != 128 || c.block_k != 64 || c.num_sms < 0) return false;
  if (c.cluster_m != 1 && c.cluster_m != 2) return false;
  if (c.async_epilogue == 0) return (c.block_n == 128 && c.num_stages == 6) || (c.block_n == 256 && c.num_stages == 4);
  if (c.async_epilogue == 1) return (c.block_n == 128 && c.num_stages == 5) || (c.block_n == 256 && c.num_stages == 3);
  return false;
}

// m-grouped: D[M_total, N] = A[M_total, K] @ B_g^T.
// Wide 128x256 tiles halve the shared-memory operand traffic per FLOP against 128x128; they waste work when
// N is small or leaves a thin last column block, so fall back to 128x128 there.
inline GroupedGemmConfig m_grouped_gemm_config(int64_t m_total, int64_t n, int64_t k, int num_groups) {
  (void)m_total;
  (void)k;
  (void)num_groups;
  GroupedGemmConfig c;
  const int64_t waste256 = (256 - n % 256) % 256;
  if (n <= 128 || waste256 > 64) {
    c.block_n = 128;
    c.num_stages = 6;
  }
  return c;
}

// k-grouped: C_e[M, N] = A_e^T @ B_e with K_e = rows of expert e.
// c_is_bf16 = false (fp32 store/accumulate) only has the synchronous epilogue.
inline GroupedGemmConfig k_grouped_gemm_config(int64_t m, int64_t n, int64_t p_total, int num_groups,
                                               bool c_is_bf16) {
  (void)c_is_bf16;
  (void)m;
  (void)p_total;
  (void)num_groups;
  GroupedGemmConfig c;
  const int64_t waste256 = (256 - n % 256) % 256;
  if (n <= 128 || waste256 > 64) {
    c.block_n = 128;
    c.num_stages = 6;
  }
  return c;
}

}  // namespace sm90
}  // namespace deep_gemm
