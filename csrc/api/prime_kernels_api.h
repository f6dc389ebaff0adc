// The C ABI of the prime-kernels core (libprime_kernels_core.so).
//
// Every entry point takes raw pointers, sizes and a cudaStream_t, validates its arguments before
// touching the device, and returns a status code. On failure the reason is kept in a thread-local
// string (pk_last_error). Nothing here aborts or prints. No torch or Python types cross this line.
#pragma once

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define PK_API __attribute__((visibility("default")))
#else
#define PK_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

// Status codes.
enum {
  PK_OK = 0,
  PK_ERR_INVALID_ARGUMENT = 1,  // a bad shape, pointer, alignment or value: fix the call
  PK_ERR_NOT_AVAILABLE = 2,     // no kernel for this device/arch in this build
  PK_ERR_CUDA = 3,              // a CUDA runtime/driver call failed
  PK_ERR_INTERNAL = 4,
};

// Bumped whenever a signature below changes; the Python loader refuses a mismatch.
#define PK_ABI_VERSION 11
PK_API int pk_abi_version(void);

// The message of the last failed call on this thread ("" if none).
PK_API const char* pk_last_error(void);

// Comma-separated arches this library holds SASS for, e.g. "90a,100a".
PK_API const char* pk_built_archs(void);

// Comma-separated "kernel:arch" pairs compiled into this library, e.g. "routing_plan:90a,...".
PK_API const char* pk_compiled_kernels(void);

// Whether the library holds an image that runs on device `device_index` (0 = yes; otherwise an
// error code and pk_last_error says why, e.g. "device sm_89 ... rebuild with ...").
PK_API int pk_check_device(int device_index);

// ---------------------------------------------------------------------------------------------
// Routing plan. From topk_idx [num_tokens, top_k] (int32 or int64; -1 = masked route) builds the
// expert-grouped pool: pool rows are in stable (expert, token, k) order, each expert's rows start
// at expert_offsets[e], a multiple of block_m, and are padded up to a multiple of block_m.
//
// Outputs (all int32, device memory for the CUDA entry point, host memory for the CPU one):
//   expert_counts  [num_experts]       routes per expert
//   expert_offsets [num_experts + 1]   first pool row of each expert; [num_experts] = rows in use
//   pool_src_route [pool_capacity]     token * top_k + k of each pool row, -1 for padding rows
//   pool_src_rank  [pool_capacity]     source rank of each pool row (= `rank`), -1 for padding
//   route_to_pool  [num_tokens, top_k] pool row of each route, -1 for masked routes
//   num_invalid    [1]                 routes whose id is < -1 or >= num_experts (treated as masked)
// pool_capacity must be >= pk_routing_plan_pool_capacity(num_tokens, top_k, num_experts, block_m).
// The CUDA entry point needs `workspace` of pk_routing_plan_workspace_bytes(...) bytes.
// ---------------------------------------------------------------------------------------------
PK_API int64_t pk_routing_plan_pool_capacity(int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                             int64_t block_m);
PK_API int64_t pk_routing_plan_workspace_bytes(int64_t num_tokens, int64_t top_k, int64_t num_experts);

PK_API int pk_routing_plan_cuda(const void* topk_idx, int topk_idx_is_int64, int64_t num_tokens,
                                int64_t top_k, int64_t num_experts, int64_t block_m, int32_t rank,
                                int32_t* expert_counts, int32_t* expert_offsets,
                                int32_t* pool_src_route, int32_t* pool_src_rank, int64_t pool_capacity,
                                int32_t* route_to_pool, int32_t* num_invalid, void* workspace,
                                int64_t workspace_bytes, void* cuda_stream);

PK_API int pk_routing_plan_cpu(const void* topk_idx, int topk_idx_is_int64, int64_t num_tokens,
                               int64_t top_k, int64_t num_experts, int64_t block_m, int32_t rank,
                               int32_t* expert_counts, int32_t* expert_offsets, int32_t* pool_src_route,
                               int32_t* pool_src_rank, int64_t pool_capacity, int32_t* route_to_pool,
                               int32_t* num_invalid);

// ---------------------------------------------------------------------------------------------
// sm90 BF16 grouped GEMMs (fp32 accumulation). Rows are grouped by a device int32 array
// group_offsets [num_groups + 1] of cumulative row starts (no padding needed, empty groups allowed).
// Strides are in elements; every base pointer 16-byte aligned; n, k (and m for k-grouped) multiples of 8.
//
// m-grouped:  D[r, :] = A[r, :] @ B_g^T for r in [group_offsets[g], group_offsets[g+1]).
//   A bf16 [m_total, k] (row stride lda); D bf16 [m_total, n] (ldd); rows outside every group untouched.
//   B bf16 per group at b + g * b_group_stride: b_k_major = 1: [n, k] (row stride ldb), "nt", x @ W^T;
//   b_k_major = 0: [k, n] (row stride ldb), "nn", dy @ W, read MN-major (no transposed copy).
// k-grouped:  C_g = A_g^T @ B_g with A_g, B_g the group's rows of A [p_total, m] and B [p_total, n].
//   C [num_groups, m, n] contiguous: fp32 (store, or += when accumulate) or bf16 (store only).
// group_offsets must satisfy 0 <= offsets[0] <= ... <= offsets[num_groups] <= m_total (p_total); rows before
// offsets[0] belong to no group. num_sms: the most CTAs (one per SM) the kernel runs (0 = every SM); every value
// gives the same bits (no CTA waits on another, so any subset of SMs makes progress).
//
// Device-side value checks (this block, the combine and dispatch, and the SwiGLU kernels below): values these ops
// read from device memory are checked by the kernels, so no call synchronises. Offsets that break the rule above
// make the GEMM write nothing; an index outside its range (a_row_index past A's rows, a route past the rows or
// route weights it indexes; -1 is always a valid "masked") is treated as masked (a zero row, weight 0, a skipped
// route). Either way the kernel records the finding in mapped pinned host memory, and the next call of any of these
// entry points fails with PK_ERR_INVALID_ARGUMENT, saying what was found, before it launches anything (the finding
// is then cleared). pk_device_check reports (and clears) findings on request: call it after synchronising the
// stream to check a given call. It also reports a wait that timed out (PK_ERR_CUDA: the context is lost).
// ---------------------------------------------------------------------------------------------
PK_API int pk_device_check(void);

