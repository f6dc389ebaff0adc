// SwiGLU over pool rows, forward and backward, for the grouped pipeline (reference F2-F3, B3-B6, B9).
//
// h [rows, 2I] holds gate | up per pool row. Only rows below *num_rows (a device scalar: the pool
// rows in use, so no host sync; clamped to the rows allocated) are touched. One block per row (grid-stride), each thread 8
// consecutive columns per step; the backward's per-row dot product is reduced in a fixed order
// (per-thread partials, then a fixed shuffle tree, then warps in order), so it is deterministic.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/bf16x8.cuh"
#include "common/device_check.hpp"

namespace prime_kernels::common {

constexpr int kSwigluThreads = 128;

struct SwigluMath {
  float clamp;  // <= 0 or NaN: no clamp (has_clamp says which)
  bool has_clamp;

  __device__ __forceinline__ float gate(float g) const { return has_clamp ? fminf(g, clamp) : g; }
  __device__ __forceinline__ float up(float u) const { return has_clamp ? fminf(fmaxf(u, -clamp), clamp) : u; }
};

__device__ __forceinline__ void load_bf16x8(const __nv_bfloat16* p, float (&v)[8]) {
  bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(p)), v);
}

__device__ __forceinline__ void store_bf16x8(__nv_bfloat16* p, const float (&v)[8]) {
  uint4 raw;
  __nv_bfloat162* h2 = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h2[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// s = bf16(silu(gate_c) * up_c)
__global__ void __launch_bounds__(kSwigluThreads)
swiglu_fwd_kernel(const __nv_bfloat16* __restrict__ h, int64_t ld_h, __nv_bfloat16* __restrict__ s, int64_t ld_s,
                  int64_t inter, const int32_t* __restrict__ num_rows, int64_t max_rows, SwigluMath m) {
  const int64_t rows = min(max(static_cast<int64_t>(__ldg(num_rows)), int64_t(0)), max_rows);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const __nv_bfloat16* hr = h + r * ld_h;
    for (int64_t c = threadIdx.x * 8; c < inter; c += kSwigluThreads * 8) {
      float g[8], u[8], out[8];
      load_bf16x8(hr + c, g);
      load_bf16x8(hr + inter + c, u);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float gc = m.gate(g[i]);
        out[i] = gc * sigmoidf_(gc) * m.up(u[i]);
      }
      store_bf16x8(s + r * ld_s + c, out);
    }
  }
}

// For pool row r with weight w = topk_weights[pool_src_route[r]] (0 for padding rows, route -1; a route outside
// [0, num_routes) also gets 0 and is noted in the device-check record):
//   dt[r] = sum_i da*s;  ds = w*da;  dg = ds*uc*sig*(1+gc*(1-sig)) * [g < c];  du = ds*silu * [-c < u < c]
//   dh = bf16([dg, du]);  a = bf16(w*s)      (s = silu(gc)*uc in fp32, not rounded)
__global__ void __launch_bounds__(kSwigluThreads)
swiglu_bwd_kernel(const __nv_bfloat16* __restrict__ h, int64_t ld_h, const __nv_bfloat16* __restrict__ da,
                  int64_t ld_da, const int32_t* __restrict__ pool_src_route, const float* __restrict__ topk_weights,
                  int64_t num_routes, int64_t inter, const int32_t* __restrict__ num_rows, int64_t max_rows,
                  SwigluMath m, __nv_bfloat16* __restrict__ dh, int64_t ld_dh, __nv_bfloat16* __restrict__ a,
                  int64_t ld_a, float* __restrict__ dt, DeviceCheckRecord* check) {
  __shared__ float warp_sums[kSwigluThreads / 32];
  const int64_t rows = min(max(static_cast<int64_t>(__ldg(num_rows)), int64_t(0)), max_rows);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t route = __ldg(pool_src_route + r);
    const bool routed = route >= 0 && route < num_routes;
    if (threadIdx.x == 0 && (route < -1 || route >= num_routes))
      report_device_check(check, kCheckPoolRoute, route, num_routes);
    const float w = routed ? __ldg(topk_weights + route) : 0.0f;
    const __nv_bfloat16* hr = h + r * ld_h;
    float partial = 0.0f;
    for (int64_t c = threadIdx.x * 8; c < inter; c += kSwigluThreads * 8) {
      float g[8], u[8], d[8], dg[8], du[8], av[8];
      load_bf16x8(hr + c, g);
      load_bf16x8(hr + inter + c, u);
      load_bf16x8(da + r * ld_da + c, d);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float gc = m.gate(g[i]);
        const float uc = m.up(u[i]);
        const float sig = sigmoidf_(gc);
        const float silu = gc * sig;
        const float s = silu * uc;
        partial = fmaf(d[i], s, partial);
        const float ds = w * d[i];
        dg[i] = ds * uc * sig * (1.0f + gc * (1.0f - sig));
        du[i] = ds * silu;
        if (m.has_clamp) {
          dg[i] = g[i] < m.clamp ? dg[i] : 0.0f;
          du[i] = (u[i] > -m.clamp && u[i] < m.clamp) ? du[i] : 0.0f;
        }
        av[i] = w * s;
      }
      store_bf16x8(dh + r * ld_dh + c, dg);
      store_bf16x8(dh + r * ld_dh + inter + c, du);
      store_bf16x8(a + r * ld_a + c, av);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) partial += __shfl_xor_sync(0xffffffffu, partial, off);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = partial;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.0f;
#pragma unroll
      for (int i = 0; i < kSwigluThreads / 32; ++i) total += warp_sums[i];
      dt[r] = routed ? total : 0.0f;
    }
    __syncthreads();
  }
}

}  // namespace prime_kernels::common
