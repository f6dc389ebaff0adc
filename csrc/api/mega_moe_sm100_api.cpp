// C ABI of the sm_100a BF16 fused MoE forward (csrc/sm100/mega_moe_sm100.hpp has the contract). Never
// run: no Blackwell GPU exists for this project, so a caller runs it only after it has matched the grouped backend
// on the device at hand.
//
// The parameter list is pk_mega_moe_fwd_bf16's, so that a caller holding the sm90 call's arguments calls either;
// what this kernel does not support is refused with PK_ERR_INVALID_ARGUMENT before anything is launched:
// num_ranks must be 1 and pool_src_rank null (no expert parallelism yet). route_to_pool and counters are accepted
// and unused (no token-major dispatch; L1 and L2 are separate launches, so no cross-CTA counters); num_sms (>= 0)
// bounds the persistent launches' grids. Invalid plan values found on the device are reported by the next call into the library, as in the sm90
// forward. Declared in api/prime_kernels_api.h.
#include "api/errors.hpp"
#include "api/prime_kernels_api.h"
#include "sm100/mega_moe_sm100.hpp"

extern "C" {

PK_API int pk_mega_moe_fwd_bf16_sm100(const void* const* x_ranks, int num_ranks, int64_t ld_x,
                                      const int32_t* pool_src_route, const int32_t* pool_src_rank, int top_k,
                                      const int32_t* expert_offsets, int num_experts, int64_t m_total, int64_t hidden,
                                      int64_t inter, const void* w13, const void* w2, void* x_pool, void* s, void* h,
                                      void* o, int64_t num_tokens, const int32_t* route_to_pool, float clamp,
                                      int32_t* counters, int num_sms, void* cuda_stream) {
  (void)route_to_pool, (void)counters;
#if PK_HAS_SM100_KERNELS
  if (const int rc = prime_kernels::api::check_device_findings("mega_moe_fwd_bf16_sm100"); rc != PK_OK) return rc;
  PK_CHECK_ARG(num_ranks == 1 && x_ranks != nullptr,
               "mega_moe_fwd_bf16_sm100: num_ranks = %d, the sm100 forward takes one rank (x_ranks[0])", num_ranks);
  PK_CHECK_ARG(pool_src_rank == nullptr, "mega_moe_fwd_bf16_sm100: pool_src_rank must be null (one rank)");
  PK_CHECK_ARG(num_sms >= 0, "mega_moe_fwd_bf16_sm100: num_sms = %d, must be >= 0", num_sms);
  if (const int rc = prime_kernels::api::check_current_device(prime_kernels::api::ArchFamily::kSm100); rc != PK_OK)
    return rc;
  prime_kernels::sm100::MegaFwdSm100Args args;
  static_cast<prime_kernels::common::MegaFwdCommonArgs&>(args) = prime_kernels::common::mega_fwd_common_args(
      ld_x, pool_src_route, top_k, expert_offsets, num_experts, m_total, hidden, inter, w13, w2, x_pool, s, h, o,
      num_tokens, clamp, num_sms);
  args.x = x_ranks[0];
  char message[512] = {0};
  const int rc = prime_kernels::sm100::mega_moe_fwd_bf16_sm100(args, static_cast<cudaStream_t>(cuda_stream), message,
                                                               sizeof(message));
  return prime_kernels::api::from_status(rc, message);
#else
  (void)x_ranks, (void)num_ranks, (void)ld_x, (void)pool_src_route, (void)pool_src_rank, (void)top_k;
  (void)expert_offsets, (void)num_experts, (void)m_total, (void)hidden, (void)inter, (void)w13, (void)w2;
  (void)x_pool, (void)s, (void)h, (void)o, (void)num_tokens, (void)clamp, (void)num_sms, (void)cuda_stream;
  return prime_kernels::api::fail(PK_ERR_NOT_AVAILABLE,
                                  "mega_moe_fwd_bf16_sm100 is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS "
                                  "including 100a");
#endif
}

}  // extern "C"
