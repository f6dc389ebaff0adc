// C ABI of the sm90 grouped GEMMs and of the fused backwards' dgrad kernels, BF16 and FP8 (each takes its
// SwiGLU-backward GEMM's arguments and more): earlier device findings and the device check, then the sm90 launchers
// (which validate shapes).
#include "api/prime_kernels_api.h"
#include "api/errors.hpp"
#include "common/device_check.hpp"
#include "sm90/grouped_gemm.hpp"  // declarations and the configs; the launchers are linked only with the kernels
#include "sm90/mega_moe_bwd.hpp"
#include "sm90/mega_moe_bwd_fp8.hpp"
#include "sm90/grouped_gemm_fp8.hpp"

namespace {

// What an earlier kernel found invalid on the device (reported once, before this call launches anything), then
// the device check.
int current_device_is_sm90(const char* op) {
  if (const int rc = prime_kernels::api::check_device_findings(op); rc != PK_OK) return rc;
  return prime_kernels::api::check_current_device(prime_kernels::api::ArchFamily::kSm90);
}

// Where an m-grouped GEMM's rows go when they are pushed to their routes (MGroupedGemmArgs, the fields of the name).
struct PushRoutes {
  void* const* slots;
  int num_ranks;
  int64_t ld_slots;
  const int32_t* pool_src_route;
  const int32_t* pool_src_rank;
  int64_t num_routes;
};

#if PK_HAS_SM90_KERNELS
prime_kernels::sm90::SecondB second_b_args(const PkSecondB& in) {
  prime_kernels::sm90::SecondB out;
  out.b2 = in.b2;
  out.ldb2 = in.ldb2;
  out.b2_group_stride = in.b2_group_stride;
  out.slabs = in.slabs;
  out.chunks = in.chunks;
  out.num_b_groups = in.num_b_groups;
  return out;
}
#endif

// The m-grouped entry points: the plain GEMM, (gather) the one that gathers A's rows through a_row_index, and (push)
// the one whose rows go to their routes; each launcher checks its own arguments.
int m_grouped(const char* op, bool gather, const void* a, int64_t lda, int64_t a_rows, const int32_t* a_row_index,
              const void* b, int b_k_major, int64_t ldb, int64_t b_group_stride, void* d, int64_t ldd, const int32_t* group_offsets,
              int num_groups, int64_t m_total, int64_t n, int64_t k, int num_sms, void* cuda_stream,
              const PushRoutes* push = nullptr, const PkSecondB* second_b = nullptr) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = current_device_is_sm90(op); rc != PK_OK) return rc;
  PK_CHECK_ARG(num_sms >= 0, "%s: num_sms = %d, must be >= 0 (0 = every SM)", op, num_sms);
  prime_kernels::sm90::GroupedGemmConfig cfg = prime_kernels::sm90::m_grouped_gemm_config(m_total, n, k, num_groups);
  cfg.num_sms = num_sms;
  prime_kernels::sm90::MGroupedGemmArgs args;
  args.a = a;
  args.lda = lda;
  args.a_rows = a_rows;
  args.a_row_index = a_row_index;
  args.b = b;
  args.b_k_major = b_k_major != 0;
  args.ldb = ldb;
  args.b_group_stride = b_group_stride;
  args.d = d;
  args.ldd = ldd;
  args.group_offsets = group_offsets;
  args.num_groups = num_groups;
  args.m_total = m_total;
  args.n = n;
  args.k = k;
  args.config = &cfg;
  if (second_b != nullptr) {
    cfg = prime_kernels::sm90::swiglu_gemm_config();  // the one config built with a second B
    cfg.num_sms = num_sms;
    args.second_b = second_b_args(*second_b);
  }
  if (push != nullptr) {
    args.push_slots = push->slots;
    args.num_push_ranks = push->num_ranks;
    args.ld_slots = push->ld_slots;
    args.pool_src_route = push->pool_src_route;
    args.pool_src_rank = push->pool_src_rank;
    args.num_routes = push->num_routes;
  }
  char message[512] = {0};
  const cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  const int rc =
      push != nullptr ? prime_kernels::sm90::m_grouped_bf16_gemm_nn_to_routes(args, stream, message, sizeof(message))
      : gather        ? prime_kernels::sm90::m_grouped_bf16_gemm_gather_a(args, stream, message, sizeof(message))
                      : prime_kernels::sm90::m_grouped_bf16_gemm(args, stream, message, sizeof(message));
  return prime_kernels::api::from_status(rc, message);
