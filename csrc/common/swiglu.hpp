#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace prime_kernels::common {

struct SwigluArgs {
  const void* h;  // bf16 [rows, 2I] (row stride ld_h)
  int64_t ld_h;
  int64_t inter;                // I
  const int32_t* num_rows;      // device scalar: rows in use (clamped to [0, max_rows] on the device)
  int64_t max_rows;             // rows allocated
  bool has_clamp;
  float clamp;
  // forward
  void* s;  // bf16 [rows, I]
  int64_t ld_s;
  // backward
  const void* da;  // bf16 [rows, I]
  int64_t ld_da;
  const int32_t* pool_src_route;  // [rows]
  const float* topk_weights;      // [num_routes] fp32 (T * K)
  int64_t num_routes;
  void* dh;                       // bf16 [rows, 2I]
  int64_t ld_dh;
  void* a;  // bf16 [rows, I]
  int64_t ld_a;
  float* dt;  // [rows]
};

cudaError_t launch_swiglu_fwd(const SwigluArgs& args, cudaStream_t stream);
cudaError_t launch_swiglu_bwd(const SwigluArgs& args, cudaStream_t stream);

}  // namespace prime_kernels::common
