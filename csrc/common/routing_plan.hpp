// Host-side view of the routing plan: one struct shared by the CUDA launcher and the CPU path.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace prime_kernels::common {

struct RoutingPlanArgs {
  const void* topk_idx;
  bool topk_idx_is_int64;
  int64_t num_tokens;
  int64_t top_k;
  int64_t num_experts;
  int64_t block_m;
  int32_t rank;
  int32_t* expert_counts;    // [num_experts]
  int32_t* expert_offsets;   // [num_experts + 1]
  int32_t* pool_src_route;   // [pool_capacity]
  int32_t* pool_src_rank;    // [pool_capacity]
  int64_t pool_capacity;
  int32_t* route_to_pool;    // [num_tokens * top_k]
  int32_t* num_invalid;      // [1]
};

int64_t routing_plan_num_chunks(int64_t num_routes);
int64_t routing_plan_workspace_bytes(int64_t num_routes, int64_t num_experts);
int64_t routing_plan_max_experts();

// Launches the three plan kernels on `stream`. `workspace` holds routing_plan_workspace_bytes().
cudaError_t launch_routing_plan(const RoutingPlanArgs& args, void* workspace, cudaStream_t stream);

// The same plan on the host, same order; the CPU kernel of the torch op and the tests' oracle.
void routing_plan_host(const RoutingPlanArgs& args);

}  // namespace prime_kernels::common
