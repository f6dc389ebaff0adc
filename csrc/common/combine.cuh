// Combine: y[t] = round_bf16( sum_{k in 0..K-1, in order} w[t,k] * slot[route_to_pool[t,k]] ).
// Dispatch, its transpose: out[route_to_pool[t,k]] = src[t] for every route (the backward's dy pool rows).
//
// The deterministic reduction of the forward (F5: fp32 top-k weights, fp32 sum in increasing k) and,
// with no weights, of the backward's per-route dx slots (B8). Masked routes (row -1) add nothing;
// a token with every route masked gets zeros. A route outside [0, num_rows) is skipped as well (never read) and
// noted in the device-check record (common/device_check.hpp). Memory-bound: one block row per token (grid-stride),
// each thread owns 8 consecutive columns (one 16-byte load per slot row), so a thread reads the columns
// [col, col + 8) < hidden of the rows its token's routes name and nothing else.
//
// compute-sanitizer initcheck reports these loads as reads of uninitialised memory when the slots were written by
// TMA (cp.async.bulk.tensor) stores, as the grouped GEMMs' and the fused forward's outputs are: the tool does not
// see bulk-tensor stores. Seen on the H200 with the caching allocator off: every element of an m-grouped GEMM's
// output that a TMA store wrote (full 64-row halves) is reported when a torch kernel copies it, the rows its
// 16-byte stores wrote (a group's last partial half) are not; and the combine's reports equal exactly its route
// loads (32 per route row at H = 256), none outside them.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/combine_math.cuh"
#include "common/device_check.hpp"

namespace prime_kernels::common {

constexpr int kCombineThreads = 256;

// Grid: x = ceil(H / 8 / kCombineThreads) column chunks, y = tokens (grid-stride).
__global__ void __launch_bounds__(kCombineThreads)
combine_bf16_kernel(const __nv_bfloat16* __restrict__ slots, int64_t ld_slots, int64_t num_rows,
                    const int32_t* __restrict__ route_to_pool, const float* __restrict__ weights,
                    int64_t num_tokens, int top_k, int64_t hidden, __nv_bfloat16* __restrict__ out,
                    int64_t ld_out, DeviceCheckRecord* check) {
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kCombineThreads + threadIdx.x) * 8;
  if (col >= hidden) return;
  for (int64_t t = blockIdx.y; t < num_tokens; t += gridDim.y) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int k = 0; k < top_k; ++k) {
      const int32_t row = __ldg(route_to_pool + t * top_k + k);
      if (row < 0 || row >= num_rows) {
        if ((row < -1 || row >= num_rows) && col == 0) report_device_check(check, kCheckCombineRoute, row, num_rows);
        continue;
      }
      const float w = weights != nullptr ? __ldg(weights + t * top_k + k) : 1.0f;
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(slots + row * ld_slots + col));
      add_bf16x8(acc, v, w);
    }
    uint4 packed;
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    *reinterpret_cast<uint4*>(out + t * ld_out + col) = packed;
  }
}

// Dispatch: every token row is read once and written to each of its routes' pool rows. Token-major, so a
// row is read from HBM once (a pool-row-major gather re-reads rows that fell out of L2: 0.26 vs 0.17 ms for
// 30B, T=16384 on the H200, the latter the card's fill rate). Routes of -1 write
// nothing; a route outside [0, num_rows) writes nothing either and is noted in the device-check record. Same grid
// as the combine.
__global__ void __launch_bounds__(kCombineThreads)
dispatch_rows_bf16_kernel(const __nv_bfloat16* __restrict__ src, int64_t ld_src,
                          const int32_t* __restrict__ route_to_pool, int64_t num_tokens, int top_k, int64_t hidden,
                          __nv_bfloat16* __restrict__ out, int64_t ld_out, int64_t num_rows,
                          DeviceCheckRecord* check) {
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kCombineThreads + threadIdx.x) * 8;
  if (col >= hidden) return;
  for (int64_t t = blockIdx.y; t < num_tokens; t += gridDim.y) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(src + t * ld_src + col));
    for (int k = 0; k < top_k; ++k) {
      const int32_t row = __ldg(route_to_pool + t * top_k + k);
      if (row >= 0 && row < num_rows)
        *reinterpret_cast<uint4*>(out + row * ld_out + col) = v;
      else if (row != -1 && col == 0)
        report_device_check(check, kCheckDispatchRoute, row, num_rows);
    }
  }
}

}  // namespace prime_kernels::common