#else
  (void)gather, (void)a, (void)lda, (void)a_rows, (void)a_row_index, (void)b, (void)b_k_major, (void)ldb;
  (void)b_group_stride, (void)d, (void)ldd, (void)group_offsets, (void)num_groups, (void)m_total, (void)n, (void)k;
  (void)num_sms, (void)cuda_stream, (void)push, (void)second_b;
  return prime_kernels::api::fail(PK_ERR_NOT_AVAILABLE, "%s is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a", op);
#endif
}

#if PK_HAS_SM90_KERNELS
// The L2 dgrad's arguments as the C ABI passes them, for the grouped op and the fused backward's dgrad kernel (the
// same fields with the same meaning in both).
prime_kernels::sm90::SwigluBwdGemmArgs swiglu_bwd_args(const void* dy_pool, int64_t lda, const void* w2, int64_t ldb,
                                                       int64_t b_group_stride, const void* h, int64_t ldh,
                                                       const int32_t* pool_src_route, const float* route_weights,
                                                       int64_t num_routes, void* dh, int64_t lddh, void* aw,
                                                       int64_t ldaw, float* dt_part, int64_t dt_ld,
                                                       const int32_t* group_offsets, int num_groups, int64_t m_total,
                                                       int64_t intermediate, int64_t hidden, float clamp, int num_sms) {
  prime_kernels::sm90::SwigluBwdGemmArgs args;
  args.dy_pool = dy_pool;
  args.lda = lda;
  args.w2 = w2;
  args.ldb = ldb;
  args.b_group_stride = b_group_stride;
  args.h = h;
  args.ldh = ldh;
  args.pool_src_route = pool_src_route;
  args.route_weights = route_weights;
  args.num_routes = num_routes;
  args.dh = dh;
  args.lddh = lddh;
  args.aw = aw;
  args.ldaw = ldaw;
  args.dt_part = dt_part;
  args.dt_ld = dt_ld;
  args.group_offsets = group_offsets;
  args.num_groups = num_groups;
  args.m_total = m_total;
  args.intermediate = intermediate;
  args.hidden = hidden;
  args.clamp_limit = clamp;
  args.num_sms = num_sms;
  return args;
}

// The FP8 L2 dgrad's arguments as the C ABI passes them, for the grouped op and the fused FP8 backward's kernel.
prime_kernels::sm90::SwigluBwdFp8GemmArgs swiglu_bwd_fp8_args(
    const void* dy_q, int64_t lda, const float* dy_sa, int64_t ld_sa, const void* w2t_q, int64_t ldb,
    int64_t b_group_stride, const float* w2t_sb, int64_t sb_group_stride, int64_t sb_n_stride, const void* h,
    int64_t ldh, const int32_t* pool_src_route, const float* route_weights, int64_t num_routes, void* dh_q,
    int64_t ld_dh_q, float* dh_sa, int64_t ld_dh_sa, void* dht_q, int64_t ld_dht_q, float* dht_s, int64_t ld_dht_s,
    void* awt_q, int64_t ld_awt_q, float* awt_s, int64_t ld_awt_s, float* dt_part, int64_t dt_ld,
    const int32_t* group_offsets, int num_groups, int64_t m_total, int64_t intermediate, int64_t hidden, float clamp,
    int pow2_scales, int num_sms) {
  return prime_kernels::sm90::SwigluBwdFp8GemmArgs{
      dy_q, lda, dy_sa, ld_sa, w2t_q, ldb, b_group_stride, w2t_sb, sb_group_stride, sb_n_stride, h, ldh,
      pool_src_route, route_weights, num_routes, dh_q, ld_dh_q, dh_sa, ld_dh_sa, dht_q, ld_dht_q, dht_s, ld_dht_s,
      awt_q, ld_awt_q, awt_s, ld_awt_s, dt_part, dt_ld, group_offsets, num_groups, m_total, intermediate, hidden,
      clamp, pow2_scales != 0, num_sms};
}
#endif

}  // namespace

