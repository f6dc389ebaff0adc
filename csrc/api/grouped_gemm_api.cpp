// C ABI of the sm90 kernels (grouped GEMMs, fused Mega MoE forward): device check, then the sm90 launchers (which validate shapes).
#include "api/deep_gemm_api.h"
#include "api/errors.hpp"
#include "common/device_check.hpp"

#if PK_HAS_SM90_KERNELS
#include "sm90/grouped_gemm.hpp"
#endif
#include "sm90/mega_moe.hpp"  // header-only sizes, also without the kernels

namespace {

// What an earlier kernel found invalid on the device (reported once, before this call launches anything), then
// the device check.
int current_device_is_sm90(const char* op) {
  char found[1024];
  if (deep_gemm::common::take_device_checks(found, sizeof(found)))
    return deep_gemm::api::fail(PK_ERR_INVALID_ARGUMENT,
                                "%s: not run, since an earlier launch found invalid values on the device (its "
                                "outputs are not what was asked for): %s",
                                op, found);
  return deep_gemm::api::check_current_device(deep_gemm::api::ArchFamily::kSm90);
}

#if PK_HAS_SM90_KERNELS
int from_sm90(int rc, const char* message) {
  switch (rc) {
    case 0: return deep_gemm::api::ok();
    case 1: return deep_gemm::api::fail(PK_ERR_INVALID_ARGUMENT, "%s", message);
    case 2: return deep_gemm::api::fail(PK_ERR_NOT_AVAILABLE, "%s", message);
    case 3: return deep_gemm::api::fail(PK_ERR_CUDA, "%s", message);
    default: return deep_gemm::api::fail(PK_ERR_INTERNAL, "%s", message);
  }
}
#endif

}  // namespace

extern "C" {

int pk_m_grouped_bf16_gemm(const void* a, int64_t lda, const void* b, int b_k_major, int64_t ldb,
                           int64_t b_group_stride, void* d, int64_t ldd, const int32_t* group_offsets,
                           int num_groups, int64_t m_total, int64_t n, int64_t k, int num_sms, void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = current_device_is_sm90("m_grouped_bf16_gemm"); rc != PK_OK) return rc;
  PK_CHECK_ARG(num_sms >= 0, "m_grouped_bf16_gemm: num_sms = %d, must be >= 0 (0 = every SM)", num_sms);
  deep_gemm::sm90::GroupedGemmConfig cfg = deep_gemm::sm90::m_grouped_gemm_config(m_total, n, k, num_groups);
  cfg.num_sms = num_sms;
  char message[512] = {0};
  const int rc = deep_gemm::sm90::m_grouped_bf16_gemm(a, lda, b, b_k_major != 0, ldb, b_group_stride, d, ldd,
                                                      group_offsets, num_groups, m_total, n, k, &cfg,
                                                      static_cast<cudaStream_t>(cuda_stream), message,
                                                      sizeof(message));
  return from_sm90(rc, message);
#else
  (void)a, (void)lda, (void)b, (void)b_k_major, (void)ldb, (void)b_group_stride, (void)d, (void)ldd;
  (void)group_offsets, (void)num_groups, (void)m_total, (void)n, (void)k, (void)num_sms, (void)cuda_stream;
  return deep_gemm::api::fail(PK_ERR_NOT_AVAILABLE,
                              "m_grouped_bf16_gemm is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a");
#endif
}

int pk_m_grouped_bf16_gemm_gather_a(const void* a, int64_t lda, int64_t a_rows, const int32_t* a_row_index,
                                    const void* b, int b_k_major, int64_t ldb, int64_t b_group_stride, void* d,
                                    int64_t ldd, const int32_t* group_offsets, int num_groups, int64_t m_total,
                                    int64_t n, int64_t k, int num_sms, void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = current_device_is_sm90("m_grouped_bf16_gemm_gather_a"); rc != PK_OK) return rc;
  PK_CHECK_ARG(num_sms >= 0, "m_grouped_bf16_gemm_gather_a: num_sms = %d, must be >= 0 (0 = every SM)", num_sms);
  deep_gemm::sm90::GroupedGemmConfig cfg = deep_gemm::sm90::m_grouped_gemm_config(m_total, n, k, num_groups);
  cfg.num_sms = num_sms;
  char message[512] = {0};
  const int rc = deep_gemm::sm90::m_grouped_bf16_gemm_gather_a(
      a, lda, a_rows, a_row_index, b, b_k_major != 0, ldb, b_group_stride, d, ldd, group_offsets, num_groups,
      m_total, n, k, &cfg, static_cast<cudaStream_t>(cuda_stream), message, sizeof(message));
  return from_sm90(rc, message);
