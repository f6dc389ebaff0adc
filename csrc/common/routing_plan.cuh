// Routing plan kernels: topk_idx -> expert-grouped pool (stable (expert, token, k) order).
//
// Three launches, all deterministic (no order-dependent atomics):
//   1. count:  each chunk of kRoutesPerChunk routes counts its routes per expert.
//   2. scan:   one block turns the [chunk, expert] counts into each chunk's first pool row per
//              expert, the expert counts and the block_m-padded expert offsets; fills padding rows.
//   3. place:  each chunk walks its routes warp by warp, in route order, and writes both maps.
// Route r = token * top_k + k, so route order is (token, k) order and the pool is stable.
#pragma once

#include <cstdint>

namespace deep_gemm::common {

constexpr int kRoutesPerChunk = 256;   // one thread per route in the count/place blocks
constexpr int kPlanScanThreads = 1024;
constexpr int kMaxPlanExperts = 4096;  // shared-memory histogram bound (16 KiB)

// Chunk-axis slices per expert in the scan (one thread each): as many as fill the block, at least 1.
__host__ __device__ inline int routing_scan_slices(int num_experts) {
  const int s = kPlanScanThreads / (num_experts > 0 ? num_experts : 1);
  return s > 0 ? s : 1;
}

template <typename IdxT>
__device__ __forceinline__ int load_expert(const IdxT* topk_idx, int64_t route, int64_t num_routes,
                                           int num_experts, int* num_invalid) {
  if (route >= num_routes) return -1;
  const int64_t e = static_cast<int64_t>(topk_idx[route]);
  if (e < -1 || e >= num_experts) {
    atomicAdd(num_invalid, 1);  // a count, not a float: order cannot change the result
    return -1;
  }
  return static_cast<int>(e);
}

template <typename IdxT>
__global__ void __launch_bounds__(kRoutesPerChunk)
routing_count_kernel(const IdxT* __restrict__ topk_idx, int64_t num_routes, int num_experts,
                     int32_t* __restrict__ chunk_counts, int32_t* __restrict__ num_invalid) {
  extern __shared__ int32_t hist[];
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t route = static_cast<int64_t>(blockIdx.x) * kRoutesPerChunk + threadIdx.x;
  const int e = load_expert(topk_idx, route, num_routes, num_experts, num_invalid);
  if (e >= 0) atomicAdd(&hist[e], 1);
  __syncthreads();
  int32_t* out = chunk_counts + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int i = threadIdx.x; i < num_experts; i += blockDim.x) out[i] = hist[i];
}

// Exclusive scan of one int per thread over the whole block (blockDim.x a multiple of 32, at most 1024);
// warp_sums: 33 ints of shared memory. Returns the thread's exclusive prefix; *total gets the block's sum.
__device__ __forceinline__ int32_t block_exclusive_scan(int32_t v, int32_t* warp_sums, int32_t* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;
  int32_t incl = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int32_t up = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += up;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int32_t w = lane < num_warps ? warp_sums[lane] : 0;
    int32_t wincl = w;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int32_t up = __shfl_up_sync(0xffffffffu, wincl, d);
      if (lane >= d) wincl += up;
    }
    warp_sums[lane] = wincl - w;  // exclusive prefix of warp `lane`
    if (lane == 31) warp_sums[32] = wincl;
  }
  __syncthreads();
  const int32_t out = warp_sums[warp] + incl - v;
  *total = warp_sums[32];
  __syncthreads();  // warp_sums may be reused by the caller
  return out;
}