extern "C" {

int pk_m_grouped_bf16_gemm(const void* a, int64_t lda, const void* b, int b_k_major, int64_t ldb,
                           int64_t b_group_stride, void* d, int64_t ldd, const int32_t* group_offsets,
                           int num_groups, int64_t m_total, int64_t n, int64_t k, int num_sms, void* cuda_stream) {
  return m_grouped("m_grouped_bf16_gemm", false, a, lda, 0, nullptr, b, b_k_major, ldb, b_group_stride, d, ldd,
                   group_offsets, num_groups, m_total, n, k, num_sms, cuda_stream);
}

int pk_m_grouped_bf16_gemm_nn_to_routes(const void* a, int64_t lda, const void* b, int64_t ldb, int64_t b_group_stride,
                                        void* const* push_slots, int num_ranks, int64_t ld_slots,
                                        const int32_t* pool_src_route, const int32_t* pool_src_rank,
                                        int64_t num_routes, const int32_t* group_offsets, int num_groups,
                                        int64_t m_total, int64_t n, int64_t k, int num_sms, void* cuda_stream) {
  const PushRoutes push{push_slots, num_ranks, ld_slots, pool_src_route, pool_src_rank, num_routes};
  return m_grouped("m_grouped_bf16_gemm_nn_to_routes", false, a, lda, 0, nullptr, b, 0, ldb, b_group_stride, nullptr,
                   0, group_offsets, num_groups, m_total, n, k, num_sms, cuda_stream, &push);
}

int pk_m_grouped_bf16_gemm_gather_a(const void* a, int64_t lda, int64_t a_rows, const int32_t* a_row_index,
                                    const void* b, int b_k_major, int64_t ldb, int64_t b_group_stride, void* d,
                                    int64_t ldd, const int32_t* group_offsets, int num_groups, int64_t m_total,
                                    int64_t n, int64_t k, int num_sms, void* cuda_stream) {
  return m_grouped("m_grouped_bf16_gemm_gather_a", true, a, lda, a_rows, a_row_index, b, b_k_major, ldb, b_group_stride,
                   d, ldd, group_offsets, num_groups, m_total, n, k, num_sms, cuda_stream);
}

int pk_m_grouped_bf16_gemm_swiglu(const void* a, int64_t lda, int64_t a_rows, const int32_t* a_row_index,
                                  const void* w13, int64_t ldb, int64_t b_group_stride, int64_t intermediate,
                                  void* s, int64_t lds, void* h, int64_t ldh, const int32_t* group_offsets,
                                  int num_groups, int64_t m_total, int64_t k, float clamp, int num_sms,
                                  void* cuda_stream) {
  return pk_m_grouped_bf16_gemm_swiglu_second_b(a, lda, a_rows, a_row_index, w13, ldb, b_group_stride, nullptr,
                                                intermediate, s, lds, h, ldh, group_offsets, num_groups, m_total, k,
                                                clamp, num_sms, cuda_stream);
}

int pk_m_grouped_bf16_gemm_second_b(const void* a, int64_t lda, const void* b, int b_k_major, int64_t ldb,
                                    int64_t b_group_stride, const PkSecondB* second_b, void* d, int64_t ldd,
                                    const int32_t* group_offsets, int num_groups, int64_t m_total, int64_t n,
                                    int64_t k, int num_sms, void* cuda_stream) {
  PK_CHECK_ARG(second_b != nullptr && second_b->b2 != nullptr, "m_grouped_bf16_gemm_second_b: null second_b or b2");
  return m_grouped("m_grouped_bf16_gemm_second_b", false, a, lda, 0, nullptr, b, b_k_major, ldb, b_group_stride, d,
                   ldd, group_offsets, num_groups, m_total, n, k, num_sms, cuda_stream, nullptr, second_b);
}

int pk_m_grouped_bf16_gemm_swiglu_second_b(const void* a, int64_t lda, int64_t a_rows, const int32_t* a_row_index,
                                           const void* w13, int64_t ldb, int64_t b_group_stride,
                                           const PkSecondB* second_b, int64_t intermediate, void* s, int64_t lds,
                                           void* h, int64_t ldh, const int32_t* group_offsets, int num_groups,
                                           int64_t m_total, int64_t k, float clamp, int num_sms, void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = current_device_is_sm90("m_grouped_bf16_gemm_swiglu"); rc != PK_OK) return rc;
  PK_CHECK_ARG(num_sms >= 0, "m_grouped_bf16_gemm_swiglu: num_sms = %d, must be >= 0 (0 = every SM)", num_sms);
  prime_kernels::sm90::GroupedGemmConfig cfg = prime_kernels::sm90::swiglu_gemm_config();
  cfg.num_sms = num_sms;
  prime_kernels::sm90::SwigluGemmArgs args;
  args.a = a;
  args.lda = lda;
  args.a_rows = a_rows;
  args.a_row_index = a_row_index;
  args.w13 = w13;
  args.ldb = ldb;
  args.b_group_stride = b_group_stride;
  args.intermediate = intermediate;
  args.s = s;
  args.lds = lds;
  args.h = h;
  args.ldh = ldh;
  args.group_offsets = group_offsets;
  args.num_groups = num_groups;
  args.m_total = m_total;
  args.k = k;
  args.clamp_limit = clamp;
  args.config = &cfg;
  if (second_b != nullptr) args.second_b = second_b_args(*second_b);
  char message[512] = {0};
  const int rc = prime_kernels::sm90::m_grouped_bf16_gemm_swiglu(args, static_cast<cudaStream_t>(cuda_stream), message,
                                                             sizeof(message));
  return prime_kernels::api::from_status(rc, message);
#else
  (void)a, (void)lda, (void)a_rows, (void)a_row_index, (void)w13, (void)ldb, (void)b_group_stride;
  (void)intermediate, (void)s, (void)lds, (void)h, (void)ldh, (void)group_offsets, (void)num_groups;
  (void)m_total, (void)k, (void)clamp, (void)num_sms, (void)cuda_stream, (void)second_b;
  return prime_kernels::api::fail(PK_ERR_NOT_AVAILABLE,
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
  const prime_kernels::sm90::SwigluBwdGemmArgs args =
      swiglu_bwd_args(dy_pool, lda, w2, ldb, b_group_stride, h, ldh, pool_src_route, route_weights, num_routes, dh,
                      lddh, aw, ldaw, dt_part, dt_ld, group_offsets, num_groups, m_total, intermediate, hidden, clamp,
                      num_sms);
  char message[512] = {0};
  const int rc = prime_kernels::sm90::m_grouped_bf16_gemm_swiglu_bwd(args, static_cast<cudaStream_t>(cuda_stream),
                                                                 message, sizeof(message));
  return prime_kernels::api::from_status(rc, message);
#else
  (void)dy_pool, (void)lda, (void)w2, (void)ldb, (void)b_group_stride, (void)h, (void)ldh, (void)pool_src_route;
  (void)route_weights, (void)num_routes, (void)dh, (void)lddh, (void)aw, (void)ldaw, (void)dt_part, (void)dt_ld;
  (void)group_offsets, (void)num_groups, (void)m_total, (void)intermediate, (void)hidden, (void)clamp;
  (void)num_sms, (void)cuda_stream;
  return prime_kernels::api::fail(PK_ERR_NOT_AVAILABLE,
                              "m_grouped_bf16_gemm_swiglu_bwd is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a");
#endif
}

int64_t pk_mega_moe_bwd_counter_count(int64_t m_total, int num_groups) {
  return prime_kernels::sm90::mega_moe_bwd_counter_count(m_total, num_groups);
}

int pk_mega_moe_bwd_bf16(const void* dy_pool, int64_t lda, const void* w2, int64_t ldb, int64_t b_group_stride,
                         const void* h, int64_t ldh, const int32_t* pool_src_route, const float* route_weights,
                         int64_t num_routes, const void* w13, int64_t ldw13, int64_t w13_group_stride, void* dh,
                         int64_t lddh, void* aw, int64_t ldaw, float* dt_part, int64_t dt_ld, void* dx, int64_t lddx,
                         const void* x_pool, int64_t ldx, int wgrad, void* dw2, void* dw13,
                         const int32_t* group_offsets, int num_groups, int64_t m_total, int64_t intermediate,
                         int64_t hidden, float clamp, int32_t* counters, int lag, int num_sms, void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = current_device_is_sm90("mega_moe_bwd_bf16"); rc != PK_OK) return rc;
  prime_kernels::sm90::MegaBwdArgs args;
  args.l2 = swiglu_bwd_args(dy_pool, lda, w2, ldb, b_group_stride, h, ldh, pool_src_route, route_weights, num_routes,
                            dh, lddh, aw, ldaw, dt_part, dt_ld, group_offsets, num_groups, m_total, intermediate,
                            hidden, clamp, num_sms);
  args.w13 = w13;
  args.ldw13 = ldw13;
  args.w13_group_stride = w13_group_stride;
  args.dx = dx;
  args.lddx = lddx;
  args.counters = counters;
  args.wgrad = wgrad;
  args.x_pool = x_pool;
  args.ldx = ldx;
  args.dw2 = dw2;
  args.dw13 = dw13;
  args.lag = lag;
  char message[512] = {0};
  const int rc =
      prime_kernels::sm90::mega_moe_bwd_bf16(args, static_cast<cudaStream_t>(cuda_stream), message, sizeof(message));
  return prime_kernels::api::from_status(rc, message);
#else
  (void)dy_pool, (void)lda, (void)w2, (void)ldb, (void)b_group_stride, (void)h, (void)ldh, (void)pool_src_route;
  (void)route_weights, (void)num_routes, (void)w13, (void)ldw13, (void)w13_group_stride, (void)dh, (void)lddh;
  (void)aw, (void)ldaw, (void)dt_part, (void)dt_ld, (void)dx, (void)lddx, (void)x_pool, (void)ldx, (void)wgrad;
  (void)dw2, (void)dw13, (void)group_offsets, (void)num_groups, (void)m_total, (void)intermediate, (void)hidden;
  (void)clamp, (void)counters, (void)lag, (void)num_sms, (void)cuda_stream;
  return prime_kernels::api::fail(PK_ERR_NOT_AVAILABLE,
                                  "mega_moe_bwd_bf16 is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a");
#endif
}

