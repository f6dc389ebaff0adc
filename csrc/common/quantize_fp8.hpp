// The quantizing producers of the blockwise-FP8 recipe (arguments and their checks: quantize_fp8_args.hpp): the CUDA
// launchers and the host loops that compute the same bits on the CPU.
#pragma once

#include <cuda_runtime_api.h>

#include "common/quantize_fp8_args.hpp"

namespace prime_kernels::common {

// The arguments must have passed check_dispatch_rows_fp8_args; the kernel checks the routes.
cudaError_t launch_dispatch_rows_fp8(const DispatchRowsFp8Args& args, cudaStream_t stream);
// Same bits on the CPU; every route must be -1 or a row in [0, num_rows) (invalid_route, combine.hpp).
void dispatch_rows_fp8_host(const DispatchRowsFp8Args& args);

// The arguments must have passed check_quantize_tokens_fp8_args; the kernel checks the pool layout.
cudaError_t launch_quantize_tokens_fp8(const QuantizeTokensFp8Args& args, cudaStream_t stream);
// Same bits on the CPU; the pool layout must have passed quantize_host::check_pool_layout.
void quantize_tokens_fp8_host(const QuantizeTokensFp8Args& args);

// The arguments must have passed check_quantize_weight_fp8_args.
cudaError_t launch_quantize_weight_fp8(const QuantizeWeightFp8Args& args, cudaStream_t stream);
// Same bits on the CPU.
void quantize_weight_fp8_host(const QuantizeWeightFp8Args& args);

// The arguments must have passed check_transpose_tiles_fp8_args.
cudaError_t launch_transpose_tiles_fp8(const TransposeTilesFp8Args& args, cudaStream_t stream);
void transpose_tiles_fp8_host(const TransposeTilesFp8Args& args);

}  // namespace prime_kernels::common