PK_API int pk_m_grouped_bf16_gemm(const void* a, int64_t lda, const void* b, int b_k_major, int64_t ldb,
                                  int64_t b_group_stride, void* d, int64_t ldd, const int32_t* group_offsets,
                                  int num_groups, int64_t m_total, int64_t n, int64_t k, int num_sms,
                                  void* cuda_stream);

// m-grouped "nn" (A [m_total, k] pooled, B [num_groups, k, n] MN-major) whose rows go to their routes in the ranks'
// buffers instead of an output tensor: row m to push_slots[pool_src_rank[m]] + pool_src_route[m] * ld_slots (bf16,
// 16-byte aligned; expert parallelism over peer memory: a backward's dX rows into their source ranks' combine slots,
// written by the epilogue while the remaining tiles run). Rows whose route lies outside [0, num_routes) (a plan's
// padding) go nowhere; pool_src_rank null: every row to rank 0; 1 <= num_ranks <= 8.
PK_API int pk_m_grouped_bf16_gemm_nn_to_routes(const void* a, int64_t lda, const void* b, int64_t ldb,
                                               int64_t b_group_stride, void* const* push_slots, int num_ranks,
                                               int64_t ld_slots, const int32_t* pool_src_route,
                                               const int32_t* pool_src_rank, int64_t num_routes,
                                               const int32_t* group_offsets, int num_groups, int64_t m_total,
                                               int64_t n, int64_t k, int num_sms, void* cuda_stream);

// m-grouped with A gathered: pool row r reads row a_row_index[r] of A [a_rows, k] (-1 reads zeros; another index
// outside [0, a_rows) reads zeros too and is a device finding), so a token gather needs no materialised copy. D is
// [m_total, n].
PK_API int pk_m_grouped_bf16_gemm_gather_a(const void* a, int64_t lda, int64_t a_rows,
                                           const int32_t* a_row_index, const void* b, int b_k_major,
                                           int64_t ldb, int64_t b_group_stride, void* d, int64_t ldd,
                                           const int32_t* group_offsets, int num_groups, int64_t m_total,
                                           int64_t n, int64_t k, int num_sms, void* cuda_stream);

// L1 with the SwiGLU epilogue: for the rows of group g (A read through a_row_index when non-null),
// gate|up = A @ w13[g]^T in fp32 (w13 [num_groups, 2I, k], natural layout: gate rows then up rows),
// s = bf16(silu(min(gate, c)) * clamp(up, -c, c)) [m_total, I], and h = bf16(gate|up) [m_total, 2I]
// when h is non-null (with a clamp, rounded keeping the clamp masks: reference F6). I a multiple of 64; clamp 0 = none.
PK_API int pk_m_grouped_bf16_gemm_swiglu(const void* a, int64_t lda, int64_t a_rows, const int32_t* a_row_index,
                                         const void* w13, int64_t ldb, int64_t b_group_stride,
                                         int64_t intermediate, void* s, int64_t lds, void* h, int64_t ldh,
                                         const int32_t* group_offsets, int num_groups, int64_t m_total,
                                         int64_t k, float clamp, int num_sms, void* cuda_stream);

// Shared experts as extra groups of the m-grouped BF16 GEMMs below (the "_second_b" entry points): groups
// [num_b_groups, num_groups) read their B from b2, `slabs` experts of intermediate size chunks * I, chunk by chunk
// (group num_b_groups + v is chunk v % chunks of expert v / chunks: a SwiGLU expert of width m * I is m experts of
// width I). Layouts: the SwiGLU L1 b2 [slabs, 2 * chunks * I, k] (gate rows, then up rows); the K-major "nt" GEMM
// (the L2, I = k) b2 [slabs, n, chunks * k]; the MN-major "nn" GEMM (the L1 dgrad, I = k / 2) b2
// [slabs, 2 * chunks * I, n]. ldb2 the row stride, b2_group_stride between experts (elements, multiples of 8);
// I a multiple of 64; A pooled (not gathered) except for the SwiGLU L1.
typedef struct PkSecondB {
  const void* b2;
  int64_t ldb2;
  int64_t b2_group_stride;
  int slabs;
  int chunks;
  int num_b_groups;
} PkSecondB;

PK_API int pk_m_grouped_bf16_gemm_second_b(const void* a, int64_t lda, const void* b, int b_k_major, int64_t ldb,
                                           int64_t b_group_stride, const PkSecondB* second_b, void* d, int64_t ldd,
                                           const int32_t* group_offsets, int num_groups, int64_t m_total, int64_t n,
                                           int64_t k, int num_sms, void* cuda_stream);
PK_API int pk_m_grouped_bf16_gemm_swiglu_second_b(const void* a, int64_t lda, int64_t a_rows,
                                                  const int32_t* a_row_index, const void* w13, int64_t ldb,
                                                  int64_t b_group_stride, const PkSecondB* second_b,
                                                  int64_t intermediate, void* s, int64_t lds, void* h, int64_t ldh,
                                                  const int32_t* group_offsets, int num_groups, int64_t m_total,
                                                  int64_t k, float clamp, int num_sms, void* cuda_stream);

