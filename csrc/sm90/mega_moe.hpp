// prime-kernels: host launch functions of the sm90a fused Mega MoE forwards (BF16: csrc/sm90/mega_moe_fwd.cuh; FP8:
// csrc/sm90/mega_moe_fwd_fp8.cuh).
//
// Plain C++ over raw device pointers; same conventions as grouped_gemm.hpp (status.hpp's codes, err message,
// asynchronous on `stream`, everything validated before the device is touched).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/mega_fwd_args.hpp"
#include "m_blocks.hpp"
#include "status.hpp"

namespace prime_kernels {
namespace sm90 {

// int32 counters the forward needs (zeroed by the launch itself, on `stream`): dispatch and L1 per m-block, then
// the work-claim counters (mega_moe_fwd_roles.cuh, MegaFwdClaim).
constexpr int64_t kMegaFwdClaimCounters = 4;
// The most ranks one launch of mega_moe_fwd_bf16_ranks plays (= the pointer tables' length, kMegaMaxRanks).
constexpr int kMegaFwdMaxLaunchRanks = 8;
inline int64_t mega_moe_fwd_counter_count(int64_t m_total, int num_experts) {
  return 2 * max_m_blocks(m_total, num_experts) + kMegaFwdClaimCounters;
}

// One forward of the layer's routed experts over a routing plan (pool rows grouped by expert, no padding
// needed). Host-side arguments of mega_moe_fwd_bf16, all required unless marked: the fields of
// common::MegaFwdCommonArgs (common/mega_fwd_args.hpp), with x_ranks as the token rows, and these. Here o may be
// x_pool because the rows of an m-block are overwritten only after every L1 tile of it has read them; num_sms is the
// number of CTAs to launch (one per SM).
struct MegaFwdArgs : common::MegaFwdCommonArgs {
  // num_ranks (1..8) pointers to bf16 token rows [< 2^28, hidden] (each rank's x has at least num_tokens rows),
  // row stride ld_x
  const void* const* x_ranks = nullptr;
  int num_ranks = 0;
  // device int32 [m_total]: the source rank per pool row, or null: rank 0
  const int32_t* pool_src_rank = nullptr;
  // Expert parallelism over peer memory, or null: num_ranks pointers to the source ranks' combine slots, bf16 [>=
  // num_tokens * top_k, ld_slots]; L2 row m then goes to o_slots[pool_src_rank[m]] + pool_src_route[m] * ld_slots
  // instead of o (o is not written; it may be x_pool's buffer still). Padding rows go nowhere.
  void* const* o_slots = nullptr;
  int64_t ld_slots = 0;
  // device int32 [num_tokens * top_k] (pool row per route, < 0: none), or null. With one rank the dispatch walks
  // the tokens through it for the pool rows past a split (each x row read once); a row it does not name
  // consistently with pool_src_route is copied from pool_src_route.
  const int32_t* route_to_pool = nullptr;
  // device int32 [mega_moe_fwd_counter_count(m_total, num_experts)] scratch
  int32_t* counters = nullptr;
};

// All pointers 16-byte aligned. Rows of the outputs outside [0, expert_offsets[num_experts]) are not written; nothing
// is written when expert_offsets is not a plan (reported like a bad route). The combine is a separate launch
// (common/combine.hpp).
int mega_moe_fwd_bf16(const MegaFwdArgs& args, cudaStream_t stream, char* err, size_t err_len);

// Shared experts as the last groups of a one-rank forward (mega_moe_fwd_roles.cuh, MegaFwdSecondB): groups
// [num_b_groups, num_experts) read B from the shared experts' weights, bf16 and contiguous,
// w13b [slabs, 2 * chunks * inter, hidden] (gate rows, then up rows) and w2b [slabs, hidden, chunks * inter]:
// group num_b_groups + v is chunk v % chunks of shared expert v / chunks. w13 and w2 of MegaFwdArgs then hold
// num_b_groups experts; num_experts counts every group (num_b_groups + slabs * chunks).
struct MegaFwdSecondBArgs {
  const void* w13b = nullptr;
  const void* w2b = nullptr;
  int slabs = 0;
  int chunks = 0;
  int num_b_groups = 0;
};
int mega_moe_fwd_bf16_second_b(const MegaFwdArgs& args, const MegaFwdSecondBArgs& second, cudaStream_t stream,
                               char* err, size_t err_len);

// The forwards of num_ranks (1..8) ranks in one launch, CTAs split evenly over the ranks with pool rows (the one-GPU
// emulation of expert parallelism; mega_moe_fwd.cuh, MegaFwdRanksLaunch). Each rank's arguments as above (their
// num_sms is ignored: num_sms, 0 = every SM, is the launch's). Every rank is checked before anything is launched.
int mega_moe_fwd_bf16_ranks(const MegaFwdArgs* ranks, int num_ranks, int num_sms, cudaStream_t stream, char* err,
                            size_t err_len);

// One FP8 forward over a routing plan: the quantizing dispatch (common/dispatch_rows_fp8.cuh: token rows to their
// routes' pool rows through route_to_pool), then the fused kernel (csrc/sm90/mega_moe_fwd_fp8.cuh), which zeroes the
// rows no route names back (a padded plan's padding rows) and runs L1 and L2. Single rank. Host-side arguments of
// mega_moe_fwd_fp8, all required unless marked; e4m3 tensors are raw bytes:
struct MegaFwdFp8Args {
  // bf16 token rows [num_tokens, hidden], row stride ld_x (>= hidden, % 8); may be null when num_tokens is 0
  const void* x = nullptr;
  int64_t ld_x = 0;
  int64_t num_tokens = 0;
  // device int32 [m_total]: token * top_k + k per pool row (< 0: a row of zeros; >= num_tokens * top_k: read as
  // zeros and reported, as in the BF16 forward)
  const int32_t* pool_src_route = nullptr;
  int top_k = 0;
  // device int32 [num_tokens * top_k]: the pool row of each route (< 0: none; the plan's, consistent with
  // pool_src_route; a row it does not name is zeroed)
  const int32_t* route_to_pool = nullptr;
  // device int32 [num_experts + 1] (1..512 experts), non-decreasing, last <= m_total
  const int32_t* expert_offsets = nullptr;
  int num_experts = 0;
  int64_t m_total = 0;
  // multiples of 128
  int64_t hidden = 0;
  int64_t inter = 0;
  // e4m3 [num_experts, 2 * inter, hidden] and [num_experts, hidden, inter], contiguous; their 128 x 128 block scales
  // fp32 [num_experts, 2 * inter / 128, hidden / 128] and [num_experts, hidden / 128, inter / 128] at
  // sb[e * group_stride + nb * n_stride + kb]
  const void* w13_q = nullptr;
  const float* w13_sb = nullptr;
  int64_t w13_sb_group_stride = 0;
  int64_t w13_sb_n_stride = 0;
  const void* w2_q = nullptr;
  const float* w2_sb = nullptr;
  int64_t w2_sb_group_stride = 0;
  int64_t w2_sb_n_stride = 0;
  // out: the pool, e4m3 [m_total, hidden] (row stride ld_x_q bytes: >= hidden, % 16), and its scales K-block major
  // x_sa[j * ld_x_sa + m] (ld_x_sa >= m_total, % 4). x_q may be o itself with ld_x_q = 2 * hidden (row m in the
  // first half of o's row m: an m-block's o rows are written only after every L1 tile of it has read its x_q rows),
  // which saves m_total * hidden bytes of peak memory.
  void* x_q = nullptr;
  int64_t ld_x_q = 0;
  float* x_sa = nullptr;
  int64_t ld_x_sa = 0;
  // out: qK(s, 64), e4m3 [m_total, inter] contiguous, scales s_sa[j * ld_s_sa + m] (ld_s_sa >= m_total, % 4)
  void* s_q = nullptr;
  float* s_sa = nullptr;
  int64_t ld_s_sa = 0;
  // out, or null: gate | up rounded to bf16, [m_total, 2 * inter] contiguous
  void* h = nullptr;
  // out: bf16 [m_total, hidden] contiguous, the L2 rows (the combine's input)
  void* o = nullptr;
  bool pow2_scales = false;
  // device int32 [mega_moe_fwd_counter_count(m_total, num_experts)] scratch
  int32_t* counters = nullptr;
  int num_sms = 0;  // CTAs to launch (one per SM), 0: every SM; the result is the same at every value
};
int mega_moe_fwd_fp8(const MegaFwdFp8Args& args, cudaStream_t stream, char* err, size_t err_len);

}  // namespace sm90
}  // namespace prime_kernels
