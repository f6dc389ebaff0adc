// C ABI of the fused Mega MoE forwards (sm90, BF16 and FP8): device check, then the launcher (which validates shapes).
#include "api/prime_kernels_api.h"
#include "api/errors.hpp"
#include "sm90/mega_moe.hpp"  // header-only sizes, also without the kernels

namespace {

// pk_mega_moe_fwd_bf16 and its second-B variant (second non-null): one argument list, one set of checks.
int fwd_bf16(const char* fn, const PkMegaSecondB* second, const void* const* x_ranks, int num_ranks, int64_t ld_x,
             const int32_t* pool_src_route, const int32_t* pool_src_rank, int top_k, const int32_t* expert_offsets,
             int num_experts, int64_t m_total, int64_t hidden, int64_t inter, const void* w13, const void* w2,
             void* x_pool, void* s, void* h, void* o, int64_t num_tokens, const int32_t* route_to_pool, float clamp,
             int32_t* counters, int num_sms, void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = prime_kernels::api::check_device_findings(fn); rc != PK_OK) return rc;
  if (const int rc = prime_kernels::api::check_current_device(prime_kernels::api::ArchFamily::kSm90); rc != PK_OK) return rc;
  prime_kernels::sm90::MegaFwdArgs args;
  static_cast<prime_kernels::common::MegaFwdCommonArgs&>(args) = prime_kernels::common::mega_fwd_common_args(
      ld_x, pool_src_route, top_k, expert_offsets, num_experts, m_total, hidden, inter, w13, w2, x_pool, s, h, o,
      num_tokens, clamp, num_sms);
  args.x_ranks = x_ranks;
  args.num_ranks = num_ranks;
  args.pool_src_rank = pool_src_rank;
  args.route_to_pool = route_to_pool;
  args.counters = counters;
  char message[512] = {0};
  const auto stream = static_cast<cudaStream_t>(cuda_stream);
  int rc = 0;
  if (second == nullptr) {
    rc = prime_kernels::sm90::mega_moe_fwd_bf16(args, stream, message, sizeof(message));
  } else {
    prime_kernels::sm90::MegaFwdSecondBArgs b;
    b.w13b = second->shared_w13;
    b.w2b = second->shared_w2;
    b.slabs = second->slabs;
    b.chunks = second->chunks;
    b.num_b_groups = second->num_b_groups;
    rc = prime_kernels::sm90::mega_moe_fwd_bf16_second_b(args, b, stream, message, sizeof(message));
  }
  return prime_kernels::api::from_status(rc, message);
#else
  (void)second, (void)x_ranks, (void)num_ranks, (void)ld_x, (void)pool_src_route, (void)pool_src_rank, (void)top_k;
  (void)expert_offsets, (void)num_experts, (void)m_total, (void)hidden, (void)inter, (void)w13, (void)w2;
  (void)x_pool, (void)s, (void)h, (void)o, (void)num_tokens, (void)route_to_pool, (void)clamp, (void)counters;
  (void)num_sms, (void)cuda_stream;
  return prime_kernels::api::fail(PK_ERR_NOT_AVAILABLE, "%s is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a",
                                  fn);
#endif
}

}  // namespace

extern "C" {

int64_t pk_mega_moe_fwd_counter_count(int64_t m_total, int num_experts) {
  return prime_kernels::sm90::mega_moe_fwd_counter_count(m_total, num_experts);
}

int pk_mega_moe_fwd_bf16(const void* const* x_ranks, int num_ranks, int64_t ld_x, const int32_t* pool_src_route,
                         const int32_t* pool_src_rank, int top_k, const int32_t* expert_offsets, int num_experts,
                         int64_t m_total, int64_t hidden, int64_t inter, const void* w13, const void* w2, void* x_pool,
                         void* s, void* h, void* o, int64_t num_tokens, const int32_t* route_to_pool, float clamp,
                         int32_t* counters, int num_sms, void* cuda_stream) {
  return fwd_bf16("mega_moe_fwd_bf16", nullptr, x_ranks, num_ranks, ld_x, pool_src_route, pool_src_rank, top_k,
                  expert_offsets, num_experts, m_total, hidden, inter, w13, w2, x_pool, s, h, o, num_tokens,
                  route_to_pool, clamp, counters, num_sms, cuda_stream);
}

int pk_mega_moe_fwd_bf16_second_b(const void* const* x_ranks, int num_ranks, int64_t ld_x,
                                  const int32_t* pool_src_route, const int32_t* pool_src_rank, int top_k,
                                  const int32_t* expert_offsets, int num_experts, int64_t m_total, int64_t hidden,
                                  int64_t inter, const void* w13, const void* w2, const PkMegaSecondB* second,
                                  void* x_pool, void* s, void* h, void* o, int64_t num_tokens,
                                  const int32_t* route_to_pool, float clamp, int32_t* counters, int num_sms,
                                  void* cuda_stream) {
  PK_CHECK_ARG(second != nullptr, "mega_moe_fwd_bf16_second_b: null second");
  return fwd_bf16("mega_moe_fwd_bf16_second_b", second, x_ranks, num_ranks, ld_x, pool_src_route, pool_src_rank,
                  top_k, expert_offsets, num_experts, m_total, hidden, inter, w13, w2, x_pool, s, h, o, num_tokens,
                  route_to_pool, clamp, counters, num_sms, cuda_stream);
}

int pk_mega_moe_fwd_bf16_ranks(const pk_mega_fwd_rank* ranks, int num_ranks, int num_sms, void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = prime_kernels::api::check_device_findings("mega_moe_fwd_bf16_ranks"); rc != PK_OK) return rc;
  if (const int rc = prime_kernels::api::check_current_device(prime_kernels::api::ArchFamily::kSm90); rc != PK_OK) return rc;
  constexpr int kMax = prime_kernels::sm90::kMegaFwdMaxLaunchRanks;
  PK_CHECK_ARG(ranks != nullptr && num_ranks >= 1 && num_ranks <= kMax, "mega_moe_fwd_bf16_ranks: %d ranks, must be in "
               "[1, %d]", num_ranks, kMax);
  prime_kernels::sm90::MegaFwdArgs args[kMax];
  for (int r = 0; r < num_ranks; ++r) {
    const pk_mega_fwd_rank& c = ranks[r];
    prime_kernels::sm90::MegaFwdArgs& a = args[r];
    // The launch's num_sms is the call's (each rank's is ignored).
    static_cast<prime_kernels::common::MegaFwdCommonArgs&>(a) = prime_kernels::common::mega_fwd_common_args(
        c.ld_x, c.pool_src_route, c.top_k, c.expert_offsets, c.num_experts, c.m_total, c.hidden, c.inter, c.w13, c.w2,
        c.x_pool, c.s, c.h, c.o, c.num_tokens, c.clamp, 0);
    a.x_ranks = c.x_ranks;
    a.num_ranks = c.num_ranks;
    a.pool_src_rank = c.pool_src_rank;
    a.o_slots = c.o_slots;
    a.ld_slots = c.ld_slots;
    a.route_to_pool = c.route_to_pool;
    a.counters = c.counters;
  }
  char message[512] = {0};
  const int rc = prime_kernels::sm90::mega_moe_fwd_bf16_ranks(args, num_ranks, num_sms,
                                                           static_cast<cudaStream_t>(cuda_stream), message,
                                                           sizeof(message));
  return prime_kernels::api::from_status(rc, message);
#else
  (void)ranks, (void)num_ranks, (void)num_sms, (void)cuda_stream;
  return prime_kernels::api::fail(PK_ERR_NOT_AVAILABLE,
                              "mega_moe_fwd_bf16_ranks is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a");
#endif
}