// L2 dgrad with the SwiGLU backward in its epilogue: per group g, da = dy_pool @ w2[g] (w2 [num_groups,
// hidden, I], read MN-major) stays in registers; with h the saved gate | up [m_total, 2I] and w =
// route_weights[pool_src_route[row]] (route_weights has num_routes entries; route -1 = padding, weight 0), writes
// dh [m_total, 2I], aw = w * s [m_total, I] (bf16) and dt_part [m_total, dt_ld >= ceil(I / 128)] (fp32 partials
// of d topk_weights; their sum in column order is the row's d weight). Rows outside every group are not
// written. I a multiple of 64, hidden a multiple of 8; clamp 0 = none.
PK_API int pk_m_grouped_bf16_gemm_swiglu_bwd(const void* dy_pool, int64_t lda, const void* w2, int64_t ldb,
                                             int64_t b_group_stride, const void* h, int64_t ldh,
                                             const int32_t* pool_src_route, const float* route_weights,
                                             int64_t num_routes, void* dh, int64_t lddh, void* aw, int64_t ldaw,
                                             float* dt_part, int64_t dt_ld, const int32_t* group_offsets,
                                             int num_groups, int64_t m_total, int64_t intermediate, int64_t hidden,
                                             float clamp, int num_sms, void* cuda_stream);

// m-grouped GEMM with blockwise-scaled FP8 operands (sm90; DeepSeek-V3's recipe), bf16 out: for r in group g,
//   D[r, n] = sum over k-blocks kb of 128: (A[r, kb] . B_g[n, kb]) * sa[r, kb] * sb_g[n / 128, kb],
// each k-block's e4m3 products summed by the tensor core, the blocks in fp32. A e4m3 [m_total, k] (row stride lda
// bytes, % 16); B e4m3 per group at b + g * b_group_stride: [n, k] (row stride ldb, % 16), "nt"; sa fp32 K-block
// major: sa[kb * ld_sa + r] (ld_sa >= m_total, % 4, 16-byte aligned); sb fp32 [num_groups, ceil(n / 128), k / 128]
// at sb[g * sb_group_stride + nb * sb_n_stride + kb]; D bf16 [m_total, n] (ldd, % 8). k a multiple of 128, n of 8.
// group_offsets, rows outside every group, num_sms and the device-side check: as the BF16 m-grouped GEMM above.
// a_scale_block: A's scale block along K, 128, or 64 (sa[kb64 * ld_sa + r]: the FP8 forward's L2 operand, quantized
// 1 x 64 by the L1 epilogue; each 128-wide k-block is then promoted in two halves).
PK_API int pk_m_grouped_fp8_gemm_nt(const void* a, int64_t lda, const float* sa, int64_t ld_sa, const void* b,
                                    int64_t ldb, int64_t b_group_stride, const float* sb, int64_t sb_group_stride,
                                    int64_t sb_n_stride, void* d, int64_t ldd, const int32_t* group_offsets,
                                    int num_groups, int64_t m_total, int64_t n, int64_t k, int a_scale_block,
                                    int num_sms, void* cuda_stream);

// The FP8 L2 dgrad with the SwiGLU backward and a quantizing epilogue (sm90; precision "fp8_bwd", docs/fp8.md):
// da = G(qK(dy_pool), W2^T) per group (dy_q / dy_sa as pk_m_grouped_fp8_gemm_nt's A, w2t_q / w2t_sb its B with
// n = intermediate, k = hidden), then with w = route_weights[pool_src_route[r]] and the saved h (bf16 [m_total, 2I],
// ldh elements) the SwiGLU backward in fp32, written quantized: qK(dh, 128) along 2I (dh_q e4m3 [m_total, 2I],
// ld_dh_q bytes; dh_sa[j * ld_dh_sa + r]), qT(dh) (dht_q e4m3 [2I, m_total], ld_dht_q bytes; dht_s[b * ld_dht_s + c])
// and qT(w * s) (awt_q [I, m_total], awt_s), and the d topk_weights partials dt_part [m_total, dt_ld] (fp32, one per
// 128 columns of I). intermediate and hidden multiples of 128; every group offset a multiple of 128 or m_total
// (checked on the device: the call then writes nothing). Padding rows (route -1) are zeros in every output.
PK_API int pk_m_grouped_fp8_gemm_swiglu_bwd(const void* dy_q, int64_t lda, const float* dy_sa, int64_t ld_sa,
                                            const void* w2t_q, int64_t ldb, int64_t b_group_stride,
                                            const float* w2t_sb, int64_t sb_group_stride, int64_t sb_n_stride,
                                            const void* h, int64_t ldh, const int32_t* pool_src_route,
                                            const float* route_weights, int64_t num_routes, void* dh_q,
                                            int64_t ld_dh_q, float* dh_sa, int64_t ld_dh_sa, void* dht_q,
                                            int64_t ld_dht_q, float* dht_s, int64_t ld_dht_s, void* awt_q,
                                            int64_t ld_awt_q, float* awt_s, int64_t ld_awt_s, float* dt_part,
                                            int64_t dt_ld, const int32_t* group_offsets, int num_groups,
                                            int64_t m_total, int64_t intermediate, int64_t hidden, float clamp,
                                            int pow2_scales, int num_sms, void* cuda_stream);

