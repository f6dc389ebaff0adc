// prime-kernels: the host preparation of an sm90a L2 dgrad with the SwiGLU backward (checks, tensor maps, kernel
// parameters), shared by m_grouped_bf16_gemm_swiglu_bwd (grouped_gemm.cu) and the fused backward's dgrad kernel
// (mega_moe_bwd.cu). Host code over the kernels' parameter struct: included by .cu files only.
#pragma once

#include <cuda.h>

#include "grouped_gemm.hpp"
#include "m_grouped_gemm.cuh"

namespace prime_kernels {
namespace sm90 {

// The checked launch state: the tensor maps (dy_pool, w2 MN-major, h, dh, w * s), the kernel parameters and the
// grid cap (the device's SMs, capped by num_sms).
struct SwigluBwdLaunch {
  CUtensorMap a, b, h, dh, aw;
  MGroupedParams p;
  int sms;
};

// kGemmOk with `out` filled, or a status code with err set; for m_total == 0 it returns kGemmOk without maps.
int prepare_swiglu_bwd(const SwigluBwdGemmArgs& args, const char* fn, SwigluBwdLaunch* out, char* err,
                       size_t err_len);

}  // namespace sm90
}  // namespace prime_kernels