int pk_mega_moe_fwd_fp8(const void* x, int64_t ld_x, int64_t num_tokens, const int32_t* pool_src_route, int top_k,
                        const int32_t* route_to_pool, const int32_t* expert_offsets, int num_experts, int64_t m_total,
                        int64_t hidden, int64_t inter, const void* w13_q, const float* w13_sb,
                        int64_t w13_sb_group_stride, int64_t w13_sb_n_stride, const void* w2_q, const float* w2_sb,
                        int64_t w2_sb_group_stride, int64_t w2_sb_n_stride, void* x_q, int64_t ld_x_q, float* x_sa,
                        int64_t ld_x_sa, void* s_q, float* s_sa, int64_t ld_s_sa, void* h, void* o, int pow2_scales,
                        int32_t* counters, int num_sms, void* cuda_stream) {
#if PK_HAS_SM90_KERNELS
  if (const int rc = prime_kernels::api::check_device_findings("mega_moe_fwd_fp8"); rc != PK_OK) return rc;
  if (const int rc = prime_kernels::api::check_current_device(prime_kernels::api::ArchFamily::kSm90); rc != PK_OK) return rc;
  prime_kernels::sm90::MegaFwdFp8Args args;
  args.x = x;
  args.ld_x = ld_x;
  args.num_tokens = num_tokens;
  args.pool_src_route = pool_src_route;
  args.top_k = top_k;
  args.route_to_pool = route_to_pool;
  args.expert_offsets = expert_offsets;
  args.num_experts = num_experts;
  args.m_total = m_total;
  args.hidden = hidden;
  args.inter = inter;
  args.w13_q = w13_q;
  args.w13_sb = w13_sb;
  args.w13_sb_group_stride = w13_sb_group_stride;
  args.w13_sb_n_stride = w13_sb_n_stride;
  args.w2_q = w2_q;
  args.w2_sb = w2_sb;
  args.w2_sb_group_stride = w2_sb_group_stride;
  args.w2_sb_n_stride = w2_sb_n_stride;
  args.x_q = x_q;
  args.ld_x_q = ld_x_q;
  args.x_sa = x_sa;
  args.ld_x_sa = ld_x_sa;
  args.s_q = s_q;
  args.s_sa = s_sa;
  args.ld_s_sa = ld_s_sa;
  args.h = h;
  args.o = o;
  args.pow2_scales = pow2_scales != 0;
  args.counters = counters;
  args.num_sms = num_sms;
  char message[512] = {0};
  const int rc = prime_kernels::sm90::mega_moe_fwd_fp8(args, static_cast<cudaStream_t>(cuda_stream), message,
                                                   sizeof(message));
  return prime_kernels::api::from_status(rc, message);
#else
  (void)x, (void)ld_x, (void)num_tokens, (void)pool_src_route, (void)top_k, (void)expert_offsets, (void)num_experts;
  (void)route_to_pool, (void)m_total, (void)hidden, (void)inter, (void)w13_q, (void)w13_sb, (void)w13_sb_group_stride;
  (void)w13_sb_n_stride, (void)w2_q, (void)w2_sb, (void)w2_sb_group_stride, (void)w2_sb_n_stride, (void)x_q;
  (void)ld_x_q, (void)x_sa, (void)ld_x_sa, (void)s_q, (void)s_sa, (void)ld_s_sa, (void)h, (void)o, (void)pow2_scales;
  (void)counters, (void)num_sms, (void)cuda_stream;
  return prime_kernels::api::fail(PK_ERR_NOT_AVAILABLE,
                              "mega_moe_fwd_fp8 is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS=90a");
#endif
}

}  // extern "C"