// One block. The [chunk, expert] counts become exclusive prefixes per expert in two passes over the chunk
// axis, split into routing_scan_slices() slices per expert (thread = (slice, expert), expert fastest: coalesced rows) so
// that no thread walks all chunks with a dependent load per chunk (a single pass per expert took ~65 us
// at 131072 routes and 128 experts). The expert offsets are a block-wide shuffle scan, and the padding rows
// are written by all warps at once (a serial scan by one thread and a per-expert loop reading the counts
// back from global memory took ~20 of the kernel's 29 us at that size).
__global__ void __launch_bounds__(kPlanScanThreads)
routing_scan_kernel(int32_t* __restrict__ chunk_counts, int num_chunks, int num_experts, int block_m,
                    int32_t* __restrict__ expert_counts, int32_t* __restrict__ expert_offsets,
                    int32_t* __restrict__ pool_src_route, int32_t* __restrict__ pool_src_rank,
                    int64_t pool_capacity) {
  // [num_experts + 1] offsets (the counts until the scan), then the slice sums [slices * num_experts], whose
  // first num_experts entries keep the counts once the chunk passes are done
  extern __shared__ int32_t padded[];
  int32_t* slice_sum = padded + num_experts + 1;
  int32_t* counts = slice_sum;
  __shared__ int32_t warp_sums[33];
  const int slices = routing_scan_slices(num_experts);
  const int per_slice = (num_chunks + slices - 1) / slices;
  for (int task = threadIdx.x; task < slices * num_experts; task += blockDim.x) {
    const int e = task % num_experts;
    const int c0 = (task / num_experts) * per_slice;
    const int c1 = min(num_chunks, c0 + per_slice);
    int32_t sum = 0;
#pragma unroll 8
    for (int c = c0; c < c1; ++c) sum += chunk_counts[static_cast<int64_t>(c) * num_experts + e];
    slice_sum[task] = sum;
  }
  __syncthreads();
  for (int task = threadIdx.x; task < slices * num_experts; task += blockDim.x) {
    const int e = task % num_experts;
    const int slice = task / num_experts;
    int32_t running = 0, total = 0;
    for (int s2 = 0; s2 < slices; ++s2) {
      const int32_t v = slice_sum[s2 * num_experts + e];
      running += s2 < slice ? v : 0;
      total += v;
    }
    const int c0 = slice * per_slice;
    const int c1 = min(num_chunks, c0 + per_slice);
#pragma unroll 8
    for (int c = c0; c < c1; ++c) {
      int32_t* cell = chunk_counts + static_cast<int64_t>(c) * num_experts + e;
      const int32_t n = *cell;
      *cell = running;  // exclusive prefix within the expert; the expert offset is added in `place`
      running += n;
    }
    if (slice == 0) {
      expert_counts[e] = total;
      padded[e] = total;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = padded[e];
  __syncthreads();
  // Exclusive scan of the padded sizes: each thread sums a contiguous run of experts, one block scan of the
  // runs, then each thread writes its run's offsets.
  const int per_thread = (num_experts + blockDim.x - 1) / blockDim.x;
  const int begin = min(num_experts, static_cast<int>(threadIdx.x) * per_thread);
  const int end = min(num_experts, begin + per_thread);
  int32_t local = 0;
  for (int e = begin; e < end; ++e) local += (counts[e] + block_m - 1) / block_m * block_m;
  int32_t all = 0;
  int32_t acc = block_exclusive_scan(local, warp_sums, &all);
  for (int e = begin; e < end; ++e) {
    padded[e] = acc;
    acc += (counts[e] + block_m - 1) / block_m * block_m;
  }
  if (threadIdx.x == 0) padded[num_experts] = all;
  __syncthreads();
  for (int e = threadIdx.x; e <= num_experts; e += blockDim.x) expert_offsets[e] = padded[e];
  // Padding rows inside each expert's range (fewer than block_m each: a warp per expert, a lane per row),
  // then everything past the last expert.
  const int lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  for (int e = threadIdx.x / 32; e < num_experts; e += num_warps) {
    for (int64_t row = static_cast<int64_t>(padded[e]) + counts[e] + lane; row < padded[e + 1]; row += 32) {
      pool_src_route[row] = -1;
      pool_src_rank[row] = -1;
    }
  }
  for (int64_t row = padded[num_experts] + threadIdx.x; row < pool_capacity; row += blockDim.x) {
    pool_src_route[row] = -1;
    pool_src_rank[row] = -1;
  }
}

template <typename IdxT>
__global__ void __launch_bounds__(kRoutesPerChunk)
routing_place_kernel(const IdxT* __restrict__ topk_idx, int64_t num_routes, int num_experts,
                     const int32_t* __restrict__ chunk_base, const int32_t* __restrict__ expert_offsets,
                     int32_t rank, int32_t* __restrict__ pool_src_route,
                     int32_t* __restrict__ pool_src_rank, int32_t* __restrict__ route_to_pool) {
  extern __shared__ int32_t next_row[];  // [num_experts]: next free pool row of this chunk
  const int32_t* base = chunk_base + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) next_row[e] = expert_offsets[e] + base[e];
  __syncthreads();
  const int64_t route = static_cast<int64_t>(blockIdx.x) * kRoutesPerChunk + threadIdx.x;
  int e = -1;
  if (route < num_routes) {
    const int64_t raw = static_cast<int64_t>(topk_idx[route]);
    e = (raw >= 0 && raw < num_experts) ? static_cast<int>(raw) : -1;
  }
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const int rank_in_warp = __popc(peers & ((1u << lane) - 1u));
  const bool is_last_peer = (peers >> lane) == 1u;
  // Warps take turns so that earlier routes get earlier rows.
  for (int w = 0; w < kRoutesPerChunk / 32; ++w) {
    if (warp == w) {
      const int32_t row = e >= 0 ? next_row[e] + rank_in_warp : -1;
      __syncwarp();  // every lane has read next_row before the last peer advances it
      if (e >= 0) {
        if (is_last_peer) next_row[e] += __popc(peers);
        pool_src_route[row] = static_cast<int32_t>(route);
        pool_src_rank[row] = rank;
        route_to_pool[route] = row;
      }
    }
    __syncthreads();
  }
  if (route < num_routes && e < 0) route_to_pool[route] = -1;
}

}  // namespace deep_gemm::common
