#include "common/routing_plan.cuh"
#include "common/routing_plan.hpp"

#include <algorithm>
#include <vector>

namespace prime_kernels::common {

int64_t routing_plan_num_chunks(int64_t num_routes) {
  return std::max<int64_t>(1, (num_routes + kRoutesPerChunk - 1) / kRoutesPerChunk);
}

// [chunk, expert] counts, then [chunk] invalid ids.
int64_t routing_plan_workspace_bytes(int64_t num_routes, int64_t num_experts) {
  return routing_plan_num_chunks(num_routes) * (num_experts + 1) * static_cast<int64_t>(sizeof(int32_t));
}

int64_t routing_plan_max_experts() { return kMaxPlanExperts; }

template <typename IdxT>
static cudaError_t launch_typed(const RoutingPlanArgs& a, int32_t* workspace, cudaStream_t stream) {
  const int64_t num_routes = a.num_tokens * a.top_k;
  const int num_chunks = static_cast<int>(routing_plan_num_chunks(num_routes));
  const int num_experts = static_cast<int>(a.num_experts);
  const auto* idx = static_cast<const IdxT*>(a.topk_idx);
  int32_t* chunk_counts = workspace;
  int32_t* chunk_invalid = workspace + static_cast<int64_t>(num_chunks) * num_experts;
  const size_t hist_bytes = sizeof(int32_t) * num_experts;

  routing_count_kernel<IdxT><<<num_chunks, kRoutesPerChunk, hist_bytes, stream>>>(
      idx, num_routes, num_experts, chunk_counts, chunk_invalid);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  routing_scan_kernel<<<num_experts, kPlanScanThreads, 0, stream>>>(chunk_counts, chunk_invalid, num_chunks,
                                                                    num_experts, a.expert_counts, a.num_invalid);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  routing_place_kernel<IdxT><<<num_chunks, kRoutesPerChunk, 2 * hist_bytes + sizeof(int32_t), stream>>>(
      idx, num_routes, num_experts, static_cast<int>(a.block_m), chunk_counts, a.expert_counts, a.rank,
      a.expert_offsets, a.pool_src_route, a.pool_src_rank, a.pool_capacity, a.route_to_pool);
  return cudaGetLastError();
}

cudaError_t launch_routing_plan(const RoutingPlanArgs& a, void* workspace, cudaStream_t stream) {
  auto* ws = static_cast<int32_t*>(workspace);
  return a.topk_idx_is_int64 ? launch_typed<int64_t>(a, ws, stream) : launch_typed<int32_t>(a, ws, stream);
}

void routing_plan_host(const RoutingPlanArgs& a) {
  const int64_t num_routes = a.num_tokens * a.top_k;
  auto expert_of = [&](int64_t r) -> int64_t {
    return a.topk_idx_is_int64 ? static_cast<const int64_t*>(a.topk_idx)[r]
                               : static_cast<const int32_t*>(a.topk_idx)[r];
  };
  int32_t invalid = 0;
  std::fill(a.expert_counts, a.expert_counts + a.num_experts, 0);
  for (int64_t r = 0; r < num_routes; ++r) {
    const int64_t e = expert_of(r);
    if (e < -1 || e >= a.num_experts) ++invalid;
    else if (e >= 0) ++a.expert_counts[e];
  }
  int32_t acc = 0;
  for (int64_t e = 0; e < a.num_experts; ++e) {
    a.expert_offsets[e] = acc;
    acc += static_cast<int32_t>((a.expert_counts[e] + a.block_m - 1) / a.block_m * a.block_m);
  }
  a.expert_offsets[a.num_experts] = acc;
  std::fill(a.pool_src_route, a.pool_src_route + a.pool_capacity, -1);
  std::fill(a.pool_src_rank, a.pool_src_rank + a.pool_capacity, -1);
  std::vector<int32_t> next_row(a.expert_offsets, a.expert_offsets + a.num_experts);
  for (int64_t r = 0; r < num_routes; ++r) {
    const int64_t e = expert_of(r);
    if (e < 0 || e >= a.num_experts) {
      a.route_to_pool[r] = -1;
      continue;
    }
    const int32_t row = next_row[e]++;
    a.pool_src_route[row] = static_cast<int32_t>(r);
    a.pool_src_rank[row] = a.rank;
    a.route_to_pool[r] = row;
  }
  *a.num_invalid = invalid;
}

}  // namespace prime_kernels::common
