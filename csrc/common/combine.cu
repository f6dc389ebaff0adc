#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/combine.cuh"
#include "common/combine.hpp"

namespace prime_kernels::common {

namespace {
// The row kernels' grid: x covers a row's 8-column chunks, one per thread; y one token per block row, capped at
// the grid's y limit (the kernels stride over the rest).
dim3 row_kernel_grid(int64_t hidden, int64_t num_tokens) {
  const int64_t chunks = (hidden / 8 + kCombineThreads - 1) / kCombineThreads;
  return dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(std::min<int64_t>(num_tokens, 65535)));
}
}  // namespace

cudaError_t launch_combine(const CombineArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  combine_bf16_kernel<<<row_kernel_grid(a.hidden, a.num_tokens), kCombineThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(a.slots), a.ld_slots, a.num_rows, a.route_to_pool, a.weights, a.num_tokens,
      static_cast<int>(a.top_k), a.hidden, static_cast<__nv_bfloat16*>(a.out), a.ld_out, device_check_record());
  return cudaGetLastError();
}

void combine_host(const CombineArgs& a) {
  const auto* slots = static_cast<const __nv_bfloat16*>(a.slots);
  auto* out = static_cast<__nv_bfloat16*>(a.out);
  std::vector<float> acc(a.hidden);
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t k = 0; k < a.top_k; ++k) {
      const int32_t row = a.route_to_pool[t * a.top_k + k];
      if (row < 0) continue;
      const float w = a.weights != nullptr ? a.weights[t * a.top_k + k] : 1.0f;
      for (int64_t h = 0; h < a.hidden; ++h)
        acc[h] = std::fmaf(w, __bfloat162float(slots[row * a.ld_slots + h]), acc[h]);
    }
    for (int64_t h = 0; h < a.hidden; ++h) out[t * a.ld_out + h] = __float2bfloat16_rn(acc[h]);
  }
}

cudaError_t launch_dispatch_rows(const DispatchArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0 || a.hidden == 0) return cudaSuccess;
  dispatch_rows_bf16_kernel<<<row_kernel_grid(a.hidden, a.num_tokens), kCombineThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(a.src), a.ld_src, a.route_to_pool, a.num_tokens, static_cast<int>(a.top_k),
      a.hidden, static_cast<__nv_bfloat16*>(a.out), a.ld_out, a.num_rows, device_check_record());
  return cudaGetLastError();
}

void dispatch_rows_host(const DispatchArgs& a) {
  const auto* src = static_cast<const __nv_bfloat16*>(a.src);
  auto* out = static_cast<__nv_bfloat16*>(a.out);
  for (int64_t t = 0; t < a.num_tokens; ++t)
    for (int64_t k = 0; k < a.top_k; ++k) {
      const int32_t row = a.route_to_pool[t * a.top_k + k];
      if (row < 0) continue;
      std::memcpy(out + row * a.ld_out, src + t * a.ld_src, static_cast<size_t>(a.hidden) * sizeof(__nv_bfloat16));
    }
}

int64_t invalid_route(const int32_t* route_to_pool, int64_t count, int64_t num_rows) {
  for (int64_t i = 0; i < count; ++i)
    if (route_to_pool[i] < -1 || route_to_pool[i] >= num_rows) return i;
  return -1;
}

}  // namespace prime_kernels::common