int pk_m_grouped_fp8_gemm_nt(const void* a, int64_t lda, const float* sa, int64_t ld_sa, const void* b, int64_t ldb,
                             int64_t b_group_stride, const float* sb, int64_t sb_group_stride, int64_t sb_n_stride,
                             void* d, int64_t ldd, const int32_t* group_offsets, int num_groups, int64_t m_total,
                             int64_t n, int64_t k, int a_scale_block, int num_sms, void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = current_device_is_sm90("m_grouped_fp8_gemm_nt"); rc != PK_OK) return rc;
  PK_CHECK_ARG(num_sms >= 0, "m_grouped_fp8_gemm_nt: num_sms = %d, must be >= 0 (0 = every SM)", num_sms);
  prime_kernels::sm90::GroupedGemmConfig cfg =
      prime_kernels::sm90::m_grouped_fp8_gemm_config(m_total, n, k, num_groups);
  cfg.num_sms = num_sms;
  prime_kernels::sm90::MGroupedFp8GemmArgs args;
  args.a = a;
  args.lda = lda;
  args.sa = sa;
  args.ld_sa = ld_sa;
  args.b = b;
  args.ldb = ldb;
  args.b_group_stride = b_group_stride;
  args.sb = sb;
  args.sb_group_stride = sb_group_stride;
  args.sb_n_stride = sb_n_stride;
  args.d = d;
  args.ldd = ldd;
  args.group_offsets = group_offsets;
  args.num_groups = num_groups;
  args.m_total = m_total;
  args.n = n;
  args.k = k;
  args.a_scale_block = a_scale_block;
  args.config = &cfg;
  char message[512] = {0};
  const int rc = prime_kernels::sm90::m_grouped_fp8_gemm_nt(args, static_cast<cudaStream_t>(cuda_stream), message,
                                                          sizeof(message));
  return prime_kernels::api::from_status(rc, message);