// The FP8 L1 GEMM with the SwiGLU forward and the quantization of s (sm90; precision "fp8", docs/fp8.md):
// h = G(qK(x_pool), W13) per group in fp32 (x_q / x_sa as pk_m_grouped_fp8_gemm_nt's A, w13_q / w13_sb its B with
// n = 2 * intermediate gate | up rows, k = hidden), s = silu(gate) * up on the fp32 h (clamp_limit > 0: gate <= c and
// -c <= up <= c first), written as qK(s, 64) along I (s_q e4m3 [m_total, I], ld_s_q bytes; s_sa[j * ld_s_sa + r],
// j < I / 64: the L2 GEMM's A operand) and, when h is not null, h rounded to bf16 ([m_total, 2I] gate | up, ldh
// elements; with a clamp no value rounds onto or across a bound). intermediate and hidden multiples of 64;
// group_offsets as pk_m_grouped_fp8_gemm_nt's (checked on the device: the call then writes nothing).
PK_API int pk_m_grouped_fp8_gemm_swiglu(const void* x_q, int64_t lda, const float* x_sa, int64_t ld_sa,
                                        const void* w13_q, int64_t ldb, int64_t b_group_stride, const float* w13_sb,
                                        int64_t sb_group_stride, int64_t sb_n_stride, void* s_q, int64_t ld_s_q,
                                        float* s_sa, int64_t ld_s_sa, void* h, int64_t ldh,
                                        const int32_t* group_offsets, int num_groups, int64_t m_total,
                                        int64_t intermediate, int64_t hidden, int pow2_scales, int num_sms,
                                        float clamp_limit, void* cuda_stream);

// ---------------------------------------------------------------------------------------------
// Fused Mega MoE forward (sm90, BF16): dispatch of the token rows into the pool, L1 with SwiGLU and L2 in one
// persistent kernel (csrc/sm90/mega_moe.hpp has the full contract; the combine is pk_combine_bf16_cuda).
// counters: device int32 scratch of pk_mega_moe_fwd_counter_count(m_total, num_experts) entries (zeroed by the call
// itself). num_sms: CTAs (one per SM; 0 = every SM), any value gives the same bits. Invalid plan values found on
// the device (expert_offsets not a plan, routes past num_tokens * top_k) are not read and are reported by the
// next call into the library (PK_ERR_INVALID_ARGUMENT).
// ---------------------------------------------------------------------------------------------
PK_API int64_t pk_mega_moe_fwd_counter_count(int64_t m_total, int num_experts);
PK_API int pk_mega_moe_fwd_bf16(const void* const* x_ranks, int num_ranks, int64_t ld_x,
                                const int32_t* pool_src_route, const int32_t* pool_src_rank, int top_k,
                                const int32_t* expert_offsets, int num_experts, int64_t m_total, int64_t hidden,
                                int64_t inter, const void* w13, const void* w2, void* x_pool, void* s, void* h,
                                void* o, int64_t num_tokens, const int32_t* route_to_pool, float clamp,
                                int32_t* counters, int num_sms, void* cuda_stream);
// The same forward with shared experts as its last groups (one rank: num_ranks 1, pool_src_rank null): groups
// [num_b_groups, num_experts) read their weights from shared_w13 [slabs, 2 * chunks * inter, hidden] (gate rows, then
// up rows) and shared_w2 [slabs, hidden, chunks * inter], bf16 and contiguous, chunk by chunk (group num_b_groups + v
// is chunk v % chunks of shared expert v / chunks); w13 and w2 hold num_b_groups experts, and num_b_groups +
// slabs * chunks = num_experts.
typedef struct PkMegaSecondB {
  const void* shared_w13;
  const void* shared_w2;
  int slabs;
  int chunks;
  int num_b_groups;
} PkMegaSecondB;
PK_API int pk_mega_moe_fwd_bf16_second_b(const void* const* x_ranks, int num_ranks, int64_t ld_x,
                                         const int32_t* pool_src_route, const int32_t* pool_src_rank, int top_k,
                                         const int32_t* expert_offsets, int num_experts, int64_t m_total,
                                         int64_t hidden, int64_t inter, const void* w13, const void* w2,
                                         const PkMegaSecondB* second, void* x_pool, void* s, void* h, void* o,
                                         int64_t num_tokens, const int32_t* route_to_pool, float clamp,
                                         int32_t* counters, int num_sms, void* cuda_stream);
// The sm_100a BF16 fused forward (csrc/sm100/mega_moe_sm100.hpp has the contract), never run on hardware: a caller
// uses it on a device only after it has matched the grouped backend there. pk_mega_moe_fwd_bf16's parameters, so
// one caller's arguments drive either; num_ranks must be 1 and pool_src_rank null (PK_ERR_INVALID_ARGUMENT
// otherwise, before anything is launched); route_to_pool and counters are unused. PK_ERR_NOT_AVAILABLE on a device
// that is not sm_100 and in a build without a Blackwell arch (the function exists in every build).
PK_API int pk_mega_moe_fwd_bf16_sm100(const void* const* x_ranks, int num_ranks, int64_t ld_x,
                                      const int32_t* pool_src_route, const int32_t* pool_src_rank, int top_k,
                                      const int32_t* expert_offsets, int num_experts, int64_t m_total, int64_t hidden,
                                      int64_t inter, const void* w13, const void* w2, void* x_pool, void* s, void* h,
                                      void* o, int64_t num_tokens, const int32_t* route_to_pool, float clamp,
                                      int32_t* counters, int num_sms, void* cuda_stream);

// The forwards of several ranks in one launch, CTAs split evenly over the ranks that have pool rows (the one-GPU
// emulation of expert parallelism over peer memory). Each entry holds one rank's arguments of pk_mega_moe_fwd_bf16
// plus o_slots / ld_slots: null, or num_ranks pointers to the source ranks' combine slots (bf16 [>= num_tokens *
// top_k, ld_slots]): each L2 row then goes to o_slots[pool_src_rank[m]] + pool_src_route[m] * ld_slots instead of o
// (csrc/sm90/mega_moe.hpp, MegaFwdArgs). num_ranks: 1..8 entries; num_sms: the launch's CTAs (0 = every SM). Every
// entry is checked before anything is launched.
typedef struct pk_mega_fwd_rank {
  const void* const* x_ranks;
  int num_ranks;
  int64_t ld_x;
  const int32_t* pool_src_route;
  const int32_t* pool_src_rank;
  int top_k;
  const int32_t* expert_offsets;
  int num_experts;
  int64_t m_total;
  int64_t hidden;
  int64_t inter;
  const void* w13;
  const void* w2;
  void* x_pool;
  void* s;
  void* h;
  void* o;
  void* const* o_slots;
  int64_t ld_slots;
  int64_t num_tokens;
  const int32_t* route_to_pool;
  float clamp;
  int32_t* counters;
} pk_mega_fwd_rank;
PK_API int pk_mega_moe_fwd_bf16_ranks(const pk_mega_fwd_rank* ranks, int num_ranks, int num_sms, void* cuda_stream);

