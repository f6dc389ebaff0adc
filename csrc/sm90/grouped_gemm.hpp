// prime-kernels: host launch functions for the sm90a BF16 grouped GEMMs.
//
// Plain C++ over raw device pointers (no torch types); link with the CUDA runtime (static is fine), not
// with libcuda (the tensor-map encoder is fetched through cudaGetDriverEntryPointByVersion).
//
// Every function validates its arguments before touching the device and returns a status code
// (status.hpp: 0 = ok, 1 = invalid argument, 2 = not available on this device/build, 3 = CUDA error). On failure a
// message is written to err (NUL-terminated, truncated to err_len; err may be null). Nothing aborts or
// prints. All launches are asynchronous on `stream`.
//
// Values read from device memory (group offsets, row and route indices) are checked by the kernels, not here (that
// would need a synchronisation): see common/device_check.hpp for what a bad value does and how it is reported.
// config->num_sms (0 = every multiprocessor) caps the persistent grid; every value gives the same bits (no kernel
// here waits on another CTA, see each kernel's header).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "gemm_heuristics.hpp"
#include "m_blocks.hpp"
#include "status.hpp"

namespace prime_kernels {
namespace sm90 {

// Shared experts as extra groups of an m-grouped GEMM (m_grouped_gemm.cuh, kSecondB): groups [num_b_groups,
// num_groups) read B from a second weight tensor b2 of `slabs` experts whose intermediate size is chunks * I, chunk by
// chunk: group num_b_groups + v is chunk v % chunks of expert v / chunks (a SwiGLU expert of width m * I is m experts
// of width I). b2 null: no second B. Its layout is the first B's with the intermediate axis chunks times longer:
//   SwiGLU L1 (I = intermediate):   bf16 [slabs, 2 * chunks * I, k], K contiguous (gate rows, then up rows);
//   K-major "nt" (the L2, I = k):   bf16 [slabs, n, chunks * k];
//   MN-major "nn" (the L1 dgrad, I = k / 2, k % 128 == 0): bf16 [slabs, 2 * chunks * I, n] (gate rows, then up rows).
// ldb2: row stride (elements, >= the contiguous extent, % 8 == 0); b2_group_stride: between experts (elements,
// >= rows * ldb2, % 8 == 0), 16-byte aligned. Built for block_n 256 / 3 stages (the layer's passes; config must be
// null or that).
struct SecondB {
  const void* b2 = nullptr;
  int64_t ldb2 = 0;
  int64_t b2_group_stride = 0;
  int slabs = 0;
  int chunks = 0;
  int num_b_groups = 0;
};

// m-grouped GEMM:  D[m, :] = A[m, :] @ B_g^T  for m in [group_offsets[g], group_offsets[g+1]),
// optionally with A gathered through a row-index list (no materialized copy of the gathered rows):
//   D[m, :] = A[a_row_index[m], :] @ B_g^T.
// Host-side arguments of m_grouped_bf16_gemm and m_grouped_bf16_gemm_gather_a:
struct MGroupedGemmArgs {
  // bf16, row stride lda (elements; lda >= k, lda % 8 == 0), 16-byte aligned: [m_total, k], or [a_rows, k] when
  // gathered
  const void* a = nullptr;
  int64_t lda = 0;
  // Gather only (m_grouped_bf16_gemm wants a_row_index null): rows of a, and device int32 [m_total] row per output
  // row; -1 reads a zero row; another index outside [0, a_rows) also reads a zero row and is a device-check finding.
  // The rows are copied by cp.async (m_grouped_gemm.cuh).
  int64_t a_rows = 0;
  const int32_t* a_row_index = nullptr;
  // bf16, per group g at b + g * b_group_stride (elements, % 8 == 0):
  //   b_k_major = true : [num_groups, n, k], row stride ldb >= k  (x @ W^T, W = [n, k]: "nt")
  //   b_k_major = false: [num_groups, k, n], row stride ldb >= n  (dy @ W, W = [k, n]: "nn")
  const void* b = nullptr;
  bool b_k_major = true;
  int64_t ldb = 0;
  int64_t b_group_stride = 0;
  // bf16 [m_total, n], row stride ldd (>= n, % 8 == 0), 16-byte aligned. Only rows inside a group are written;
  // other rows keep their contents.
  void* d = nullptr;
  int64_t ldd = 0;
  // device int32 [num_groups + 1], 0 <= group_offsets[0] <= ... <= group_offsets[num_groups] <= m_total (rows
  // before the first offset belong to no group). No padding is required; empty groups are allowed. Offsets that
  // break this make the kernel write nothing (a device-check finding). 1 <= num_groups <= 1024.
  const int32_t* group_offsets = nullptr;
  int num_groups = 0;
  int64_t m_total = 0;
  // multiples of 8 (TMA row pitch); n >= 8, k >= 0 (k == 0 writes zeros to the group rows)
  int64_t n = 0;
  int64_t k = 0;
  // null = gemm_heuristics' choice; else an instantiated (block_n, num_stages) pair with async_epilogue 1
  const GroupedGemmConfig* config = nullptr;
  // m_grouped_bf16_gemm_nn_to_routes only (d null then): row m of the product goes to its source rank's route row,
  // push_slots[pool_src_rank[m]] + pool_src_route[m] * ld_slots (bf16, 16-byte aligned, ld_slots >= n and % 8 == 0),
  // instead of d: expert parallelism over peer memory, a backward's dX rows written into the ranks' combine slots by
  // the GEMM's epilogue while its remaining tiles run. Rows whose route lies outside [0, num_routes) (a plan's
  // padding) go nowhere; pool_src_rank may be null (every row to rank 0); 1 <= num_push_ranks <= 8.
  void* const* push_slots = nullptr;
  int num_push_ranks = 0;
  int64_t ld_slots = 0;
  const int32_t* pool_src_route = nullptr;
  const int32_t* pool_src_rank = nullptr;
  int64_t num_routes = 0;
  // shared experts as extra groups (not with push_slots or a gathered A)
  SecondB second_b;
};

int m_grouped_bf16_gemm(const MGroupedGemmArgs& args, cudaStream_t stream, char* err, size_t err_len);
// B MN-major ("nn"), A pooled (not gathered), the rows pushed to their routes (push_slots ... num_routes) and d null.
int m_grouped_bf16_gemm_nn_to_routes(const MGroupedGemmArgs& args, cudaStream_t stream, char* err, size_t err_len);
// a_row_index is required (unless m_total or k is 0).
int m_grouped_bf16_gemm_gather_a(const MGroupedGemmArgs& args, cudaStream_t stream, char* err, size_t err_len);

// L1 of the fused MoE forward: m-grouped GEMM against w13 in its natural layout with a SwiGLU epilogue.
//   hg = A_g @ w13_g[0:I, :]^T,  hu = A_g @ w13_g[I:2I, :]^T   (fp32 accumulation) for the rows of group g;
//   s[m, :] = silu(hg) * hu   (with hg <= clamp_limit and |hu| <= clamp_limit first when clamp_limit > 0)
//   h[m, :] = [hg | hu] in bf16 (only when h != null: the pre-activation for the backward); with a clamp rounded so
//   that it keeps the clamp masks of the fp32 values (reference F6: a value past the bound never rounds onto it).
// Host-side arguments of m_grouped_bf16_gemm_swiglu:
struct SwigluGemmArgs {
  // bf16 [m_total, k] (a_row_index == null) or [a_rows, k] read through a_row_index[m] (as in
  // m_grouped_bf16_gemm_gather_a), row stride lda (>= k, % 8 == 0)
  const void* a = nullptr;
  int64_t lda = 0;
  int64_t a_rows = 0;
  const int32_t* a_row_index = nullptr;
  // bf16 [num_groups, 2 * intermediate, k], K contiguous, row stride ldb, group stride b_group_stride (elements)
  const void* w13 = nullptr;
  int64_t ldb = 0;
  int64_t b_group_stride = 0;
  // a multiple of 64
  int64_t intermediate = 0;
  // bf16 [m_total, intermediate] out, row stride lds; only rows inside a group are written
  void* s = nullptr;
  int64_t lds = 0;
  // bf16 [m_total, 2 * intermediate] out (gate | up), row stride ldh, or null; only rows inside a group are written
  void* h = nullptr;
  int64_t ldh = 0;
  // as in MGroupedGemmArgs
  const int32_t* group_offsets = nullptr;
  int num_groups = 0;
  int64_t m_total = 0;
  // a multiple of 8, >= 8
  int64_t k = 0;
  // >= 0 (0 = no clamp)
  float clamp_limit = 0.f;
  // null (swiglu_gemm_config()) or block_n 256 / 3 stages or 128 / 5 stages, async_epilogue 1
  const GroupedGemmConfig* config = nullptr;
  // shared experts as extra groups
  SecondB second_b;
};

int m_grouped_bf16_gemm_swiglu(const SwigluGemmArgs& args, cudaStream_t stream, char* err, size_t err_len);

// L2 dgrad with the SwiGLU backward in its epilogue (swiglu_bwd_pp.cuh): da = dy_pool @ w2_g per group, never stored;
// with w = route_weights[pool_src_route[m]] writes dh, aw = w * s and the d topk_weights partials. Rows outside every
// group are not written. Host-side arguments of m_grouped_bf16_gemm_swiglu_bwd:
struct SwigluBwdGemmArgs {
  // bf16 [m_total, hidden], row stride lda (>= hidden, % 8 == 0)
  const void* dy_pool = nullptr;
  int64_t lda = 0;
  // bf16 [num_groups, hidden, intermediate] (MN-major), row stride ldb (>= intermediate, % 8 == 0), group stride
  // b_group_stride (elements, >= hidden * ldb, % 8 == 0)
  const void* w2 = nullptr;
  int64_t ldb = 0;
  int64_t b_group_stride = 0;
  // bf16 [m_total, 2 * intermediate] (the forward's gate | up pre-activation), row stride ldh (>= 2I, % 8 == 0)
  const void* h = nullptr;
  int64_t ldh = 0;
  // device int32 [m_total]: route per pool row; -1 = a padding row (weight 0); another route outside
  // [0, num_routes) also gets weight 0 and is a device-check finding
  const int32_t* pool_src_route = nullptr;
  // device fp32 [num_routes] (may be null when num_routes == 0)
  const float* route_weights = nullptr;
  int64_t num_routes = 0;
  // bf16 [m_total, 2 * intermediate] out, row stride lddh (>= 2I, % 8 == 0)
  void* dh = nullptr;
  int64_t lddh = 0;
  // bf16 [m_total, intermediate] out: w * s, row stride ldaw (>= I, % 8 == 0)
  void* aw = nullptr;
  int64_t ldaw = 0;
  // fp32 [m_total, dt_ld] out (dt_ld >= ceil(I / 128)): d topk_weights partials; their row sum in column order is
  // the d weight
  float* dt_part = nullptr;
  int64_t dt_ld = 0;
  // as in MGroupedGemmArgs
  const int32_t* group_offsets = nullptr;
  int num_groups = 0;
  int64_t m_total = 0;
  // intermediate a multiple of 64, hidden a multiple of 8 (>= 8)
  int64_t intermediate = 0;
  int64_t hidden = 0;
  // >= 0 (0 = no clamp)
  float clamp_limit = 0.f;
  // caps the grid (0 = every multiprocessor)
  int num_sms = 0;
};

int m_grouped_bf16_gemm_swiglu_bwd(const SwigluBwdGemmArgs& args, cudaStream_t stream, char* err, size_t err_len);

// k-grouped GEMM (weight gradients):  C_e = A_e^T @ B_e  (or C_e += ... when accumulate),
// A_e = rows [group_offsets[e], group_offsets[e+1]) of A, likewise B_e. Host-side arguments of k_grouped_bf16_gemm:
struct KGroupedGemmArgs {
  // bf16 [p_total, m], row stride lda (>= m, % 8 == 0), 16-byte aligned
  const void* a = nullptr;
  int64_t lda = 0;
  // bf16 [p_total, n], row stride ldb (>= n, % 8 == 0), 16-byte aligned
  const void* b = nullptr;
  int64_t ldb = 0;
  // [num_groups, m, n] contiguous, 16-byte aligned; c_is_bf16 = false: fp32 (store, or accumulate into the existing
  // values when accumulate = true); c_is_bf16 = true: bf16 store (accumulate must be false). An empty group gives
  // C_e = 0 (store) or leaves C_e unchanged (accumulate).
  void* c = nullptr;
  bool c_is_bf16 = false;
  bool accumulate = false;
  // device int32 [num_groups + 1], 0 <= group_offsets[0] <= ... <= last <= p_total; offsets that break this make
  // the kernel write nothing (a device-check finding). 1 <= num_groups <= 1024.
  const int32_t* group_offsets = nullptr;
  int num_groups = 0;
  int64_t p_total = 0;
  // multiples of 8, >= 8
  int64_t m = 0;
  int64_t n = 0;
  // null = gemm_heuristics' choice; else a supported config whose async_epilogue is 1 exactly for a bf16 c
  const GroupedGemmConfig* config = nullptr;
};

int k_grouped_bf16_gemm(const KGroupedGemmArgs& args, cudaStream_t stream, char* err, size_t err_len);

}  // namespace sm90
}  // namespace prime_kernels