#else
  (void)a, (void)lda, (void)sa, (void)ld_sa, (void)b, (void)ldb, (void)b_group_stride, (void)sb;
  (void)sb_group_stride, (void)sb_n_stride, (void)d, (void)ldd, (void)group_offsets, (void)num_groups;
  (void)m_total, (void)n, (void)k, (void)a_scale_block, (void)num_sms, (void)cuda_stream;
  return prime_kernels::api::fail(PK_ERR_NOT_AVAILABLE,
                              "m_grouped_fp8_gemm_nt is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a");
#endif
}

int pk_m_grouped_fp8_gemm_swiglu_bwd(const void* dy_q, int64_t lda, const float* dy_sa, int64_t ld_sa,
                                     const void* w2t_q, int64_t ldb, int64_t b_group_stride, const float* w2t_sb,
                                     int64_t sb_group_stride, int64_t sb_n_stride, const void* h, int64_t ldh,
                                     const int32_t* pool_src_route, const float* route_weights, int64_t num_routes,
                                     void* dh_q, int64_t ld_dh_q, float* dh_sa, int64_t ld_dh_sa, void* dht_q,
                                     int64_t ld_dht_q, float* dht_s, int64_t ld_dht_s, void* awt_q, int64_t ld_awt_q,
                                     float* awt_s, int64_t ld_awt_s, float* dt_part, int64_t dt_ld,
                                     const int32_t* group_offsets, int num_groups, int64_t m_total,
                                     int64_t intermediate, int64_t hidden, float clamp, int pow2_scales, int num_sms,
                                     void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = current_device_is_sm90("m_grouped_fp8_gemm_swiglu_bwd"); rc != PK_OK) return rc;
  const prime_kernels::sm90::SwigluBwdFp8GemmArgs args = swiglu_bwd_fp8_args(
      dy_q, lda, dy_sa, ld_sa, w2t_q, ldb, b_group_stride, w2t_sb, sb_group_stride, sb_n_stride, h, ldh,
      pool_src_route, route_weights, num_routes, dh_q, ld_dh_q, dh_sa, ld_dh_sa, dht_q, ld_dht_q, dht_s, ld_dht_s,
      awt_q, ld_awt_q, awt_s, ld_awt_s, dt_part, dt_ld, group_offsets, num_groups, m_total, intermediate, hidden,
      clamp, pow2_scales, num_sms);
  char message[512] = {0};
  const int rc = prime_kernels::sm90::m_grouped_fp8_gemm_swiglu_bwd(args, static_cast<cudaStream_t>(cuda_stream),
                                                                    message, sizeof(message));
  return prime_kernels::api::from_status(rc, message);
