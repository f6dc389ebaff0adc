// prime-kernels: host side of the sm90a BF16 grouped GEMMs (argument checks, config, TMA maps, launch).
#include "grouped_gemm.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdio>

#include "common/ep_signal.hpp"
#include "host_utils.hpp"
#include "k_grouped_gemm.cuh"
#include "m_grouped_gemm.cuh"
#include "swiglu_bwd_host.cuh"
#include "swiglu_bwd_pp.cuh"

namespace prime_kernels {
namespace sm90 {
using namespace host;

namespace {

template <int kBlockN, int kNumStages, bool kBKMajor, bool kGatherA, bool kSwiGLU = false, bool kMaskedH = false,
          bool kPushRoutes = false, bool kSecondB = false>
int launch_m_grouped(const CUtensorMap& ma, const CUtensorMap& mb, const CUtensorMap& md, const MGroupedParams& p,
                     int64_t max_units,
                     int sms, cudaStream_t stream, char* err, size_t err_len, const CUtensorMap* mb2 = nullptr) {
  constexpr auto kernel =
      &m_grouped_bf16_gemm_kernel<kBlockN, kNumStages, kBKMajor, kGatherA, kSwiGLU, kMaskedH, kPushRoutes, kSecondB>;
  constexpr int smem = MGroupedLayout<kBlockN, kNumStages>::kSmemBytes;
  cudaError_t e = set_max_dynamic_smem<kernel>(smem);
  if (e != cudaSuccess)
    return fail(kGemmCudaError, err, err_len, "cudaFuncSetAttribute: %s", cudaGetErrorString(e));
  e = launch_persistent<kernel>(kNumThreads, smem, max_units, sms, stream, ma, mb, md, p, mb2 ? *mb2 : mb);
  if (e != cudaSuccess)
    return fail(kGemmCudaError, err, err_len, "m_grouped_bf16_gemm launch: %s", cudaGetErrorString(e));
  return check_launch("m_grouped_bf16_gemm", err, err_len);
}

template <int kBlockN, int kNumStages, int kOut, bool kAsyncEpi>
int launch_k_grouped(const CUtensorMap& ma, const CUtensorMap& mb, const CUtensorMap& mc, const KGroupedParams& p,
                     int grid,
                     cudaStream_t stream, char* err, size_t err_len) {
  constexpr auto kernel = &k_grouped_bf16_gemm_kernel<kBlockN, kNumStages, kOut, kAsyncEpi>;
  constexpr int smem = KGroupedLayout<kBlockN, kNumStages, kAsyncEpi>::kSmemBytes;
  cudaError_t e = set_max_dynamic_smem<kernel>(smem);
  if (e != cudaSuccess)
    return fail(kGemmCudaError, err, err_len, "cudaFuncSetAttribute: %s", cudaGetErrorString(e));
  kernel<<<grid, kNumThreads, smem, stream>>>(ma, mb, mc, p);
  return check_launch("k_grouped_bf16_gemm", err, err_len);
}


// The second B's map and parameters (grouped_gemm.hpp, SecondB). kind: 0 SwiGLU L1 (I = inter, K-major over k), 1
// K-major "nt" (I = k), 2 MN-major "nn" (I = k / 2). box_rows: the rows of the first B's box (K-major kinds).
int second_b_map(const SecondB& sb, int kind, int num_groups, int64_t n, int64_t k, int64_t inter, uint32_t box_rows,
                 CUtensorMap* out, MGroupedParams* p, const char* fn, char* err, size_t err_len) {
  const int64_t I = kind == 0 ? inter : (kind == 1 ? k : k / 2);
  if (sb.slabs < 1 || sb.chunks < 1 || sb.num_b_groups < 0 ||
      (int64_t)sb.num_b_groups + (int64_t)sb.slabs * sb.chunks != num_groups)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: second B: num_b_groups (%d) + slabs (%d) * chunks (%d) must equal num_groups (%d)", fn,
                sb.num_b_groups, sb.slabs, sb.chunks, num_groups);
  if (I < 64 || I % 64 != 0 || (kind == 2 && k % 2 != 0))
    return fail(kGemmInvalidArgument, err, err_len, "%s: second B: its chunk width I = %lld must be a multiple of 64",
                fn, (long long)I);
  const int64_t inter2 = I * sb.chunks;  // the second tensor's intermediate size
  const int64_t cols = kind == 1 ? inter2 : (kind == 0 ? k : n);  // contiguous extent
  const int64_t rows = kind == 1 ? n : 2 * inter2;
  if (inter2 > kMaxDim || rows > kMaxDim || sb.ldb2 < cols || sb.ldb2 % 8 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: second B: ldb2 = %lld, must be >= %lld and a multiple of 8",
                fn, (long long)sb.ldb2, (long long)cols);
  if (sb.slabs > 1 && (sb.b2_group_stride < rows * sb.ldb2 || sb.b2_group_stride % 8 != 0))
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: second B: b2_group_stride = %lld, must be >= %lld and a multiple of 8", fn,
                (long long)sb.b2_group_stride, (long long)(rows * sb.ldb2));
  if (!aligned16(sb.b2)) return fail(kGemmInvalidArgument, err, err_len, "%s: second B must be 16-byte aligned", fn);
  const int64_t gs = sb.slabs > 1 ? sb.b2_group_stride : rows * sb.ldb2;
  const uint64_t dims[3] = {(uint64_t)cols, (uint64_t)rows, (uint64_t)sb.slabs};
  const uint64_t strides[2] = {(uint64_t)sb.ldb2 * 2, (uint64_t)gs * 2};
  const uint32_t box_k[3] = {64, box_rows, 1};
  const uint32_t box_mn[3] = {64, 64, 1};
  if (int r = make_map(out, sb.b2, 3, dims, strides, kind == 2 ? box_mn : box_k, err, err_len)) return r;
  p->num_b_groups = sb.num_b_groups;
  p->b2_chunks = sb.chunks;
  p->b2_inter = (int32_t)inter2;
  return kGemmOk;
}

// The second B is built for one config, the layer passes' (block_n 256, 3 stages).
int second_b_config(const GroupedGemmConfig* config, GroupedGemmConfig* cfg, const char* fn, char* err,
                    size_t err_len) {
  GroupedGemmConfig c = config ? *config : swiglu_gemm_config();
  if (c.block_m != 128 || c.block_k != 64 || c.block_n != 256 || c.num_stages != 3 || c.async_epilogue != 1)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: with a second B the config must be null or block_n 256 / 3 stages, asynchronous epilogue", fn);
  *cfg = c;
  return kGemmOk;
}

// Every grouped entry point takes between 1 and kMaxGroups groups (the per-group starts live in shared memory).
int check_num_groups(int num_groups, const char* fn, char* err, size_t err_len) {
  if (num_groups < 1 || num_groups > kMaxGroups)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_groups = %d, must be in [1, %d]", fn, num_groups,
                kMaxGroups);
  return kGemmOk;
}

}  // namespace

