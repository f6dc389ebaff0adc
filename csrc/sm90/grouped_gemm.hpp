// prime-kernels: host launch functions for the sm90a BF16 grouped GEMMs.
//
// Plain C++ over raw device pointers (no torch types); link with the CUDA runtime (static is fine), not
// with libcuda (the tensor-map encoder is fetched through cudaGetDriverEntryPointByVersion).
//
// Every function validates its arguments before touching the device and returns a status code
// (status.hpp: 0 = ok, 1 = invalid argument, 2 = not available on this device/build, 3 = CUDA error). On failure a
// message is written to err (NUL-terminated, truncated to err_len; err may be null). Nothing aborts or
// prints. All launches are asynchronous on `stream`.
//
// Values read from device memory (group offsets, row and route indices) are checked by the kernels, not here (that
// would need a synchronisation): see common/device_check.hpp for what a bad value does and how it is reported.
// config->num_sms (0 = every multiprocessor) caps the persistent grid; every value gives the same bits (no kernel
// here waits on another CTA, see each kernel's header).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "gemm_heuristics.hpp"
#include "m_blocks.hpp"
#include "status.hpp"

namespace deep_gemm {
namespace sm90 {

// m-grouped GEMM:  D[m, :] = A[m, :] @ B_g^T  for m in [group_offsets[g], group_offsets[g+1]).
//
//   a       bf16 [m_total, k], row stride lda (elements; lda >= k, lda % 8 == 0), 16-byte aligned.
//   b       bf16, per group g at b + g * b_group_stride (elements, % 8 == 0):
//             b_k_major = true : [num_groups, n, k], row stride ldb >= k  (x @ W^T, W = [n, k]: "nt")
//             b_k_major = false: [num_groups, k, n], row stride ldb >= n  (dy @ W, W = [k, n]: "nn")
//   d       bf16 [m_total, n], row stride ldd (>= n, % 8 == 0), 16-byte aligned. Only rows inside a
//           group are written; other rows keep their contents.
//   group_offsets  device int32 [num_groups + 1], 0 <= group_offsets[0] <= ... <= group_offsets[num_groups] <=
//           m_total (rows before the first offset belong to no group). No padding is required; empty groups are
//           allowed. Offsets that break this make the kernel write nothing (a device-check finding).
//   n, k    multiples of 8 (TMA row pitch); n >= 8, k >= 0 (k == 0 writes zeros to the group rows).
//   1 <= num_groups <= 1024.
//   config  null = gemm_heuristics' choice; else an instantiated (block_n, num_stages) pair with async_epilogue 1.
int m_grouped_bf16_gemm(const void* a, int64_t lda, const void* b, bool b_k_major, int64_t ldb,
                        int64_t b_group_stride, void* d, int64_t ldd, const int32_t* group_offsets,
                        int num_groups, int64_t m_total, int64_t n, int64_t k,
                        const GroupedGemmConfig* config, cudaStream_t stream, char* err, size_t err_len);

// m-grouped GEMM with A gathered through a row-index list (no materialized copy of the gathered rows):
//   D[m, :] = A[a_row_index[m], :] @ B_g^T  for m in [group_offsets[g], group_offsets[g+1]).
//   a            bf16 [a_rows, k], row stride lda (>= k, % 8 == 0), 16-byte aligned.
//   a_row_index  device int32 [m_total]; -1 reads a zero row; another index outside [0, a_rows) also reads a zero
//                row and is a device-check finding.
//   Everything else as m_grouped_bf16_gemm (the rows are copied by cp.async, see m_grouped_gemm.cuh).
int m_grouped_bf16_gemm_gather_a(const void* a, int64_t lda, int64_t a_rows, const int32_t* a_row_index,
                                 const void* b, bool b_k_major, int64_t ldb, int64_t b_group_stride, void* d,
                                 int64_t ldd, const int32_t* group_offsets, int num_groups, int64_t m_total,
                                 int64_t n, int64_t k, const GroupedGemmConfig* config, cudaStream_t stream,
                                 char* err, size_t err_len);

// L1 of the fused MoE forward: m-grouped GEMM against w13 in its natural layout with a SwiGLU epilogue.
//   hg = A_g @ w13_g[0:I, :]^T,  hu = A_g @ w13_g[I:2I, :]^T   (fp32 accumulation) for the rows of group g;
//   s[m, :] = silu(hg) * hu   (with hg <= clamp_limit and |hu| <= clamp_limit first when clamp_limit > 0)
//   h[m, :] = [hg | hu] in bf16 (only when h != null: the pre-activation for the backward).
//   a            bf16 [m_total, k] (a_row_index == null) or [a_rows, k] read through a_row_index[m] (as in
//                m_grouped_bf16_gemm_gather_a), row stride lda (>= k, % 8 == 0).
//   w13          bf16 [num_groups, 2 * intermediate, k], K contiguous, row stride ldb, group stride
//                b_group_stride (elements).
//   s            bf16 [m_total, intermediate] row stride lds; h bf16 [m_total, 2 * intermediate] row stride ldh.
//                Only rows inside a group are written.
//   intermediate a multiple of 64; k a multiple of 8, >= 8; clamp_limit >= 0 (0 = no clamp).
//   config       null (swiglu_gemm_config()) or block_n 256 / 3 stages or 128 / 5 stages, async_epilogue 1.
int m_grouped_bf16_gemm_swiglu(const void* a, int64_t lda, int64_t a_rows, const int32_t* a_row_index,
                               const void* w13, int64_t ldb, int64_t b_group_stride, int64_t intermediate, void* s,
                               int64_t lds, void* h, int64_t ldh, const int32_t* group_offsets, int num_groups,
                               int64_t m_total, int64_t k, float clamp_limit, const GroupedGemmConfig* config,
                               cudaStream_t stream, char* err, size_t err_len);

// L2 dgrad with the SwiGLU backward in its epilogue (swiglu_bwd_pp.cuh): da = dy_pool @ w2_g ([E, hidden,
// intermediate], MN-major) per group, never stored; with w = route_weights[pool_src_route[m]] (route_weights has
// num_routes entries; -1 = a padding row, weight 0; another route outside [0, num_routes) also gets weight 0 and is
// a device-check finding) writes dh [m_total, 2I] and aw = w * s [m_total, I] (bf16) and dt_part [m_total, dt_ld]
// (fp32 d topk_weights partials, dt_ld >= ceil(I / 128); their row sum in column order is the d weight). Rows
// outside every group are not written. intermediate a multiple of 64, hidden a multiple of 8; clamp_limit >= 0
// (0 = no clamp); num_sms caps the grid (0 = every multiprocessor).
int m_grouped_bf16_gemm_swiglu_bwd(const void* dy_pool, int64_t lda, const void* w2, int64_t ldb, int64_t b_group_stride,
                                   const void* h, int64_t ldh, const int32_t* pool_src_route,
                                   const float* route_weights, int64_t num_routes, void* dh, int64_t lddh, void* aw,
                                   int64_t ldaw, float* dt_part, int64_t dt_ld, const int32_t* group_offsets,
                                   int num_groups, int64_t m_total, int64_t intermediate, int64_t hidden,
                                   float clamp_limit, int num_sms, cudaStream_t stream, char* err, size_t err_len);

// k-grouped GEMM (weight gradients):  C_e = A_e^T @ B_e  (or C_e += ... when accumulate),
// A_e = rows [group_offsets[e], group_offsets[e+1]) of A, likewise B_e.
//
//   a       bf16 [p_total, m], row stride lda (>= m, % 8 == 0), 16-byte aligned.
//   b       bf16 [p_total, n], row stride ldb (>= n, % 8 == 0), 16-byte aligned.
//   c       [num_groups, m, n] contiguous; c_is_bf16 = false: fp32 (store, or accumulate into the existing
//           values when accumulate = true); c_is_bf16 = true: bf16 store (accumulate must be false).
//           c must be 16-byte aligned. An empty group gives C_e = 0 (store) or leaves C_e unchanged
//           (accumulate).
//   group_offsets  device int32 [num_groups + 1], 0 <= group_offsets[0] <= ... <= last <= p_total; offsets that
//           break this make the kernel write nothing (a device-check finding).
//   m, n    multiples of 8, >= 8.   1 <= num_groups <= 1024.
int k_grouped_bf16_gemm(const void* a, int64_t lda, const void* b, int64_t ldb, void* c, bool c_is_bf16,
                        bool accumulate, const int32_t* group_offsets, int num_groups, int64_t p_total,
                        int64_t m, int64_t n, const GroupedGemmConfig* config, cudaStream_t stream, char* err,
                        size_t err_len);

}  // namespace sm90
}  // namespace deep_gemm