#else
  (void)dy_q, (void)lda, (void)dy_sa, (void)ld_sa, (void)w2t_q, (void)ldb, (void)b_group_stride, (void)w2t_sb;
  (void)sb_group_stride, (void)sb_n_stride, (void)h, (void)ldh, (void)pool_src_route, (void)route_weights;
  (void)num_routes, (void)dh_q, (void)ld_dh_q, (void)dh_sa, (void)ld_dh_sa, (void)dht_q, (void)ld_dht_q, (void)dht_s;
  (void)ld_dht_s, (void)awt_q, (void)ld_awt_q, (void)awt_s, (void)ld_awt_s, (void)dt_part, (void)dt_ld;
  (void)group_offsets, (void)num_groups, (void)m_total, (void)intermediate, (void)hidden, (void)clamp;
  (void)pow2_scales, (void)num_sms, (void)cuda_stream;
  return prime_kernels::api::fail(PK_ERR_NOT_AVAILABLE,
                                  "m_grouped_fp8_gemm_swiglu_bwd is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a");
#endif
}

int64_t pk_mega_moe_bwd_fp8_counter_count(int64_t m_total, int num_groups) {
  return prime_kernels::sm90::mega_moe_bwd_fp8_counter_count(m_total, num_groups);
}

int pk_mega_moe_bwd_fp8(const void* dy_q, int64_t lda, const float* dy_sa, int64_t ld_sa, const void* w2t_q,
                        int64_t ldb, int64_t b_group_stride, const float* w2t_sb, int64_t sb_group_stride,
                        int64_t sb_n_stride, const void* h, int64_t ldh, const int32_t* pool_src_route,
                        const float* route_weights, int64_t num_routes, void* dh_q, int64_t ld_dh_q, float* dh_sa,
                        int64_t ld_dh_sa, void* dht_q, int64_t ld_dht_q, float* dht_s, int64_t ld_dht_s, void* awt_q,
                        int64_t ld_awt_q, float* awt_s, int64_t ld_awt_s, float* dt_part, int64_t dt_ld,
                        const int32_t* group_offsets, int num_groups, int64_t m_total, int64_t intermediate,
                        int64_t hidden, float clamp, int pow2_scales, const void* w13t_q, int64_t ldb13,
                        int64_t b13_group_stride, const float* w13t_sb, int64_t sb13_group_stride,
                        int64_t sb13_n_stride, void* dx, int64_t lddx, int32_t* counters, int lag, int num_sms,
                        void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = current_device_is_sm90("mega_moe_bwd_fp8"); rc != PK_OK) return rc;
  prime_kernels::sm90::MegaBwdFp8Args args;
  args.l2 = swiglu_bwd_fp8_args(dy_q, lda, dy_sa, ld_sa, w2t_q, ldb, b_group_stride, w2t_sb, sb_group_stride,
                                sb_n_stride, h, ldh, pool_src_route, route_weights, num_routes, dh_q, ld_dh_q, dh_sa,
                                ld_dh_sa, dht_q, ld_dht_q, dht_s, ld_dht_s, awt_q, ld_awt_q, awt_s, ld_awt_s, dt_part,
                                dt_ld, group_offsets, num_groups, m_total, intermediate, hidden, clamp, pow2_scales,
                                num_sms);
  args.w13t_q = w13t_q;
  args.ldb13 = ldb13;
  args.b13_group_stride = b13_group_stride;
  args.w13t_sb = w13t_sb;
  args.sb13_group_stride = sb13_group_stride;
  args.sb13_n_stride = sb13_n_stride;
  args.dx = dx;
  args.lddx = lddx;
  args.counters = counters;
  args.lag = lag;
  char message[512] = {0};
  const int rc =
      prime_kernels::sm90::mega_moe_bwd_fp8(args, static_cast<cudaStream_t>(cuda_stream), message, sizeof(message));
  return prime_kernels::api::from_status(rc, message);