// ---------------------------------------------------------------------------------------------
// Expert parallelism over peer memory (csrc/common/ep_signal.hpp): each rank owns pk_ep_signals_bytes() of zeroed
// memory its peers can write (a symmetric buffer). pk_ep_barrier launches one CTA per played rank (played: the
// ranks this process plays, {rank} on its own GPU, every rank in the one-GPU emulator; signals: every rank's, in rank
// order), kind 0 (enter: the epoch goes up by one, then every peer is waited for) or 1 (exit: after the rank's
// pushes into its peers); phase 0 arrives and waits, and an exit may instead be two launches, phase 1 (arrive only)
// then phase 2 (wait only), with work between them that touches no peer. Waits are bounded by the peer wait timeout (default 60 s), then record the rank, the peer
// and the epochs, and trap.
// ---------------------------------------------------------------------------------------------
PK_API int64_t pk_ep_signals_bytes(void);
PK_API int pk_ep_barrier(void* const* signals, int num_ranks, int kind, int phase, const int32_t* played,
                         int num_played, void* cuda_stream);
// Row moves between a pool and every rank's buffer (csrc/common/peer_rows.hpp): gather (pool[m] = peers[src_rank[m]]
// row src_route[m] / route_divisor, zeros for src_route < 0) or scatter (that peer row = pool[m]). Strides in bytes,
// row_bytes a multiple of 4, peer_rows: the rows of each peer buffer (a larger row index is skipped).
PK_API int pk_peer_rows(void* pool, int64_t ld_pool, void* const* peers, int num_ranks, int64_t ld_peer,
                        int64_t peer_rows, int64_t num_rows, int64_t row_bytes, const int32_t* src_route,
                        const int32_t* src_rank, int route_divisor, int gather, void* cuda_stream);
PK_API int pk_set_peer_wait_timeout(double seconds);  // (0, 3600]
PK_API double pk_get_peer_wait_timeout(void);

// The fused forward in blockwise FP8 (sm90; csrc/sm90/mega_moe.hpp, MegaFwdFp8Args, has the full contract): the
// quantizing dispatch (qK(x, 128), each token row once), then the FP8 L1 with SwiGLU and qK(s, 64) and the FP8 L2 in
// one persistent kernel. Single rank; counters as above. The same bits as the FP8 pipeline's kernels
// (pk_dispatch_rows_fp8, pk_m_grouped_fp8_gemm_swiglu, pk_m_grouped_fp8_gemm_nt with 1 x 64 A scales).
PK_API int pk_mega_moe_fwd_fp8(const void* x, int64_t ld_x, int64_t num_tokens, const int32_t* pool_src_route,
                               int top_k, const int32_t* route_to_pool, const int32_t* expert_offsets,
                               int num_experts, int64_t m_total, int64_t hidden, int64_t inter, const void* w13_q,
                               const float* w13_sb,
                               int64_t w13_sb_group_stride, int64_t w13_sb_n_stride, const void* w2_q,
                               const float* w2_sb, int64_t w2_sb_group_stride, int64_t w2_sb_n_stride, void* x_q,
                               int64_t ld_x_q, float* x_sa, int64_t ld_x_sa, void* s_q, float* s_sa,
                               int64_t ld_s_sa, void* h, void* o, int pow2_scales, int32_t* counters, int num_sms,
                               void* cuda_stream);

// ---------------------------------------------------------------------------------------------
// Fused Mega MoE backward (sm90, BF16; csrc/sm90/mega_moe_bwd.hpp has the full contract): the L2 dgrad with the
// SwiGLU backward (the outputs and arguments of pk_m_grouped_bf16_gemm_swiglu_bwd, same meaning), the L1 dgrad
// dx = dh @ w13[g] (w13 [num_groups, 2I, hidden], row stride ldw13, group stride w13_group_stride; dx bf16
// [m_total, hidden], row stride lddx, rows outside every group not written) and, unless wgrad = 0, the weight
// gradients dw2[g] = dy_pool_g^T (w * s)_g [num_groups, hidden, I] and dw13[g] = dh_g^T x_pool_g [num_groups, 2I,
// hidden] (both contiguous; x_pool bf16 [m_total, hidden], row stride ldx: the token rows in pool order) in one
// persistent kernel whose L1-dgrad tiles wait (bounded) for their m-block's L2-dgrad tiles and whose weight-gradient
// tiles wait for their expert's. wgrad: 0 none, 1 bf16 stores, 2 fp32 stores, 3 fp32 added to dw2 / dw13. hidden a
// multiple of 64. counters: device int32 scratch of pk_mega_moe_bwd_counter_count(m_total, num_groups) entries
// (zeroed by the call itself). lag: the task sequence's lag, -1 for the heuristic's (the same bits for any lag).
// ---------------------------------------------------------------------------------------------
PK_API int64_t pk_mega_moe_bwd_counter_count(int64_t m_total, int num_groups);
PK_API int pk_mega_moe_bwd_bf16(const void* dy_pool, int64_t lda, const void* w2, int64_t ldb, int64_t b_group_stride,
                                const void* h, int64_t ldh, const int32_t* pool_src_route, const float* route_weights,
                                int64_t num_routes, const void* w13, int64_t ldw13, int64_t w13_group_stride,
                                void* dh, int64_t lddh, void* aw, int64_t ldaw, float* dt_part, int64_t dt_ld,
                                void* dx, int64_t lddx, const void* x_pool, int64_t ldx, int wgrad, void* dw2,
                                void* dw13, const int32_t* group_offsets, int num_groups, int64_t m_total,
                                int64_t intermediate, int64_t hidden, float clamp, int32_t* counters, int lag,
                                int num_sms, void* cuda_stream);

