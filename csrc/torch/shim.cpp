// The LibTorch stable-ABI shim: registers torch.ops.deep_gemm.* and forwards to the C ABI core.
//
// Built against the stable headers with TORCH_TARGET_VERSION = 2.10, so one binary loads on every
// torch >= 2.10. It links libtorch_cpu only; the current CUDA stream comes from libtorch_cuda,
// looked up when a CUDA op first runs, so a CPU-only torch can still load this library.
#include <dlfcn.h>

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "api/deep_gemm_api.h"

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

// Raises the core's message as a Python RuntimeError.
void check_core(int rc, const char* op) {
  STD_TORCH_CHECK(rc == PK_OK, "deep_gemm.", op, ": ", pk_last_error());
}

void* current_cuda_stream(int32_t device_index) {
  using Getter = int32_t (*)(int32_t, void**);
  static Getter getter = []() -> Getter {
    void* lib = dlopen("libtorch_cuda.so", RTLD_LAZY | RTLD_NOLOAD);
    return lib ? reinterpret_cast<Getter>(dlsym(lib, "aoti_torch_get_current_cuda_stream")) : nullptr;
  }();
  STD_TORCH_CHECK(getter != nullptr,
                  "deep_gemm: this torch build has no CUDA support (libtorch_cuda is not loaded)");
  void* stream = nullptr;
  STD_TORCH_CHECK(getter(device_index, &stream) == 0, "deep_gemm: could not get the current CUDA stream");
  return stream;
}

struct PlanInput {
  int64_t num_tokens;
  int64_t top_k;
  bool is_int64;
};

PlanInput check_plan_input(const Tensor& topk_idx, int64_t num_experts, int64_t block_m) {
  STD_TORCH_CHECK(topk_idx.dim() == 2, "deep_gemm.routing_plan: topk_idx must be 2-D [num_tokens, top_k], got ",
                  topk_idx.dim(), "-D");
  const ScalarType dt = topk_idx.scalar_type();
  STD_TORCH_CHECK(dt == ScalarType::Long || dt == ScalarType::Int,
                  "deep_gemm.routing_plan: topk_idx must be int64 or int32");
  STD_TORCH_CHECK(topk_idx.is_contiguous(), "deep_gemm.routing_plan: topk_idx must be contiguous");
  STD_TORCH_CHECK(num_experts >= 1, "deep_gemm.routing_plan: num_experts must be >= 1");
  STD_TORCH_CHECK(block_m >= 1, "deep_gemm.routing_plan: block_m must be >= 1");
  return PlanInput{topk_idx.size(0), topk_idx.size(1), dt == ScalarType::Long};
}

using PlanOutputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

PlanOutputs allocate_plan(const Tensor& like, const PlanInput& in, int64_t num_experts, int64_t block_m) {
  const int64_t capacity = pk_routing_plan_pool_capacity(in.num_tokens, in.top_k, num_experts, block_m);
  STD_TORCH_CHECK(capacity >= 0, "deep_gemm.routing_plan: invalid sizes");
  auto i32 = [&](std::vector<int64_t> sizes) {
    return torch::stable::new_empty(like, torch::headeronly::IntHeaderOnlyArrayRef(sizes.data(), sizes.size()),
                                    ScalarType::Int);
  };
  return {i32({num_experts}), i32({num_experts + 1}), i32({capacity}), i32({capacity}),
          i32({in.num_tokens, in.top_k}), i32({1})};
}

PlanOutputs routing_plan_cpu(Tensor topk_idx, int64_t num_experts, int64_t block_m, int64_t rank) {
  const PlanInput in = check_plan_input(topk_idx, num_experts, block_m);
  PlanOutputs out = allocate_plan(topk_idx, in, num_experts, block_m);
  auto& [counts, offsets, src_route, src_rank, route_to_pool, num_invalid] = out;
  check_core(pk_routing_plan_cpu(topk_idx.data_ptr(), in.is_int64, in.num_tokens, in.top_k, num_experts, block_m,
                                 static_cast<int32_t>(rank), static_cast<int32_t*>(counts.data_ptr()),
                                 static_cast<int32_t*>(offsets.data_ptr()),
                                 static_cast<int32_t*>(src_route.data_ptr()),
                                 static_cast<int32_t*>(src_rank.data_ptr()), src_route.numel(),
                                 static_cast<int32_t*>(route_to_pool.data_ptr()),
                                 static_cast<int32_t*>(num_invalid.data_ptr())),
             "routing_plan");
  return out;
}

PlanOutputs routing_plan_cuda(Tensor topk_idx, int64_t num_experts, int64_t block_m, int64_t rank) {
  const PlanInput in = check_plan_input(topk_idx, num_experts, block_m);
  const int32_t device = topk_idx.get_device_index();
  torch::stable::accelerator::DeviceGuard guard(device);
  PlanOutputs out = allocate_plan(topk_idx, in, num_experts, block_m);
  auto& [counts, offsets, src_route, src_rank, route_to_pool, num_invalid] = out;
  const int64_t ws_bytes = pk_routing_plan_workspace_bytes(in.num_tokens, in.top_k, num_experts);
  STD_TORCH_CHECK(ws_bytes >= 0, "deep_gemm.routing_plan: invalid sizes");
  std::vector<int64_t> ws_size{(ws_bytes + 3) / 4};
  Tensor workspace = torch::stable::new_empty(
      topk_idx, torch::headeronly::IntHeaderOnlyArrayRef(ws_size.data(), ws_size.size()), ScalarType::Int);
  check_core(pk_routing_plan_cuda(topk_idx.data_ptr(), in.is_int64, in.num_tokens, in.top_k, num_experts, block_m,
                                  static_cast<int32_t>(rank), static_cast<int32_t*>(counts.data_ptr()),
                                  static_cast<int32_t*>(offsets.data_ptr()),
                                  static_cast<int32_t*>(src_route.data_ptr()),
                                  static_cast<int32_t*>(src_rank.data_ptr()), src_route.numel(),
                                  static_cast<int32_t*>(route_to_pool.data_ptr()),
                                  static_cast<int32_t*>(num_invalid.data_ptr()), workspace.data_ptr(),
                                  workspace.numel() * 4, current_cuda_stream(device)),
             "routing_plan");
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY(deep_gemm, m) {
  m.def(
      "routing_plan(Tensor topk_idx, int num_experts, int block_m, int rank=0) -> "
      "(Tensor expert_counts, Tensor expert_offsets, Tensor pool_src_route, Tensor pool_src_rank, "
      "Tensor route_to_pool, Tensor num_invalid)");
}

STABLE_TORCH_LIBRARY_IMPL(deep_gemm, CPU, m) { m.impl("routing_plan", TORCH_BOX(&routing_plan_cpu)); }

STABLE_TORCH_LIBRARY_IMPL(deep_gemm, CUDA, m) { m.impl("routing_plan", TORCH_BOX(&routing_plan_cuda)); }