namespace {
int m_grouped_impl(const MGroupedGemmArgs& args, cudaStream_t stream, char* err, size_t err_len, const char* fn) {
  const void* a = args.a;
  const int64_t lda = args.lda, a_rows = args.a_rows;
  const int32_t* a_row_index = args.a_row_index;
  const void* b = args.b;
  const bool b_k_major = args.b_k_major;
  const int64_t ldb = args.ldb, b_group_stride = args.b_group_stride;
  void* d = args.d;
  const int64_t ldd = args.ldd;
  const int32_t* group_offsets = args.group_offsets;
  const int num_groups = args.num_groups;
  const int64_t m_total = args.m_total, n = args.n, k = args.k;
  const GroupedGemmConfig* config = args.config;
  const bool gather = a_row_index != nullptr;
  const bool push = args.push_slots != nullptr;
  const bool second = args.second_b.b2 != nullptr;
  // the first B's experts: every group, or those before the second B's
  const int b_groups = second ? args.second_b.num_b_groups : num_groups;
  if (int r = check_num_groups(num_groups, fn, err, err_len)) return r;
  if (second && (push || gather || k == 0))
    return fail(kGemmInvalidArgument, err, err_len, "%s: a second B takes a pooled A, d and k > 0", fn);
  if (m_total < 0 || m_total > kMaxDim || n < 8 || n > kMaxDim || k < 0 || k > kMaxDim)
    return fail(kGemmInvalidArgument, err, err_len, "%s: bad sizes m_total=%lld n=%lld k=%lld", fn,
                (long long)m_total, (long long)n, (long long)k);
  if (n % 8 != 0 || k % 8 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: n (%lld) and k (%lld) must be multiples of 8", fn,
                (long long)n, (long long)k);
  if (push) {
    static_assert(kMaxPushRanks == common::kEpMaxRanks, "one bound on the ranks of expert parallelism");
    if (d != nullptr || b_k_major || gather)
      return fail(kGemmInvalidArgument, err, err_len, "%s: pushing rows to routes takes d null, B MN-major, A pooled",
                  fn);
    if (args.num_push_ranks < 1 || args.num_push_ranks > kMaxPushRanks)
      return fail(kGemmInvalidArgument, err, err_len, "%s: num_push_ranks = %d, must be in [1, %d]", fn,
                  args.num_push_ranks, kMaxPushRanks);
    if (args.ld_slots < n || args.ld_slots % 8 != 0 || args.num_routes < 0 || args.num_routes > kMaxDim)
      return fail(kGemmInvalidArgument, err, err_len,
                  "%s: ld_slots = %lld (must be >= n and a multiple of 8), num_routes = %lld (must be in [0, 2^31))",
                  fn, (long long)args.ld_slots, (long long)args.num_routes);
    for (int r = 0; r < args.num_push_ranks; ++r)
      if (args.push_slots[r] == nullptr || !aligned16(args.push_slots[r]))
        return fail(kGemmInvalidArgument, err, err_len, "%s: push_slots[%d] is null or not 16-byte aligned", fn, r);
    if (m_total > 0 && args.pool_src_route == nullptr)
      return fail(kGemmInvalidArgument, err, err_len, "%s: null pool_src_route", fn);
  } else if (ldd < n || ldd % 8 != 0) {
    return fail(kGemmInvalidArgument, err, err_len, "%s: ldd = %lld, must be >= n and a multiple of 8", fn,
                (long long)ldd);
  }
  if (m_total == 0) return kGemmOk;
  if (group_offsets == nullptr || (d == nullptr && !push))
    return fail(kGemmInvalidArgument, err, err_len, "%s: null group_offsets or d", fn);
  if (!push && !aligned16(d)) return fail(kGemmInvalidArgument, err, err_len, "%s: d must be 16-byte aligned", fn);
  if (k > 0) {
    if (a == nullptr || b == nullptr) return fail(kGemmInvalidArgument, err, err_len, "%s: null a or b", fn);
    if (!aligned16(a) || !aligned16(b))
      return fail(kGemmInvalidArgument, err, err_len, "%s: a and b must be 16-byte aligned", fn);
    if (lda < k || lda % 8 != 0)
      return fail(kGemmInvalidArgument, err, err_len, "%s: lda = %lld, must be >= k and a multiple of 8", fn,
                  (long long)lda);
    if (gather && (a_rows < 1 || a_rows > kMaxDim))
      return fail(kGemmInvalidArgument, err, err_len, "%s: a_rows = %lld, must be in [1, 2^31)", fn,
                  (long long)a_rows);
    const int64_t inner = b_k_major ? k : n;
    const int64_t outer = b_k_major ? n : k;
    if (ldb < inner || ldb % 8 != 0)
      return fail(kGemmInvalidArgument, err, err_len, "%s: ldb = %lld, must be >= %s and a multiple of 8", fn,
                  (long long)ldb, b_k_major ? "k" : "n");
    if (b_groups > 1 && (b_group_stride < outer * ldb || b_group_stride % 8 != 0))
      return fail(kGemmInvalidArgument, err, err_len,
                  "%s: b_group_stride = %lld, must be >= %lld and a multiple of 8", fn,
                  (long long)b_group_stride, (long long)(outer * ldb));
  }
  GroupedGemmConfig cfg = config ? *config : m_grouped_gemm_config(m_total, n, k, num_groups);
  if (second)
    if (int r = second_b_config(config, &cfg, fn, err, err_len)) return r;
  if (!grouped_gemm_config_supported(cfg) || cfg.async_epilogue != 1)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: unsupported config block_m=%d block_n=%d block_k=%d stages=%d async_epilogue=%d (built: block_n "
                "256 / 3 stages or 128 / 5 stages, asynchronous epilogue)",
                fn, cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages, cfg.async_epilogue);
  int sms = 0;
  if (int r = device_sms(&sms, err, err_len)) return r;
  if (cfg.num_sms > 0 && cfg.num_sms < sms) sms = cfg.num_sms;

  // k == 0: maps over a dummy 64-wide K extent that is never loaded (no k-blocks).
  const void* dummy = push ? args.push_slots[0] : d;
  const void* a_ptr = k > 0 ? a : dummy;
  const void* b_ptr = k > 0 ? b : dummy;
  const int64_t kk = k > 0 ? k : 64;
  const int64_t lda_ = k > 0 ? lda : 64;
  CUtensorMap ma, mb;
  if (!gather) {
    const uint64_t dims[2] = {(uint64_t)kk, (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)lda_ * 2};
    const uint32_t box[2] = {64, 128};
    if (int r = make_map(&ma, a_ptr, 2, dims, strides, box, err, err_len)) return r;
  }
  {
    const int64_t ldb_ = k > 0 ? ldb : 64;
    const int64_t gs = (k > 0 && b_groups > 1) ? b_group_stride : (b_k_major ? n : kk) * ldb_;
    const uint64_t map_groups = b_groups > 0 ? (uint64_t)b_groups : 1;  // a second B alone: the first map is unused
    if (b_k_major) {
      const uint64_t dims[3] = {(uint64_t)kk, (uint64_t)n, map_groups};
      const uint64_t strides[2] = {(uint64_t)ldb_ * 2, (uint64_t)gs * 2};
      const uint32_t box[3] = {64, (uint32_t)cfg.block_n, 1};
      if (int r = make_map(&mb, b_ptr, 3, dims, strides, box, err, err_len)) return r;
    } else {
      const int64_t ldb_mn = k > 0 ? ldb : n;
      const int64_t gs_mn = (k > 0 && b_groups > 1) ? b_group_stride : kk * ldb_mn;
      const uint64_t dims[3] = {(uint64_t)n, (uint64_t)kk, map_groups};
      const uint64_t strides[2] = {(uint64_t)ldb_mn * 2, (uint64_t)gs_mn * 2};
      const uint32_t box[3] = {64, 64, 1};
      if (int r = make_map(&mb, b_ptr, 3, dims, strides, box, err, err_len)) return r;
    }
  }
  if (gather) ma = mb;  // unused by the cp.async gathering kernel
  CUtensorMap md = mb;    // output map: 64 x 64 boxes, clipped at [m_total, n] (unused when the rows are pushed)
  if (!push) {
    const uint64_t dims[2] = {(uint64_t)n, (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)ldd * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&md, d, 2, dims, strides, box, err, err_len)) return r;
  }
  MGroupedParams p{};
  p.l2_hints = kGemmL2Hints;
  p.check = common::device_check_record();
  p.a = reinterpret_cast<const __nv_bfloat16*>(a_ptr);
  p.lda = lda_;
  p.a_row_index = a_row_index;
  p.a_rows = (int32_t)(gather ? a_rows : 0);
  p.d = reinterpret_cast<__nv_bfloat16*>(d);
  p.ldd = ldd;
  p.group_offsets = group_offsets;
  p.m_total = (int32_t)m_total;
  p.n = (int32_t)n;
  p.k = (int32_t)k;
  p.num_groups = num_groups;
  p.s = nullptr;
  p.lds = 0;
  p.clamp = 0.f;
  const int64_t n_blocks = (n + cfg.block_n - 1) / cfg.block_n;
  const int64_t max_units = max_m_blocks(m_total, num_groups) * n_blocks;
  if (push) {
    for (int r = 0; r < args.num_push_ranks; ++r) p.push_slots[r] = static_cast<__nv_bfloat16*>(args.push_slots[r]);
    p.num_push_ranks = args.num_push_ranks;
    p.ld_slots = args.ld_slots;
    p.pool_src_route = args.pool_src_route;
    p.pool_src_rank = args.pool_src_rank;
    p.num_routes = static_cast<int32_t>(args.num_routes);
    if (cfg.block_n == 256)
      return launch_m_grouped<256, 3, false, false, false, false, true>(ma, mb, md, p, max_units, sms, stream, err,
                                                                        err_len);
    return launch_m_grouped<128, 5, false, false, false, false, true>(ma, mb, md, p, max_units, sms, stream, err,
                                                                      err_len);
  }
  if (second) {
    CUtensorMap mb2;
    if (int r = second_b_map(args.second_b, b_k_major ? 1 : 2, num_groups, n, k, 0, 256, &mb2, &p, fn, err, err_len))
      return r;
    if (b_k_major)
      return launch_m_grouped<256, 3, true, false, false, false, false, true>(ma, mb, md, p, max_units, sms, stream,
                                                                              err, err_len, &mb2);
    return launch_m_grouped<256, 3, false, false, false, false, false, true>(ma, mb, md, p, max_units, sms, stream,
                                                                             err, err_len, &mb2);
  }
#define PK_M_LAUNCH2(BN, ST, GA)                                                                                 \
  return b_k_major ? launch_m_grouped<BN, ST, true, GA>(ma, mb, md, p, max_units, sms, stream, err, err_len) \
                   : launch_m_grouped<BN, ST, false, GA>(ma, mb, md, p, max_units, sms, stream, err, err_len)
#define PK_M_LAUNCH(BN, ST)                 \
  do {                                      \
    if (gather) PK_M_LAUNCH2(BN, ST, true); \
    PK_M_LAUNCH2(BN, ST, false);            \
  } while (0)
  if (cfg.block_n == 256) PK_M_LAUNCH(256, 3);
  PK_M_LAUNCH(128, 5);
#undef PK_M_LAUNCH
#undef PK_M_LAUNCH2
}
}  // namespace