// Fused FP8 Mega MoE backward, data gradients (sm90; csrc/sm90/mega_moe_bwd_fp8.hpp has the full contract): the FP8
// L2 dgrad of pk_m_grouped_fp8_gemm_swiglu_bwd (its arguments and outputs, same meaning, the same bits) and the FP8 L1
// dgrad dx = pk_m_grouped_fp8_gemm_nt(qK(dh), W13^T) (dh_q / dh_sa as that GEMM's A; w13t_q e4m3 [num_groups,
// hidden, 2I] with K = 2I contiguous, row stride ldb13, group stride b13_group_stride, and its 128 x 128 block scales
// w13t_sb [num_groups, ceil(hidden / 128), 2I / 128] at w13t_sb[g * sb13_group_stride + nb * sb13_n_stride + kb];
// dx bf16 [m_total, hidden], row stride lddx, rows outside every group not written, the same bits as that GEMM's D)
// in one persistent kernel whose L1-dgrad tiles wait (bounded) for their m-block's L2-dgrad tiles. The weight
// gradients stay with pk_k_grouped_fp8_gemm_tn on the qT outputs. intermediate a multiple of 128, hidden of 64.
// counters: device int32 scratch of pk_mega_moe_bwd_fp8_counter_count(m_total, num_groups) entries (zeroed by the
// call itself). lag: the task sequence's lag, -1 for the heuristic's (the same bits for any lag).
PK_API int64_t pk_mega_moe_bwd_fp8_counter_count(int64_t m_total, int num_groups);
PK_API int pk_mega_moe_bwd_fp8(const void* dy_q, int64_t lda, const float* dy_sa, int64_t ld_sa, const void* w2t_q,
                               int64_t ldb, int64_t b_group_stride, const float* w2t_sb, int64_t sb_group_stride,
                               int64_t sb_n_stride, const void* h, int64_t ldh, const int32_t* pool_src_route,
                               const float* route_weights, int64_t num_routes, void* dh_q, int64_t ld_dh_q,
                               float* dh_sa, int64_t ld_dh_sa, void* dht_q, int64_t ld_dht_q, float* dht_s,
                               int64_t ld_dht_s, void* awt_q, int64_t ld_awt_q, float* awt_s, int64_t ld_awt_s,
                               float* dt_part, int64_t dt_ld, const int32_t* group_offsets, int num_groups,
                               int64_t m_total, int64_t intermediate, int64_t hidden, float clamp, int pow2_scales,
                               const void* w13t_q, int64_t ldb13, int64_t b13_group_stride, const float* w13t_sb,
                               int64_t sb13_group_stride, int64_t sb13_n_stride, void* dx, int64_t lddx,
                               int32_t* counters, int lag, int num_sms, void* cuda_stream);

// ---------------------------------------------------------------------------------------------
// Bounded waits (csrc/common/watchdog.cuh). A kernel wait on another CTA that lasts longer than the timeout
// (default 5 s) records what it waited for in host-mapped memory and traps; the CUDA context is then lost, and
// every later call into the library fails with that record as its message (pk_device_check too).
// ---------------------------------------------------------------------------------------------
PK_API int pk_set_wait_timeout(double seconds);  // (0, 3600]
PK_API double pk_get_wait_timeout(void);
// Launches one CTA that waits, with the given timeout, on a counter nothing releases: it times out on purpose
// (tests of the path above). The CUDA context is lost afterwards.
PK_API int pk_wait_timeout_probe(double timeout_s, void* cuda_stream);

PK_API int pk_k_grouped_bf16_gemm(const void* a, int64_t lda, const void* b, int64_t ldb, void* c,
                                  int c_is_bf16, int accumulate, const int32_t* group_offsets,
                                  int num_groups, int64_t p_total, int64_t m, int64_t n, int num_sms,
                                  void* cuda_stream);

// k-grouped GEMM with blockwise-scaled FP8 operands (sm90; the weight gradients of DeepSeek-V3's recipe): for expert e
// with token rows [group_offsets[e], group_offsets[e + 1]) of the pool,
//   C_e[m, n] (+)= sum over its 128-row token blocks kb of (A_t[m, kb] . B_t[n, kb]) * sa[kb * ld_sa + m] *
//                  sb[kb * ld_sb + n],
// each block's e4m3 products summed by the tensor core, the blocks in fp32. A_t e4m3 [m, p_total] and B_t e4m3
// [n, p_total] token axis contiguous (row strides lda, ldb bytes, % 16; sm90's FP8 wgmma is K-major only); sa, sb fp32
// with one row of m (n) scales per 128-row token block (ld_sa >= m, ld_sb >= n, % 4, 16-byte aligned). C [num_groups,
// m, n] contiguous: fp32 stored or added into (accumulate), or bf16 stored; m and n multiples of 8. group_offsets:
// non-decreasing within [0, p_total], every entry a multiple of 128 or p_total (each expert starts on a whole token
// block, as the routing plan's pool with block_m = 128 lays them out); checked on the device, bad offsets write
// nothing (a device finding). p_total == 0 or an empty expert: C_e = 0, or unchanged when accumulating.
PK_API int pk_k_grouped_fp8_gemm_tn(const void* a, int64_t lda, const float* sa, int64_t ld_sa, const void* b,
                                    int64_t ldb, const float* sb, int64_t ld_sb, void* c, int c_is_bf16,
                                    int accumulate, const int32_t* group_offsets, int num_groups, int64_t p_total,
                                    int64_t m, int64_t n, int num_sms, void* cuda_stream);