#else
  (void)a, (void)lda, (void)a_rows, (void)a_row_index, (void)b, (void)b_k_major, (void)ldb, (void)b_group_stride;
  (void)d, (void)ldd, (void)group_offsets, (void)num_groups, (void)m_total, (void)n, (void)k, (void)num_sms;
  (void)cuda_stream;
  return deep_gemm::api::fail(PK_ERR_NOT_AVAILABLE,
                              "m_grouped_bf16_gemm_gather_a is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a");
#endif
}

int pk_m_grouped_bf16_gemm_swiglu(const void* a, int64_t lda, int64_t a_rows, const int32_t* a_row_index,
                                  const void* w13, int64_t ldb, int64_t b_group_stride, int64_t intermediate,
                                  void* s, int64_t lds, void* h, int64_t ldh, const int32_t* group_offsets,
                                  int num_groups, int64_t m_total, int64_t k, float clamp, int num_sms,
                                  void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = current_device_is_sm90("m_grouped_bf16_gemm_swiglu"); rc != PK_OK) return rc;
  PK_CHECK_ARG(num_sms >= 0, "m_grouped_bf16_gemm_swiglu: num_sms = %d, must be >= 0 (0 = every SM)", num_sms);
  deep_gemm::sm90::GroupedGemmConfig cfg = deep_gemm::sm90::swiglu_gemm_config();
  cfg.num_sms = num_sms;
  char message[512] = {0};
  const int rc = deep_gemm::sm90::m_grouped_bf16_gemm_swiglu(
      a, lda, a_rows, a_row_index, w13, ldb, b_group_stride, intermediate, s, lds, h, ldh, group_offsets, num_groups,
      m_total, k, clamp, &cfg, static_cast<cudaStream_t>(cuda_stream), message, sizeof(message));
  return from_sm90(rc, message);
#else
  (void)a, (void)lda, (void)a_rows, (void)a_row_index, (void)w13, (void)ldb, (void)b_group_stride;
  (void)intermediate, (void)s, (void)lds, (void)h, (void)ldh, (void)group_offsets, (void)num_groups;
  (void)m_total, (void)k, (void)clamp, (void)num_sms, (void)cuda_stream;
  return deep_gemm::api::fail(PK_ERR_NOT_AVAILABLE,
                              "m_grouped_bf16_gemm_swiglu is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a");
#endif
}

int pk_m_grouped_bf16_gemm_swiglu_bwd(const void* dy_pool, int64_t lda, const void* w2, int64_t ldb,
                                      int64_t b_group_stride, const void* h, int64_t ldh, const int32_t* pool_src_route,
                                      const float* route_weights, int64_t num_routes, void* dh, int64_t lddh, void* aw,
                                      int64_t ldaw, float* dt_part, int64_t dt_ld, const int32_t* group_offsets,
                                      int num_groups, int64_t m_total, int64_t intermediate, int64_t hidden,
                                      float clamp, int num_sms, void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = current_device_is_sm90("m_grouped_bf16_gemm_swiglu_bwd"); rc != PK_OK) return rc;
  char message[512] = {0};
  const int rc = deep_gemm::sm90::m_grouped_bf16_gemm_swiglu_bwd(
      dy_pool, lda, w2, ldb, b_group_stride, h, ldh, pool_src_route, route_weights, num_routes, dh, lddh, aw, ldaw,
      dt_part, dt_ld, group_offsets, num_groups, m_total, intermediate, hidden, clamp, num_sms,
      static_cast<cudaStream_t>(cuda_stream), message, sizeof(message));
  return from_sm90(rc, message);
#else
  (void)dy_pool, (void)lda, (void)w2, (void)ldb, (void)b_group_stride, (void)h, (void)ldh, (void)pool_src_route;
  (void)route_weights, (void)num_routes, (void)dh, (void)lddh, (void)aw, (void)ldaw, (void)dt_part, (void)dt_ld;
  (void)group_offsets, (void)num_groups, (void)m_total, (void)intermediate, (void)hidden, (void)clamp;
  (void)num_sms, (void)cuda_stream;
  return deep_gemm::api::fail(PK_ERR_NOT_AVAILABLE,
                              "m_grouped_bf16_gemm_swiglu_bwd is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a");
