// C ABI of the routing plan: argument checks, then the CUDA launcher or the host loop.
#include "api/prime_kernels_api.h"
#include "api/errors.hpp"
#include "common/routing_plan.hpp"

namespace {

using prime_kernels::api::fail;
using prime_kernels::common::RoutingPlanArgs;

int check_plan_args(const RoutingPlanArgs& a) {
  PK_CHECK_ARG(a.num_tokens >= 0, "routing_plan: num_tokens must be >= 0, got %lld",
               static_cast<long long>(a.num_tokens));
  PK_CHECK_ARG(a.top_k >= 1, "routing_plan: top_k must be >= 1, got %lld", static_cast<long long>(a.top_k));
  PK_CHECK_ARG(a.num_experts >= 1 && a.num_experts <= prime_kernels::common::routing_plan_max_experts(),
               "routing_plan: num_experts must be in [1, %lld], got %lld",
               static_cast<long long>(prime_kernels::common::routing_plan_max_experts()),
               static_cast<long long>(a.num_experts));
  PK_CHECK_ARG(a.block_m >= 1 && a.block_m <= 1024, "routing_plan: block_m must be in [1, 1024], got %lld",
               static_cast<long long>(a.block_m));
  const int64_t need = pk_routing_plan_pool_capacity(a.num_tokens, a.top_k, a.num_experts, a.block_m);
  PK_CHECK_ARG(need <= INT32_MAX, "routing_plan: the pool needs %lld rows, more than int32 row ids hold; "
               "split the batch", static_cast<long long>(need));
  PK_CHECK_ARG(a.pool_capacity >= need,
               "routing_plan: pool_capacity %lld is too small, need >= %lld (pk_routing_plan_pool_capacity)",
               static_cast<long long>(a.pool_capacity), static_cast<long long>(need));
  PK_CHECK_ARG(a.num_tokens == 0 || a.topk_idx != nullptr, "routing_plan: topk_idx is null");
  PK_CHECK_ARG(a.expert_counts && a.expert_offsets && a.pool_src_route && a.pool_src_rank &&
                   a.num_invalid && (a.num_tokens == 0 || a.route_to_pool),
               "routing_plan: an output pointer is null");
  return PK_OK;
}

RoutingPlanArgs make_args(const void* topk_idx, int is_int64, int64_t num_tokens, int64_t top_k,
                          int64_t num_experts, int64_t block_m, int32_t rank, int32_t* expert_counts,
                          int32_t* expert_offsets, int32_t* pool_src_route, int32_t* pool_src_rank,
                          int64_t pool_capacity, int32_t* route_to_pool, int32_t* num_invalid) {
  return RoutingPlanArgs{topk_idx,       is_int64 != 0,  num_tokens,    top_k,         num_experts,
                         block_m,        rank,           expert_counts, expert_offsets, pool_src_route,
                         pool_src_rank,  pool_capacity,  route_to_pool, num_invalid};
}

}  // namespace

extern "C" {

int64_t pk_routing_plan_pool_capacity(int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                      int64_t block_m) {
  if (num_tokens < 0 || top_k < 1 || num_experts < 1 || block_m < 1) return -1;
  // Every expert wastes at most block_m - 1 padding rows.
  const int64_t rows = num_tokens * top_k + num_experts * (block_m - 1);
  return (rows + block_m - 1) / block_m * block_m;
}

int64_t pk_routing_plan_workspace_bytes(int64_t num_tokens, int64_t top_k, int64_t num_experts) {
  if (num_tokens < 0 || top_k < 1 || num_experts < 1) return -1;
  return prime_kernels::common::routing_plan_workspace_bytes(num_tokens * top_k, num_experts);
}

int pk_routing_plan_cuda(const void* topk_idx, int topk_idx_is_int64, int64_t num_tokens, int64_t top_k,
                         int64_t num_experts, int64_t block_m, int32_t rank, int32_t* expert_counts,
                         int32_t* expert_offsets, int32_t* pool_src_route, int32_t* pool_src_rank,
                         int64_t pool_capacity, int32_t* route_to_pool, int32_t* num_invalid,
                         void* workspace, int64_t workspace_bytes, void* cuda_stream) {
  const RoutingPlanArgs a = make_args(topk_idx, topk_idx_is_int64, num_tokens, top_k, num_experts, block_m,
                                      rank, expert_counts, expert_offsets, pool_src_route, pool_src_rank,
                                      pool_capacity, route_to_pool, num_invalid);
  if (const int rc = prime_kernels::api::check_device_findings("routing_plan"); rc != PK_OK) return rc;
  if (const int rc = check_plan_args(a); rc != PK_OK) return rc;
  const int64_t need = pk_routing_plan_workspace_bytes(num_tokens, top_k, num_experts);
  PK_CHECK_ARG(workspace != nullptr && workspace_bytes >= need,
               "routing_plan: workspace of %lld bytes is too small, need %lld",
               static_cast<long long>(workspace_bytes), static_cast<long long>(need));
  if (const int rc = prime_kernels::api::check_current_device(prime_kernels::api::ArchFamily::kAny); rc != PK_OK)
    return rc;
  const cudaError_t err =
      prime_kernels::common::launch_routing_plan(a, workspace, static_cast<cudaStream_t>(cuda_stream));
  if (err != cudaSuccess) return prime_kernels::api::fail_cuda(err, "routing_plan launch");
  return prime_kernels::api::ok();
}

int pk_routing_plan_cpu(const void* topk_idx, int topk_idx_is_int64, int64_t num_tokens, int64_t top_k,
                        int64_t num_experts, int64_t block_m, int32_t rank, int32_t* expert_counts,
                        int32_t* expert_offsets, int32_t* pool_src_route, int32_t* pool_src_rank,
                        int64_t pool_capacity, int32_t* route_to_pool, int32_t* num_invalid) {
  const RoutingPlanArgs a = make_args(topk_idx, topk_idx_is_int64, num_tokens, top_k, num_experts, block_m,
                                      rank, expert_counts, expert_offsets, pool_src_route, pool_src_rank,
                                      pool_capacity, route_to_pool, num_invalid);
  if (const int rc = check_plan_args(a); rc != PK_OK) return rc;
  prime_kernels::common::routing_plan_host(a);
  return prime_kernels::api::ok();
}

}  // extern "C"
