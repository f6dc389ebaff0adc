// Dev-only extern "C" wrapper over csrc/sm90/grouped_gemm.hpp for bench/gemm_dev/check_and_bench.py
// (ctypes). The real C ABI lives in csrc/api; this file is replaceable.
#include <cstddef>
#include <cstdint>

#include "../../csrc/sm90/grouped_gemm.hpp"

using deep_gemm::sm90::GroupedGemmConfig;

extern "C" {

// block_n <= 0: heuristic config; else (block_n, num_stages, async_epi) picks an instantiation.
int pkdev_m_grouped(const void* a, long long lda, const void* b, int b_k_major, long long ldb,
                    long long b_group_stride, void* d, long long ldd, const int32_t* offs, int num_groups,
                    long long m_total, long long n, long long k, int block_n, int num_stages, int async_epi,
                    int cluster_m, void* stream, char* err, size_t err_len) {
  GroupedGemmConfig cfg;
  cfg.block_n = block_n;
  cfg.num_stages = num_stages;
  cfg.async_epilogue = async_epi;
  cfg.cluster_m = cluster_m;
  return deep_gemm::sm90::m_grouped_bf16_gemm(a, lda, b, b_k_major != 0, ldb, b_group_stride, d, ldd, offs,
                                              num_groups, m_total, n, k, block_n > 0 ? &cfg : nullptr,
                                              (cudaStream_t)stream, err, err_len);
}

int pkdev_k_grouped(const void* a, long long lda, const void* b, long long ldb, void* c, int c_is_bf16,
                    int accumulate, const int32_t* offs, int num_groups, long long p_total, long long m,
                    long long n, int block_n, int num_stages, int async_epi, void* stream, char* err, size_t err_len) {
  GroupedGemmConfig cfg;
  cfg.block_n = block_n;
  cfg.num_stages = num_stages;
  cfg.async_epilogue = async_epi;
  return deep_gemm::sm90::k_grouped_bf16_gemm(a, lda, b, ldb, c, c_is_bf16 != 0, accumulate != 0, offs,
                                              num_groups, p_total, m, n, block_n > 0 ? &cfg : nullptr,
                                              (cudaStream_t)stream, err, err_len);
}

int pkdev_m_grouped_gather(const void* a, long long lda, long long a_rows, const int32_t* a_row_index,
                           const void* b, int b_k_major, long long ldb, long long b_group_stride, void* d,
                           long long ldd, const int32_t* offs, int num_groups, long long m_total, long long n,
                           long long k, int block_n, int num_stages, int async_epi, int gather_mode, void* stream,
                           char* err, size_t err_len) {
  GroupedGemmConfig cfg = deep_gemm::sm90::m_grouped_gemm_config(m_total, n, k, num_groups);
  if (block_n > 0) {
    cfg.block_n = block_n;
    cfg.num_stages = num_stages;
    cfg.async_epilogue = async_epi;
  }
  cfg.gather_mode = gather_mode;
  return deep_gemm::sm90::m_grouped_bf16_gemm_gather_a(a, lda, a_rows, a_row_index, b, b_k_major != 0, ldb,
                                                       b_group_stride, d, ldd, offs, num_groups, m_total, n, k,
                                                       &cfg, (cudaStream_t)stream, err, err_len);
}

// a_row_index == null: plain A. h may be null. block_n <= 0: default config.
int pkdev_m_grouped_swiglu(const void* a, long long lda, long long a_rows, const int32_t* a_row_index,
                           const void* w13, long long ldb, long long b_group_stride, long long inter, void* s,
                           long long lds, void* h, long long ldh, const int32_t* offs, int num_groups,
                           long long m_total, long long k, float clamp, int block_n, int num_stages, int gather_mode,
                           void* stream, char* err, size_t err_len) {
  GroupedGemmConfig cfg;
  cfg.block_n = block_n > 0 ? block_n : 256;
  cfg.num_stages = block_n > 0 ? num_stages : 3;
  cfg.async_epilogue = 1;
  cfg.gather_mode = gather_mode;
  return deep_gemm::sm90::m_grouped_bf16_gemm_swiglu(a, lda, a_rows, a_row_index, w13, ldb, b_group_stride, inter, s,
                                                     lds, h, ldh, offs, num_groups, m_total, k, clamp,
                                                     &cfg, (cudaStream_t)stream, err, err_len);
}

}  // extern "C"