int m_grouped_bf16_gemm_nn_to_routes(const MGroupedGemmArgs& args, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  if (args.push_slots == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "m_grouped_bf16_gemm_nn_to_routes: null push_slots");
  return m_grouped_impl(args, stream, err, err_len, "m_grouped_bf16_gemm_nn_to_routes");
}

int m_grouped_bf16_gemm(const MGroupedGemmArgs& args, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  if (args.push_slots != nullptr)
    return fail(kGemmInvalidArgument, err, err_len,
                "m_grouped_bf16_gemm: push_slots must be null (m_grouped_bf16_gemm_nn_to_routes pushes)");
  // a set row index would silently turn this into the gather; the caller asks for that by name
  if (args.a_row_index != nullptr)
    return fail(kGemmInvalidArgument, err, err_len,
                "m_grouped_bf16_gemm: a_row_index must be null (m_grouped_bf16_gemm_gather_a gathers)");
  return m_grouped_impl(args, stream, err, err_len, "m_grouped_bf16_gemm");
}

int m_grouped_bf16_gemm_gather_a(const MGroupedGemmArgs& args, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  if (args.a_row_index == nullptr && args.m_total > 0 && args.k > 0)
    return fail(kGemmInvalidArgument, err, err_len, "m_grouped_bf16_gemm_gather_a: null a_row_index");
  if (args.push_slots != nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "m_grouped_bf16_gemm_gather_a: push_slots must be null");
  return m_grouped_impl(args, stream, err, err_len, "m_grouped_bf16_gemm_gather_a");
}