#else
  (void)dy_q, (void)lda, (void)dy_sa, (void)ld_sa, (void)w2t_q, (void)ldb, (void)b_group_stride, (void)w2t_sb;
  (void)sb_group_stride, (void)sb_n_stride, (void)h, (void)ldh, (void)pool_src_route, (void)route_weights;
  (void)num_routes, (void)dh_q, (void)ld_dh_q, (void)dh_sa, (void)ld_dh_sa, (void)dht_q, (void)ld_dht_q, (void)dht_s;
  (void)ld_dht_s, (void)awt_q, (void)ld_awt_q, (void)awt_s, (void)ld_awt_s, (void)dt_part, (void)dt_ld;
  (void)group_offsets, (void)num_groups, (void)m_total, (void)intermediate, (void)hidden, (void)clamp;
  (void)pow2_scales, (void)w13t_q, (void)ldb13, (void)b13_group_stride, (void)w13t_sb, (void)sb13_group_stride;
  (void)sb13_n_stride, (void)dx, (void)lddx, (void)counters, (void)lag, (void)num_sms, (void)cuda_stream;
  return prime_kernels::api::fail(PK_ERR_NOT_AVAILABLE,
                                  "mega_moe_bwd_fp8 is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a");
#endif
}

int pk_m_grouped_fp8_gemm_swiglu(const void* x_q, int64_t lda, const float* x_sa, int64_t ld_sa, const void* w13_q,
                                 int64_t ldb, int64_t b_group_stride, const float* w13_sb, int64_t sb_group_stride,
                                 int64_t sb_n_stride, void* s_q, int64_t ld_s_q, float* s_sa, int64_t ld_s_sa, void* h,
                                 int64_t ldh, const int32_t* group_offsets, int num_groups, int64_t m_total,
                                 int64_t intermediate, int64_t hidden, int pow2_scales, int num_sms,
                                 float clamp_limit, void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = current_device_is_sm90("m_grouped_fp8_gemm_swiglu"); rc != PK_OK) return rc;
  const prime_kernels::sm90::SwigluFwdFp8GemmArgs args{
      x_q, lda, x_sa, ld_sa, w13_q, ldb, b_group_stride, w13_sb, sb_group_stride, sb_n_stride, s_q, ld_s_q, s_sa,
      ld_s_sa, h, ldh, group_offsets, num_groups, m_total, intermediate, hidden, pow2_scales != 0, num_sms,
      clamp_limit};
  char message[512] = {0};
  const int rc = prime_kernels::sm90::m_grouped_fp8_gemm_swiglu(args, static_cast<cudaStream_t>(cuda_stream), message,
                                                                sizeof(message));
  return prime_kernels::api::from_status(rc, message);
#else
  (void)x_q, (void)lda, (void)x_sa, (void)ld_sa, (void)w13_q, (void)ldb, (void)b_group_stride, (void)w13_sb;
  (void)sb_group_stride, (void)sb_n_stride, (void)s_q, (void)ld_s_q, (void)s_sa, (void)ld_s_sa, (void)h, (void)ldh;
  (void)group_offsets, (void)num_groups, (void)m_total, (void)intermediate, (void)hidden, (void)pow2_scales;
  (void)num_sms, (void)clamp_limit, (void)cuda_stream;
  return prime_kernels::api::fail(PK_ERR_NOT_AVAILABLE,
                                  "m_grouped_fp8_gemm_swiglu is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a");