#endif
}

int pk_k_grouped_bf16_gemm(const void* a, int64_t lda, const void* b, int64_t ldb, void* c, int c_is_bf16,
                           int accumulate, const int32_t* group_offsets, int num_groups, int64_t p_total,
                           int64_t m, int64_t n, int num_sms, void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = current_device_is_sm90("k_grouped_bf16_gemm"); rc != PK_OK) return rc;
  PK_CHECK_ARG(num_sms >= 0, "k_grouped_bf16_gemm: num_sms = %d, must be >= 0 (0 = every SM)", num_sms);
  deep_gemm::sm90::GroupedGemmConfig cfg =
      deep_gemm::sm90::k_grouped_gemm_config(m, n, p_total, num_groups, c_is_bf16 != 0);
  cfg.num_sms = num_sms;
  char message[512] = {0};
  const int rc = deep_gemm::sm90::k_grouped_bf16_gemm(a, lda, b, ldb, c, c_is_bf16 != 0, accumulate != 0,
                                                      group_offsets, num_groups, p_total, m, n, &cfg,
                                                      static_cast<cudaStream_t>(cuda_stream), message,
                                                      sizeof(message));
  return from_sm90(rc, message);
#else
  (void)a, (void)lda, (void)b, (void)ldb, (void)c, (void)c_is_bf16, (void)accumulate, (void)group_offsets;
  (void)num_groups, (void)p_total, (void)m, (void)n, (void)num_sms, (void)cuda_stream;
  return deep_gemm::api::fail(PK_ERR_NOT_AVAILABLE,
                              "k_grouped_bf16_gemm is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a");
#endif
}


int pk_mega_moe_fwd_combines_in_kernel(void) {
#if PK_HAS_SM90_KERNELS
  return deep_gemm::sm90::mega_moe_fwd_combines_in_kernel() ? 1 : 0;
#else
  return 0;
#endif
}

int64_t pk_mega_moe_fwd_counter_count(int64_t m_total, int num_experts, int64_t num_tokens, int64_t hidden) {
  return deep_gemm::sm90::mega_moe_fwd_counter_count(m_total, num_experts, num_tokens, hidden);
}

int pk_mega_moe_fwd_bf16(const void* const* x_ranks, int num_ranks, int64_t ld_x, const int32_t* pool_src_route,
                         const int32_t* pool_src_rank, int top_k, const int32_t* expert_offsets, int num_experts,
                         int64_t m_total, int64_t hidden, int64_t inter, const void* w13, const void* w2, void* x_pool,
                         void* s, void* h, void* o, int64_t num_tokens, const int32_t* route_to_pool,
                         const float* topk_weights, void* y, float clamp, int32_t* counters, void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = current_device_is_sm90(); rc != PK_OK) return rc;
  char message[512] = {0};
  const int rc = deep_gemm::sm90::mega_moe_fwd_bf16(x_ranks, num_ranks, ld_x, pool_src_route, pool_src_rank, top_k,
                                                    expert_offsets, num_experts, m_total, hidden, inter, w13, w2,
                                                    x_pool, s, h, o, num_tokens, route_to_pool, topk_weights, y,
                                                    clamp, counters, 0,
                                                    static_cast<cudaStream_t>(cuda_stream), message, sizeof(message));
  return from_sm90(rc, message);
#else
  (void)x_ranks, (void)num_ranks, (void)ld_x, (void)pool_src_route, (void)pool_src_rank, (void)top_k;
  (void)expert_offsets, (void)num_experts, (void)m_total, (void)hidden, (void)inter, (void)w13, (void)w2;
  (void)x_pool, (void)s, (void)h, (void)o, (void)num_tokens, (void)route_to_pool, (void)topk_weights, (void)y;
  (void)clamp, (void)counters, (void)cuda_stream;
  return deep_gemm::api::fail(PK_ERR_NOT_AVAILABLE,
                              "mega_moe_fwd_bf16 is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a");
#endif
}

}  // extern "C"
