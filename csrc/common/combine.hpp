#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace prime_kernels::common {

// Routes are -1 (masked) or a row in [0, num_rows). The CUDA kernels skip any other route and note it in the
// device-check record (common/device_check.hpp); the host loops are run only after invalid_route found none.
struct CombineArgs {
  const void* slots;  // bf16 [num_rows, >= hidden], row stride ld_slots (elements)
  int64_t ld_slots;
  const int32_t* route_to_pool;  // [num_tokens, top_k]
  const float* weights;          // [num_tokens, top_k] fp32, or null for plain sums
  int64_t num_tokens;
  int64_t top_k;
  int64_t hidden;
  void* out;  // bf16 [num_tokens, >= hidden], row stride ld_out
  int64_t ld_out;
  int64_t num_rows = INT64_MAX;  // slot rows; every entry point of the library passes it
};

cudaError_t launch_combine(const CombineArgs& args, cudaStream_t stream);
void combine_host(const CombineArgs& args);  // same order and rounding, on the CPU

// out[route_to_pool[t, k]] = src[t] (bf16 rows copied as they are); routes of -1 write nothing, and rows no route
// names keep their contents.
struct DispatchArgs {
  const void* src;  // bf16 [num_tokens, >= hidden], row stride ld_src (elements)
  int64_t ld_src;
  const int32_t* route_to_pool;  // [num_tokens, top_k]
  int64_t num_tokens;
  int64_t top_k;
  int64_t hidden;
  void* out;  // bf16 [num_rows, >= hidden], row stride ld_out
  int64_t ld_out;
  int64_t num_rows;
};

cudaError_t launch_dispatch_rows(const DispatchArgs& args, cudaStream_t stream);
void dispatch_rows_host(const DispatchArgs& args);

// The first entry of route_to_pool[0, count) (host memory) that is neither -1 nor in [0, num_rows), or -1 if none.
int64_t invalid_route(const int32_t* route_to_pool, int64_t count, int64_t num_rows);

}  // namespace prime_kernels::common