// ---------------------------------------------------------------------------------------------
// Combine: out[t] = bf16( sum over k = 0..top_k-1, in order, of w[t,k] * slots[route_to_pool[t,k]] )
// in fp32 (w = 1 when weights is null); routes with row -1 are skipped, an all-masked token gets 0.
// slots bf16 [num_slot_rows, >= hidden] (row stride ld_slots), out bf16 [num_tokens, >= hidden] (ld_out);
// hidden, ld_slots and ld_out multiples of 8; slots and out 16-byte aligned. A route outside
// [-1, num_slot_rows) is skipped and is a device finding (CUDA; see the grouped GEMMs' block) or fails the call
// before anything is written (CPU).
// ---------------------------------------------------------------------------------------------
PK_API int pk_combine_bf16_cuda(const void* slots, int64_t ld_slots, int64_t num_slot_rows,
                                const int32_t* route_to_pool, const float* weights, int64_t num_tokens,
                                int64_t top_k, int64_t hidden, void* out, int64_t ld_out, void* cuda_stream);
PK_API int pk_combine_bf16_cpu(const void* slots, int64_t ld_slots, int64_t num_slot_rows,
                               const int32_t* route_to_pool, const float* weights, int64_t num_tokens,
                               int64_t top_k, int64_t hidden, void* out, int64_t ld_out);

// Dispatch, the combine's transpose: out[route_to_pool[t,k]] = src[t] (bf16 rows copied as they are) for every
// route; routes of -1 write nothing, and rows no route names keep their contents. A route outside [-1, num_rows)
// writes nothing and is a device finding (CUDA) or fails the call before anything is written (CPU). src bf16 [num_tokens, >= hidden] (ld_src), out bf16 [num_rows, >= hidden] (ld_out); hidden, ld_src
// and ld_out multiples of 8; src and out 16-byte aligned.
PK_API int pk_dispatch_rows_bf16_cuda(const void* src, int64_t ld_src, const int32_t* route_to_pool,
                                      int64_t num_tokens, int64_t top_k, int64_t hidden, void* out, int64_t ld_out,
                                      int64_t num_rows, void* cuda_stream);
PK_API int pk_dispatch_rows_bf16_cpu(const void* src, int64_t ld_src, const int32_t* route_to_pool,
                                     int64_t num_tokens, int64_t top_k, int64_t hidden, void* out, int64_t ld_out,
                                     int64_t num_rows);

// ---------------------------------------------------------------------------------------------
// The blockwise-FP8 recipe's quantizing producers (csrc/common/quantize_fp8_args.hpp has the full contract), rounding
// as python/prime_kernels/mega/fp8.py does (fp32 amax, scale = amax / 448 or its power of two above, 1 for a zero
// quotient; q = e4m3 of v / scale by fp32 division, round to nearest even, saturating).
// dispatch_rows_fp8: for every route p = route_to_pool[t, k], q[p] (e4m3, ld_q bytes) = src[t] (bf16, ld_src) in
// 1 x 128 blocks along hidden (a multiple of 128), the scale of block j at sa[j * ld_sa + p] (ld_sa >= num_rows, a
// multiple of 4; q, sa 16-byte aligned, ld_q a multiple of 16: m_grouped_fp8_gemm_nt's A). Routes of -1 write
// nothing; a route outside [-1, num_rows) writes nothing and is a device finding (CUDA) or fails the call before
// anything is written (CPU).
// quantize_tokens_fp8: qT of pool rows v [rows, cols] (bf16, ld_v; cols a multiple of 8) -> q [cols, rows] (e4m3,
// token axis contiguous, ld_q bytes, a multiple of 16) and the scale of column c and 128-row block b at
// scale[b * ld_scale + c] (ld_scale >= cols, a multiple of 4): k_grouped_fp8_gemm_tn's operands. Expert e owns
// rows [expert_offsets[e], expert_offsets[e + 1]) (each a multiple of 128 or rows), of which the first
// expert_counts[e] are live; every other row is read as zero. A broken layout makes the kernel write nothing and is
// a device finding (CUDA) or fails the call before anything is written (CPU). With src_route (else null) v holds
// num_tokens token rows and pool row r reads token row src_route[r] / top_k (a negative route: zeros); a live row's
// route past num_tokens * top_k reads zeros and is a device finding (CUDA) or fails the call (CPU). With v_scale
// (else null) v is e4m3 (ld_v bytes, cols a multiple of 128) and element (r, c) is read as bf16(v * scale), the scale
// at v_scale[r * v_scale_row_stride + (c / 128) * v_scale_block_stride].
// ---------------------------------------------------------------------------------------------
PK_API int pk_dispatch_rows_fp8_cuda(const void* src, int64_t ld_src, const int32_t* route_to_pool,
                                     int64_t num_tokens, int64_t top_k, int64_t hidden, void* q, int64_t ld_q,
                                     float* sa, int64_t ld_sa, int64_t num_rows, int pow2_scales, void* cuda_stream);
PK_API int pk_dispatch_rows_fp8_cpu(const void* src, int64_t ld_src, const int32_t* route_to_pool,
                                    int64_t num_tokens, int64_t top_k, int64_t hidden, void* q, int64_t ld_q,
                                    float* sa, int64_t ld_sa, int64_t num_rows, int pow2_scales);
PK_API int pk_quantize_tokens_fp8_cuda(const void* v, int64_t ld_v, int64_t rows, int64_t cols,
                                       const int32_t* expert_offsets, const int32_t* expert_counts, int num_experts,
                                       void* q, int64_t ld_q, float* scale, int64_t ld_scale, int pow2_scales,
                                       const int32_t* src_route, int64_t num_tokens, int64_t top_k,
                                       const float* v_scale, int64_t v_scale_row_stride,
                                       int64_t v_scale_block_stride, void* cuda_stream);