int m_grouped_bf16_gemm_swiglu(const SwigluGemmArgs& args, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  const void* a = args.a;
  const int64_t lda = args.lda, a_rows = args.a_rows;
  const int32_t* a_row_index = args.a_row_index;
  const void* w13 = args.w13;
  const int64_t ldb = args.ldb, b_group_stride = args.b_group_stride;
  void* s = args.s;
  const int64_t lds = args.lds;
  void* h = args.h;
  const int64_t ldh = args.ldh;
  const int32_t* group_offsets = args.group_offsets;
  const int num_groups = args.num_groups;
  const int64_t m_total = args.m_total, k = args.k;
  const float clamp_limit = args.clamp_limit;
  const GroupedGemmConfig* config = args.config;
  const char* fn = "m_grouped_bf16_gemm_swiglu";
  const bool gather = a_row_index != nullptr;
  const int64_t I = args.intermediate;
  const bool second = args.second_b.b2 != nullptr;
  const int b_groups = second ? args.second_b.num_b_groups : num_groups;  // the first B's experts
  if (int r = check_num_groups(num_groups, fn, err, err_len)) return r;
  if (m_total < 0 || m_total > kMaxDim || I < 64 || 2 * I > kMaxDim || I % 64 != 0 || k < 8 || k > kMaxDim ||
      k % 8 != 0)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: bad sizes m_total=%lld intermediate=%lld (multiple of 64) k=%lld (multiple of 8, >= 8)", fn,
                (long long)m_total, (long long)I, (long long)k);
  if (lds < I || lds % 8 != 0 || (h != nullptr && (ldh < 2 * I || ldh % 8 != 0)))
    return fail(kGemmInvalidArgument, err, err_len, "%s: lds = %lld (>= I), ldh = %lld (>= 2I), multiples of 8", fn,
                (long long)lds, (long long)ldh);
  if (!(clamp_limit >= 0.f))
    return fail(kGemmInvalidArgument, err, err_len, "%s: clamp_limit must be >= 0 (0 = no clamp)", fn);
  if (m_total == 0) return kGemmOk;
  if (a == nullptr || w13 == nullptr || s == nullptr || group_offsets == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: null a, w13, s or group_offsets", fn);
  if (!aligned16(a) || !aligned16(w13) || !aligned16(s) || (h != nullptr && !aligned16(h)))
    return fail(kGemmInvalidArgument, err, err_len, "%s: a, w13, s and h must be 16-byte aligned", fn);
  if (lda < k || lda % 8 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: lda = %lld, must be >= k and a multiple of 8", fn,
                (long long)lda);
  if (gather && (a_rows < 1 || a_rows > kMaxDim))
    return fail(kGemmInvalidArgument, err, err_len, "%s: a_rows = %lld, must be in [1, 2^31)", fn, (long long)a_rows);
  if (ldb < k || ldb % 8 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: ldb = %lld, must be >= k and a multiple of 8", fn,
                (long long)ldb);
  if (b_groups > 1 && (b_group_stride < 2 * I * ldb || b_group_stride % 8 != 0))
    return fail(kGemmInvalidArgument, err, err_len, "%s: b_group_stride = %lld, must be >= 2I * ldb, multiple of 8",
                fn, (long long)b_group_stride);
  GroupedGemmConfig cfg = config ? *config : swiglu_gemm_config();
  if (second)
    if (int r = second_b_config(config, &cfg, fn, err, err_len)) return r;
  if (cfg.block_m != 128 || cfg.block_k != 64 || cfg.async_epilogue != 1 ||
      !((cfg.block_n == 256 && cfg.num_stages == 3) || (cfg.block_n == 128 && cfg.num_stages == 5)))
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: config must be block_n 256 / 3 stages or 128 / 5 stages, asynchronous epilogue", fn);
  int sms = 0;
  if (int r = device_sms(&sms, err, err_len)) return r;
  if (cfg.num_sms > 0 && cfg.num_sms < sms) sms = cfg.num_sms;

  CUtensorMap ma, mb, md;
  {
    const int64_t gs = b_groups > 1 ? b_group_stride : 2 * I * ldb;
    const uint64_t dims[3] = {(uint64_t)k, (uint64_t)(2 * I), (uint64_t)(b_groups > 0 ? b_groups : 1)};
    const uint64_t strides[2] = {(uint64_t)ldb * 2, (uint64_t)gs * 2};
    const uint32_t box[3] = {64, (uint32_t)(cfg.block_n / 2), 1};
    if (int r = make_map(&mb, w13, 3, dims, strides, box, err, err_len)) return r;
  }
  if (!gather) {
    const uint64_t dims[2] = {(uint64_t)k, (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)lda * 2};
    const uint32_t box[2] = {64, 128};
    if (int r = make_map(&ma, a, 2, dims, strides, box, err, err_len)) return r;
  } else {
    ma = mb;  // unused by the cp.async gathering kernel
  }
  md = mb;
  if (h != nullptr) {
    const uint64_t dims[2] = {(uint64_t)(2 * I), (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)ldh * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&md, h, 2, dims, strides, box, err, err_len)) return r;
  }
  MGroupedParams p{};
  p.l2_hints = kGemmL2Hints;
  p.check = common::device_check_record();
  p.a = reinterpret_cast<const __nv_bfloat16*>(a);
  p.lda = lda;
  p.a_row_index = a_row_index;
  p.a_rows = (int32_t)(gather ? a_rows : 0);
  p.d = reinterpret_cast<__nv_bfloat16*>(h);
  p.ldd = h != nullptr ? ldh : 0;
  p.group_offsets = group_offsets;
  p.m_total = (int32_t)m_total;
  p.n = (int32_t)I;
  p.k = (int32_t)k;
  p.num_groups = num_groups;
  p.s = reinterpret_cast<__nv_bfloat16*>(s);
  p.lds = lds;
  p.clamp = clamp_limit;
  const int64_t n_blocks = (I + cfg.block_n / 2 - 1) / (cfg.block_n / 2);
  const int64_t max_units = max_m_blocks(m_total, num_groups) * n_blocks;
  if (clamp_limit > 0.f)  // h keeps the clamp masks (reference F6): the kMaskedH kernels
    bf16_clamp_neighbours(clamp_limit, &p.clamp_below, &p.clamp_above);
  if (second) {
    CUtensorMap mb2;
    if (int r = second_b_map(args.second_b, 0, num_groups, I, k, I, (uint32_t)(cfg.block_n / 2), &mb2, &p, fn, err,
                             err_len))
      return r;
#define PK_SWIGLU_SECOND(GA, MH) \
  return launch_m_grouped<256, 3, true, GA, true, MH, false, true>(ma, mb, md, p, max_units, sms, stream, err, err_len, &mb2)
    if (clamp_limit > 0.f) {
      if (gather) PK_SWIGLU_SECOND(true, true);
      PK_SWIGLU_SECOND(false, true);
    }
    if (gather) PK_SWIGLU_SECOND(true, false);
    PK_SWIGLU_SECOND(false, false);
#undef PK_SWIGLU_SECOND
  }
  if (clamp_limit > 0.f) {
    if (cfg.block_n == 256) {
      if (gather)
        return launch_m_grouped<256, 3, true, true, true, true>(ma, mb, md, p, max_units, sms, stream, err, err_len);
      return launch_m_grouped<256, 3, true, false, true, true>(ma, mb, md, p, max_units, sms, stream, err, err_len);
    }
    if (gather)
      return launch_m_grouped<128, 5, true, true, true, true>(ma, mb, md, p, max_units, sms, stream, err, err_len);
    return launch_m_grouped<128, 5, true, false, true, true>(ma, mb, md, p, max_units, sms, stream, err, err_len);
  }
  if (cfg.block_n == 256) {
    if (gather) return launch_m_grouped<256, 3, true, true, true>(ma, mb, md, p, max_units, sms, stream, err, err_len);
    return launch_m_grouped<256, 3, true, false, true>(ma, mb, md, p, max_units, sms, stream, err, err_len);
  }
  if (gather) return launch_m_grouped<128, 5, true, true, true>(ma, mb, md, p, max_units, sms, stream, err, err_len);
  return launch_m_grouped<128, 5, true, false, true>(ma, mb, md, p, max_units, sms, stream, err, err_len);
}

