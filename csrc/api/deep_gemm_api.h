// The C ABI of the prime-kernels core (libdeep_gemm_core.so).
//
// Every entry point takes raw pointers, sizes and a cudaStream_t, validates its arguments before
// touching the device, and returns a status code. On failure the reason is kept in a thread-local
// string (pk_last_error). Nothing here aborts or prints. No torch or Python types cross this line.
#pragma once

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define PK_API __attribute__((visibility("default")))
#else
#define PK_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

// Status codes.
enum {
  PK_OK = 0,
  PK_ERR_INVALID_ARGUMENT = 1,  // a bad shape, pointer, alignment or value: fix the call
  PK_ERR_NOT_AVAILABLE = 2,     // no kernel for this device/arch in this build
  PK_ERR_CUDA = 3,              // a CUDA runtime/driver call failed
  PK_ERR_INTERNAL = 4,
};

// Bumped whenever a signature below changes; the Python loader refuses a mismatch.
#define PK_ABI_VERSION 1
PK_API int pk_abi_version(void);

// The message of the last failed call on this thread ("" if none).
PK_API const char* pk_last_error(void);

// Comma-separated arches this library holds SASS for, e.g. "90a,100a".
PK_API const char* pk_built_archs(void);

// Comma-separated "kernel:arch" pairs compiled into this library, e.g. "routing_plan:90a,...".
PK_API const char* pk_compiled_kernels(void);

// Whether the library holds an image that runs on device `device_index` (0 = yes; otherwise an
// error code and pk_last_error says why, e.g. "device sm_89 ... rebuild with ...").
PK_API int pk_check_device(int device_index);

// ---------------------------------------------------------------------------------------------
// Routing plan. From topk_idx [num_tokens, top_k] (int32 or int64; -1 = masked route) builds the
// expert-grouped pool: pool rows are in stable (expert, token, k) order, each expert's rows start
// at expert_offsets[e], a multiple of block_m, and are padded up to a multiple of block_m.
//
// Outputs (all int32, device memory for the CUDA entry point, host memory for the CPU one):
//   expert_counts  [num_experts]       routes per expert
//   expert_offsets [num_experts + 1]   first pool row of each expert; [num_experts] = rows in use
//   pool_src_route [pool_capacity]     token * top_k + k of each pool row, -1 for padding rows
//   pool_src_rank  [pool_capacity]     source rank of each pool row (= `rank`), -1 for padding
//   route_to_pool  [num_tokens, top_k] pool row of each route, -1 for masked routes
//   num_invalid    [1]                 routes whose id is < -1 or >= num_experts (treated as masked)
// pool_capacity must be >= pk_routing_plan_pool_capacity(num_tokens, top_k, num_experts, block_m).
// The CUDA entry point needs `workspace` of pk_routing_plan_workspace_bytes(...) bytes.
// ---------------------------------------------------------------------------------------------
PK_API int64_t pk_routing_plan_pool_capacity(int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                             int64_t block_m);
PK_API int64_t pk_routing_plan_workspace_bytes(int64_t num_tokens, int64_t top_k, int64_t num_experts);

PK_API int pk_routing_plan_cuda(const void* topk_idx, int topk_idx_is_int64, int64_t num_tokens,
                                int64_t top_k, int64_t num_experts, int64_t block_m, int32_t rank,
                                int32_t* expert_counts, int32_t* expert_offsets,
                                int32_t* pool_src_route, int32_t* pool_src_rank, int64_t pool_capacity,
                                int32_t* route_to_pool, int32_t* num_invalid, void* workspace,
                                int64_t workspace_bytes, void* cuda_stream);

PK_API int pk_routing_plan_cpu(const void* topk_idx, int topk_idx_is_int64, int64_t num_tokens,
                               int64_t top_k, int64_t num_experts, int64_t block_m, int32_t rank,
                               int32_t* expert_counts, int32_t* expert_offsets, int32_t* pool_src_route,
                               int32_t* pool_src_rank, int64_t pool_capacity, int32_t* route_to_pool,
                               int32_t* num_invalid);

#ifdef __cplusplus
}  // extern "C"
#endif