#endif
}

int pk_k_grouped_bf16_gemm(const void* a, int64_t lda, const void* b, int64_t ldb, void* c, int c_is_bf16,
                           int accumulate, const int32_t* group_offsets, int num_groups, int64_t p_total,
                           int64_t m, int64_t n, int num_sms, void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = current_device_is_sm90("k_grouped_bf16_gemm"); rc != PK_OK) return rc;
  PK_CHECK_ARG(num_sms >= 0, "k_grouped_bf16_gemm: num_sms = %d, must be >= 0 (0 = every SM)", num_sms);
  prime_kernels::sm90::GroupedGemmConfig cfg =
      prime_kernels::sm90::k_grouped_gemm_config(m, n, p_total, num_groups, c_is_bf16 != 0);
  cfg.num_sms = num_sms;
  prime_kernels::sm90::KGroupedGemmArgs args;
  args.a = a;
  args.lda = lda;
  args.b = b;
  args.ldb = ldb;
  args.c = c;
  args.c_is_bf16 = c_is_bf16 != 0;
  args.accumulate = accumulate != 0;
  args.group_offsets = group_offsets;
  args.num_groups = num_groups;
  args.p_total = p_total;
  args.m = m;
  args.n = n;
  args.config = &cfg;
  char message[512] = {0};
  const int rc = prime_kernels::sm90::k_grouped_bf16_gemm(args, static_cast<cudaStream_t>(cuda_stream), message,
                                                      sizeof(message));
  return prime_kernels::api::from_status(rc, message);
#else
  (void)a, (void)lda, (void)b, (void)ldb, (void)c, (void)c_is_bf16, (void)accumulate, (void)group_offsets;
  (void)num_groups, (void)p_total, (void)m, (void)n, (void)num_sms, (void)cuda_stream;
  return prime_kernels::api::fail(PK_ERR_NOT_AVAILABLE,
                              "k_grouped_bf16_gemm is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a");
#endif
}

int pk_k_grouped_fp8_gemm_tn(const void* a, int64_t lda, const float* sa, int64_t ld_sa, const void* b, int64_t ldb,
                             const float* sb, int64_t ld_sb, void* c, int c_is_bf16, int accumulate,
                             const int32_t* group_offsets, int num_groups, int64_t p_total, int64_t m, int64_t n,
                             int num_sms, void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = current_device_is_sm90("k_grouped_fp8_gemm_tn"); rc != PK_OK) return rc;
  PK_CHECK_ARG(num_sms >= 0, "k_grouped_fp8_gemm_tn: num_sms = %d, must be >= 0 (0 = every SM)", num_sms);
  prime_kernels::sm90::GroupedGemmConfig cfg = prime_kernels::sm90::k_grouped_fp8_gemm_config(m, n, p_total, num_groups,
                                                                                     c_is_bf16 != 0);
  cfg.num_sms = num_sms;
  prime_kernels::sm90::KGroupedFp8GemmArgs args;
  args.a = a;
  args.lda = lda;
  args.sa = sa;
  args.ld_sa = ld_sa;
  args.b = b;
  args.ldb = ldb;
  args.sb = sb;
  args.ld_sb = ld_sb;
  args.c = c;
  args.c_is_bf16 = c_is_bf16 != 0;
  args.accumulate = accumulate != 0;
  args.group_offsets = group_offsets;
  args.num_groups = num_groups;
  args.p_total = p_total;
  args.m = m;
  args.n = n;
  args.config = &cfg;
  char message[512] = {0};
  const int rc = prime_kernels::sm90::k_grouped_fp8_gemm_tn(args, static_cast<cudaStream_t>(cuda_stream), message,
                                                          sizeof(message));
  return prime_kernels::api::from_status(rc, message);
#else
  (void)a, (void)lda, (void)sa, (void)ld_sa, (void)b, (void)ldb, (void)sb, (void)ld_sb, (void)c, (void)c_is_bf16;
  (void)accumulate, (void)group_offsets, (void)num_groups, (void)p_total, (void)m, (void)n, (void)num_sms;
  (void)cuda_stream;
  return prime_kernels::api::fail(PK_ERR_NOT_AVAILABLE,
                              "k_grouped_fp8_gemm_tn is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a");
#endif
}

}  // extern "C"