int prepare_swiglu_bwd(const SwigluBwdGemmArgs& args, const char* fn, SwigluBwdLaunch* out, char* err, size_t err_len) {
  const void* dy_pool = args.dy_pool;
  const void* w2 = args.w2;
  const void* h = args.h;
  const int64_t lda = args.lda, ldb = args.ldb, b_group_stride = args.b_group_stride, ldh = args.ldh;
  const int32_t* pool_src_route = args.pool_src_route;
  const float* route_weights = args.route_weights;
  const int64_t num_routes = args.num_routes;
  void* dh = args.dh;
  void* aw = args.aw;
  float* dt_part = args.dt_part;
  const int64_t lddh = args.lddh, ldaw = args.ldaw, dt_ld = args.dt_ld;
  const int32_t* group_offsets = args.group_offsets;
  const int num_groups = args.num_groups;
  const int64_t m_total = args.m_total;
  const float clamp_limit = args.clamp_limit;
  const int num_sms = args.num_sms;
  const int64_t I = args.intermediate, k = args.hidden;
  if (int r = check_num_groups(num_groups, fn, err, err_len)) return r;
  if (m_total < 0 || m_total > kMaxDim || I < 64 || 2 * I > kMaxDim || I % 64 != 0 || k < 8 || k > kMaxDim ||
      k % 8 != 0)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: bad sizes m_total=%lld intermediate=%lld (a multiple of 64) hidden=%lld (a multiple of 8, >= 8)",
                fn, (long long)m_total, (long long)I, (long long)k);
  const int64_t dt_cols = (I + 127) / 128;
  if (lda < k || lda % 8 != 0 || ldb < I || ldb % 8 != 0 || ldh < 2 * I || ldh % 8 != 0 || lddh < 2 * I ||
      lddh % 8 != 0 || ldaw < I || ldaw % 8 != 0 || dt_ld < dt_cols)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: row strides must cover their rows and be multiples of 8 (lda %lld, ldb %lld, ldh %lld, "
                "lddh %lld, ldaw %lld); dt_ld %lld must be >= %lld",
                fn, (long long)lda, (long long)ldb, (long long)ldh, (long long)lddh, (long long)ldaw, (long long)dt_ld,
                (long long)dt_cols);
  if (num_groups > 1 && (b_group_stride < k * ldb || b_group_stride % 8 != 0))
    return fail(kGemmInvalidArgument, err, err_len, "%s: b_group_stride = %lld, must be >= hidden * ldb, multiple of 8",
                fn, (long long)b_group_stride);
  if (!(clamp_limit >= 0.f))
    return fail(kGemmInvalidArgument, err, err_len, "%s: clamp_limit must be >= 0 (0 = no clamp)", fn);
  if (num_routes < 0 || num_routes > kMaxDim)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_routes = %lld, must be in [0, 2^31)", fn,
                (long long)num_routes);
  if (num_sms < 0) return fail(kGemmInvalidArgument, err, err_len, "%s: num_sms = %d, must be >= 0", fn, num_sms);
  out->p = MGroupedParams{};
  if (m_total == 0) return kGemmOk;
  if (dy_pool == nullptr || w2 == nullptr || h == nullptr || pool_src_route == nullptr ||
      (route_weights == nullptr && num_routes > 0) || dh == nullptr || aw == nullptr || dt_part == nullptr ||
      group_offsets == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: a pointer is null", fn);
  if (!aligned16(dy_pool) || !aligned16(w2) || !aligned16(h) || !aligned16(dh) || !aligned16(aw))
    return fail(kGemmInvalidArgument, err, err_len, "%s: dy_pool, w2, h, dh and aw must be 16-byte aligned", fn);
  int sms = 0;
  if (int r = device_sms(&sms, err, err_len)) return r;
  if (num_sms > 0 && num_sms < sms) sms = num_sms;
  CUtensorMap &ma = out->a, &mb = out->b, &mh = out->h, &mdh = out->dh, &maw = out->aw;
  out->sms = sms;
  {
    const uint64_t dims[2] = {(uint64_t)k, (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)lda * 2};
    const uint32_t box[2] = {64, 128};
    if (int r = make_map(&ma, dy_pool, 2, dims, strides, box, err, err_len)) return r;
  }
  {
    const int64_t gs = num_groups > 1 ? b_group_stride : k * ldb;
    const uint64_t dims[3] = {(uint64_t)I, (uint64_t)k, (uint64_t)num_groups};
    const uint64_t strides[2] = {(uint64_t)ldb * 2, (uint64_t)gs * 2};
    const uint32_t box[3] = {64, 64, 1};
    if (int r = make_map(&mb, w2, 3, dims, strides, box, err, err_len)) return r;
  }
  {
    const uint64_t dims[2] = {(uint64_t)(2 * I), (uint64_t)m_total};
    const uint32_t box[2] = {64, 64};
    const uint64_t sh[1] = {(uint64_t)ldh * 2};
    if (int r = make_map(&mh, h, 2, dims, sh, box, err, err_len)) return r;
    const uint64_t sdh[1] = {(uint64_t)lddh * 2};
    if (int r = make_map(&mdh, dh, 2, dims, sdh, box, err, err_len)) return r;
    const uint64_t dims_aw[2] = {(uint64_t)I, (uint64_t)m_total};
    const uint64_t saw[1] = {(uint64_t)ldaw * 2};
    if (int r = make_map(&maw, aw, 2, dims_aw, saw, box, err, err_len)) return r;
  }
  MGroupedParams& p = out->p;
  p.l2_hints = kGemmL2Hints;
  p.check = common::device_check_record();
  p.a = reinterpret_cast<const __nv_bfloat16*>(dy_pool);
  p.lda = lda;
  p.group_offsets = group_offsets;
  p.m_total = (int32_t)m_total;
  p.n = (int32_t)I;
  p.k = (int32_t)k;
  p.num_groups = num_groups;
  p.clamp = clamp_limit;
  p.h = reinterpret_cast<const __nv_bfloat16*>(h);
  p.ldh = ldh;
  p.pool_src_route = pool_src_route;
  p.route_weights = route_weights;
  p.num_routes = (int32_t)num_routes;
  p.dh = reinterpret_cast<__nv_bfloat16*>(dh);
  p.lddh = lddh;
  p.aw = reinterpret_cast<__nv_bfloat16*>(aw);
  p.ldaw = ldaw;
  p.dt_part = dt_part;
  p.dt_ld = (int32_t)dt_ld;
  return kGemmOk;
}