PK_API int pk_quantize_tokens_fp8_cpu(const void* v, int64_t ld_v, int64_t rows, int64_t cols,
                                      const int32_t* expert_offsets, const int32_t* expert_counts, int num_experts,
                                      void* q, int64_t ld_q, float* scale, int64_t ld_scale, int pow2_scales,
                                      const int32_t* src_route, int64_t num_tokens, int64_t top_k,
                                      const float* v_scale, int64_t v_scale_row_stride,
                                      int64_t v_scale_block_stride);

// A layer's weights w (bf16 [num_mats, rows, cols], rows and cols multiples of 128, contiguous) in 128 x 128 tiles of
// the blockwise-FP8 recipe (python/prime_kernels/mega/fp8.py, quantize_weight): q e4m3 [num_mats, rows, cols] and
// scale fp32 [num_mats, rows / 128, cols / 128], contiguous, w and q 16-byte aligned; one read of w. The CPU entry
// computes the same bits.
PK_API int pk_quantize_weight_fp8_cuda(const void* w, int64_t num_mats, int64_t rows, int64_t cols, void* q,
                                       float* scale, int pow2_scales, void* cuda_stream);
PK_API int pk_quantize_weight_fp8_cpu(const void* w, int64_t num_mats, int64_t rows, int64_t cols, void* q,
                                      float* scale, int pow2_scales);
// The transposed copy of such tiles: qt e4m3 [num_mats, cols, rows] with qt[m, c, r] = q[m, r, c] (rows and cols
// multiples of 128, both contiguous and 16-byte aligned, qt not q).
PK_API int pk_transpose_tiles_fp8_cuda(const void* q, int64_t num_mats, int64_t rows, int64_t cols, void* qt,
                                       void* cuda_stream);
PK_API int pk_transpose_tiles_fp8_cpu(const void* q, int64_t num_mats, int64_t rows, int64_t cols, void* qt);

// ---------------------------------------------------------------------------------------------
// MXFP8 quantization (csrc/common/quantize_mxfp8.hpp has the full contract; docs/mxfp8.md the format): every run of
// 32 elements along a row of x [rows, cols] (bf16, or fp32 with x_fp32; element (r, c) at x[r * x_stride_row +
// c * x_stride_col]; cols a multiple of 32) -> e4m3 values q (bytes at q[r * q_stride_row + c * q_stride_col]) and one
// e8m0 scale byte, RCEIL (rceil != 0) or the OCP floor rule. scale_layout 0: plain, block (r, j) at
// scale[r * scale_ld + j]; 1: the 128 x 4 blocked layout of torch._scaled_grouped_mm, whole (group_axis 0) or per
// group: group_axis 1 groups rows (2d-3d A operand), 2 groups columns (2d-2d operands), group g ending at
// group_ends[g] (int32 [num_groups], device memory for _cuda, host for _cpu). group_starts: an int32 [num_groups]
// workspace in the same memory, filled by the call. The blocked padding is not written (zero the buffer first).
// scale_bytes: the scale buffer's size. The group ends must be non-decreasing within [0, rows] (rows) or [0, cols],
// multiples of 32 (columns), and their padded extent must fit in scale_bytes: checked before anything is written
// on the CPU; on CUDA checked by the device, where a violation makes the call write nothing and is a device finding.
// ---------------------------------------------------------------------------------------------
PK_API int pk_quantize_mxfp8_cuda(const void* x, int x_fp32, int64_t rows, int64_t cols, int64_t x_stride_row,
                                  int64_t x_stride_col, void* q, int64_t q_stride_row, int64_t q_stride_col,
                                  void* scale, int64_t scale_bytes, int scale_layout, int64_t scale_ld,
                                  int group_axis, const int32_t* group_ends, int32_t* group_starts,
                                  int32_t num_groups, int rceil, void* cuda_stream);
PK_API int pk_quantize_mxfp8_cpu(const void* x, int x_fp32, int64_t rows, int64_t cols, int64_t x_stride_row,
                                 int64_t x_stride_col, void* q, int64_t q_stride_row, int64_t q_stride_col,
                                 void* scale, int64_t scale_bytes, int scale_layout, int64_t scale_ld, int group_axis,
                                 const int32_t* group_ends, int32_t* group_starts, int32_t num_groups, int rceil);

// ---------------------------------------------------------------------------------------------
// SwiGLU over pool rows (the grouped pipeline's epilogues). Rows below *num_rows (device int32)
// only; I, the row strides multiples of 8; pointers 16-byte aligned. clamp < 0 means no clamp.
//   fwd: s = bf16(silu(min(g, c)) * clamp(u, -c, c))            h [rows, 2I] = gate | up
//   bwd: with w = topk_weights[pool_src_route[r]] (topk_weights has num_routes entries; route -1: w = 0; a route
//        outside [-1, num_routes) also gets w = 0 and is a device finding): dt[r] = sum da*s; dh = bf16(SwiGLU
//        backward of w*da); a = bf16(w*s)                        (prime_kernels.mega.reference B3-B6, B9)
// *num_rows is clamped to [0, max_rows].
// ---------------------------------------------------------------------------------------------
PK_API int pk_swiglu_fwd_bf16_cuda(const void* h, int64_t ld_h, void* s, int64_t ld_s, int64_t inter,
                                   const int32_t* num_rows, int64_t max_rows, float clamp, void* cuda_stream);
PK_API int pk_swiglu_bwd_bf16_cuda(const void* h, int64_t ld_h, const void* da, int64_t ld_da,
                                   const int32_t* pool_src_route, const float* topk_weights, int64_t num_routes,
                                   int64_t inter,
                                   const int32_t* num_rows, int64_t max_rows, float clamp, void* dh,
                                   int64_t ld_dh, void* a, int64_t ld_a, float* dt, void* cuda_stream);

#ifdef __cplusplus
}  // extern "C"
#endif
