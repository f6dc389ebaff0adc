// prime-kernels: host launch of the sm_100a BF16 fused MoE forward (csrc/sm100/mega_moe_fwd_sm100.cuh).
//
// Plain C++ over raw device pointers, the conventions of csrc/sm90/mega_moe.hpp (sm90/status.hpp's codes, err
// message, asynchronous on `stream`, every argument checked before the device is touched). The arguments are the
// single-rank subset of sm90::MegaFwdArgs, their common base, so the same host routing plan drives both; what this
// kernel does not support is rejected, not ignored.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/mega_fwd_args.hpp"
#include "sm90/status.hpp"

namespace prime_kernels {
namespace sm100 {

// The fields of common::MegaFwdCommonArgs (common/mega_fwd_args.hpp) and the token rows. Here o may be x_pool
// because the L1 launch gathers its rows from x, not from x_pool: when o is x_pool the dispatched rows are never
// written.
struct MegaFwdSm100Args : common::MegaFwdCommonArgs {
  // bf16 token rows [num_tokens, hidden], row stride ld_x; may be null when num_tokens is 0 (ld_x is then not
  // checked)
  const void* x = nullptr;
};

// On `stream`: the dispatch of x_pool (only when o is not x_pool), the persistent L1 + SwiGLU launch (its A rows
// gathered from x), the persistent L2 launch. All pointers 16-byte aligned.
int mega_moe_fwd_bf16_sm100(const MegaFwdSm100Args& args, cudaStream_t stream, char* err, size_t err_len);

}  // namespace sm100
}  // namespace prime_kernels