int m_grouped_bf16_gemm_swiglu_bwd(const SwigluBwdGemmArgs& args, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "m_grouped_bf16_gemm_swiglu_bwd";
  SwigluBwdLaunch l;
  if (int r = prepare_swiglu_bwd(args, fn, &l, err, err_len)) return r;
  if (args.m_total == 0) return kGemmOk;
  const int64_t tiles = max_m_blocks(args.m_total, args.num_groups) * ((args.intermediate + 127) / 128);
  constexpr int kStages = 4;
  constexpr auto kernel = &m_grouped_swiglu_bwd_pp_kernel<kStages>;
  constexpr int smem = SwigluBwdPPLayout<kStages>::kSmemBytes;
  cudaError_t e = set_max_dynamic_smem<kernel>(smem);
  if (e == cudaSuccess)
    e = launch_persistent<kernel>(kNumThreads, smem, tiles, l.sms, stream, l.a, l.b, l.h, l.dh, l.aw, l.p);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: %s", fn, cudaGetErrorString(e));
  return check_launch(fn, err, err_len);
}

int k_grouped_bf16_gemm(const KGroupedGemmArgs& args, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "k_grouped_bf16_gemm";
  const void* a = args.a;
  const void* b = args.b;
  void* c = args.c;
  const int64_t lda = args.lda, ldb = args.ldb;
  const bool c_is_bf16 = args.c_is_bf16, accumulate = args.accumulate;
  const int32_t* group_offsets = args.group_offsets;
  const int num_groups = args.num_groups;
  const int64_t p_total = args.p_total, m = args.m, n = args.n;
  const GroupedGemmConfig* config = args.config;
  if (int r = check_num_groups(num_groups, fn, err, err_len)) return r;
  if (p_total < 0 || p_total > kMaxDim || m < 8 || m > kMaxDim || n < 8 || n > kMaxDim)
    return fail(kGemmInvalidArgument, err, err_len, "%s: bad sizes p_total=%lld m=%lld n=%lld", fn,
                (long long)p_total, (long long)m, (long long)n);
  if (m % 8 != 0 || n % 8 != 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: m (%lld) and n (%lld) must be multiples of 8", fn,
                (long long)m, (long long)n);
  if ((int64_t)num_groups * m * n > (int64_t(1) << 40))
    return fail(kGemmInvalidArgument, err, err_len, "%s: output too large", fn);
  if (c_is_bf16 && accumulate)
    return fail(kGemmInvalidArgument, err, err_len, "%s: accumulate needs an fp32 output", fn);
  if (c == nullptr || !aligned16(c))
    return fail(kGemmInvalidArgument, err, err_len, "%s: c must be non-null and 16-byte aligned", fn);
  if (group_offsets == nullptr && p_total > 0)
    return fail(kGemmInvalidArgument, err, err_len, "%s: null group_offsets", fn);
  const size_t c_bytes = (size_t)num_groups * m * n * (c_is_bf16 ? 2 : 4);
  if (p_total == 0) {
    if (accumulate) return kGemmOk;
    const cudaError_t e = cudaMemsetAsync(c, 0, c_bytes, stream);
    if (e != cudaSuccess)
      return fail(kGemmCudaError, err, err_len, "%s: cudaMemsetAsync: %s", fn, cudaGetErrorString(e));
    return kGemmOk;
  }
  if (a == nullptr || b == nullptr || !aligned16(a) || !aligned16(b))
    return fail(kGemmInvalidArgument, err, err_len, "%s: a and b must be non-null and 16-byte aligned", fn);
  if (lda < m || lda % 8 != 0 || ldb < n || ldb % 8 != 0)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: lda = %lld, ldb = %lld must be >= m, n and multiples of 8", fn, (long long)lda,
                (long long)ldb);
  GroupedGemmConfig cfg = config ? *config : k_grouped_gemm_config(m, n, p_total, num_groups, c_is_bf16);
  if ((cfg.async_epilogue != 0) != c_is_bf16)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: async_epilogue = %d: a bf16 output is built with the asynchronous epilogue only, an fp32 one with "
                "the synchronous one only", fn, cfg.async_epilogue);
  if (!grouped_gemm_config_supported(cfg))
    return fail(kGemmInvalidArgument, err, err_len, "%s: unsupported config block_m=%d block_n=%d block_k=%d stages=%d",
                fn, cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages);
  int sms = 0;
  if (int r = device_sms(&sms, err, err_len)) return r;
  if (cfg.num_sms > 0 && cfg.num_sms < sms) sms = cfg.num_sms;

  CUtensorMap ma, mb;
  {
    const uint64_t dims[2] = {(uint64_t)m, (uint64_t)p_total};
    const uint64_t strides[1] = {(uint64_t)lda * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&ma, a, 2, dims, strides, box, err, err_len)) return r;
  }
  {
    const uint64_t dims[2] = {(uint64_t)n, (uint64_t)p_total};
    const uint64_t strides[1] = {(uint64_t)ldb * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&mb, b, 2, dims, strides, box, err, err_len)) return r;
  }
  CUtensorMap mc = mb;  // output map (bf16 output only): [E, m, n] bf16, 64 x 64 boxes
  if (c_is_bf16) {
    const uint64_t dims[3] = {(uint64_t)n, (uint64_t)m, (uint64_t)num_groups};
    const uint64_t strides[2] = {(uint64_t)n * 2, (uint64_t)m * n * 2};
    const uint32_t box[3] = {64, 64, 1};
    if (int r = make_map(&mc, c, 3, dims, strides, box, err, err_len)) return r;
  }
  KGroupedParams p;
  p.c = c;
  p.group_offsets = group_offsets;
  p.p_total = (int32_t)p_total;
  p.m = (int32_t)m;
  p.n = (int32_t)n;
  p.num_groups = num_groups;
  p.l2_hints = kKGroupedL2Hints;
  p.check = common::device_check_record();
  const int64_t tiles = (int64_t)num_groups * ((m + 127) / 128) * ((n + cfg.block_n - 1) / cfg.block_n);
  if (tiles > kMaxDim) return fail(kGemmInvalidArgument, err, err_len, "%s: too many tiles", fn);
  const int grid = (int)(tiles < sms ? tiles : sms);
  const int out = c_is_bf16 ? kOutBf16Store : (accumulate ? kOutF32Accumulate : kOutF32Store);
#define PK_K_LAUNCH(BN, ST, OUT, ASYNC) return launch_k_grouped<BN, ST, OUT, ASYNC>(ma, mb, mc, p, grid, stream, err, err_len)
  if (cfg.async_epilogue) {
    if (cfg.block_n == 256) PK_K_LAUNCH(256, 3, kOutBf16Store, true);
    PK_K_LAUNCH(128, 5, kOutBf16Store, true);
  }
  if (cfg.block_n == 256) {
    if (out == kOutF32Store) PK_K_LAUNCH(256, 4, kOutF32Store, false);
    PK_K_LAUNCH(256, 4, kOutF32Accumulate, false);
  }
  if (out == kOutF32Store) PK_K_LAUNCH(128, 6, kOutF32Store, false);
  PK_K_LAUNCH(128, 6, kOutF32Accumulate, false);
#undef PK_K_LAUNCH
}

}  // namespace sm90
}  // namespace prime_kernels
