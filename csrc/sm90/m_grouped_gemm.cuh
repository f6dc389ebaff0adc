// prime-kernels: sm90a m-grouped BF16 GEMM (rows grouped by expert).
//
//   D[m, :] = A[m, :] @ B_g^T   for every row m in [offs[g], offs[g+1]),  g = 0 .. E-1
//
//   A  [M_total, K] bf16, K contiguous (row stride lda).
//   B  K-major  [E, N, K] ("nt", forward passes)   or   MN-major [E, K, N] ("nn", dgrad passes; read
//      through wgmma's transpose bit, no transposed copy).
//   D  [M_total, N] bf16 (row stride ldd). Rows outside every group are not written.
//   offs: device int32 [E+1], non-decreasing within [0, M_total], no padding required, empty groups allowed.
//   Every CTA checks that in its prologue, before any store: offsets that break it make the whole kernel write
//   nothing (and note it in the device-check record, common/device_check.hpp), so bad offsets cannot make tiles
//   overlap.
//
// Persistent and warp-specialized: at most one CTA per SM, 384 threads. Warpgroup 0 is the producer (one thread
// issues TMA into a kNumStages-deep mbarrier ring; with kGatherA its four warps copy A rows), warpgroups 1
// and 2 are consumers (they also TMA-store their finished tiles), each owning 64 of the 128 rows of a tile
// and issuing m64nNk16 wgmma on the full kBlockN width. The per-group tile starts come from a prologue scan of offs in shared
// memory; every role walks the same static tile sequence, so no tile ids travel between roles.
//
// Forward progress: a CTA never waits on another CTA. Its tiles are a fixed stride of the static tile list (CTA b
// takes b, b + gridDim.x, ...), each computed start to end by that CTA alone, so any grid size (the num_sms cap)
// gives the same tiles with the same bits, whichever CTAs are resident at a time.
//
// Tile order: group-major, then n-block, then m-block (m fastest; in bands of kMBand m-blocks, see band_tile), so
// CTAs running at the same time share the expert's B panel in L2.
//
// kGatherA: A is read through a row-index list (a token gather without a materialized copy). The four
// producer warps copy the tile's A rows with 16-byte cp.async straight into the 128-byte-swizzled layout
// wgmma reads (a 1-D bulk copy could not swizzle): warp w owns tile rows [32w, 32w + 32), each lane holds
// the source index of one of them (loaded once per tile, one tile ahead) and a copy instruction moves 4
// whole 128-byte rows (8 lanes per row, indices broadcast by shuffle). Their completion joins the stage's
// full barrier (cp.async.mbarrier.arrive.noinc); B still comes by TMA. (cp.async rows: per-row TMA boxes measured
// 1.4x slower, TMA + cp.async hybrids 1.25-1.4x, an added L2 prefetch of the rows 4-6%; docs/performance.md.)
//
// kSwiGLU (L1 of the fused forward; K-major B, asynchronous epilogue): an n-block covers kBlockN / 2 columns c
// of the intermediate dimension; its B stage holds the gate rows c of w13 followed by the matching up rows
// I + c (two TMA boxes), so one accumulator holds gate | up for the same columns. The epilogue writes
// s = silu(gate) * up (fp32 math, bf16 out) straight from registers and, when asked, h = gate | up through
// the staging tile and TMA stores into columns c and I + c of h.
//
// kSecondB (shared experts as extra groups): groups [0, num_b_groups) read B through tmap_b as above; group
// num_b_groups + v reads chunk j = v % b2_chunks of slab v / b2_chunks of tmap_b2, a second weight tensor whose experts
// have an intermediate size b2_inter = b2_chunks * I (a shared expert of width m * I is m experts of width I: SwiGLU
// is separable over its intermediate units). Three layer passes take it, each with its chunk addressing:
//   kSwiGLU (L1, w13 [S, 2 b2_inter, K]): the gate box at rows j * I + c, the up box at b2_inter + j * I + c;
//   K-major (L2, w2 [S, N, b2_inter], k = I): K coordinate j * I + k;
//   MN-major (L1 dgrad, w13 [S, 2 b2_inter, N] read as [K = 2I, N]): K rows [0, I) at j * I + r, [I, 2I) at
//   b2_inter + j * I + (r - I) (I % 64 == 0, so no k-block straddles the gate | up boundary).
// A box that reaches past the chunk's I columns or rows reads the next chunk's values where the first tensor's tail
// reads zeros: those accumulator columns are never stored, and no K box crosses a chunk (I % 64 == 0).
//
// Epilogue (asynchronous): the consumers write their bf16 tile into a 128B-swizzled staging buffer and TMA-store
// it (see epilogue.cuh), so they go on with the next tile while the copy engine writes the tile out. (One CTA per
// tile: 2-CTA clusters multicasting B measured 1-4% slower; the synchronous epilogue lost to this one on 20 of 24
// passes; docs/performance.md.)
#pragma once

#include <cuda.h>

#include "common/device_check.hpp"
#include "epilogue.cuh"
#include "kernel_common.cuh"
#include "mainloop.cuh"
#include "pipeline.cuh"
#include "swiglu_math.cuh"

namespace prime_kernels {
namespace sm90 {

// The most ranks an m-grouped GEMM pushes its rows to (= common::kEpMaxRanks, checked on the host).
constexpr int kMaxPushRanks = 8;

struct MGroupedParams {
  // L2 cache hints (kGemmL2Hints in gemm_heuristics.hpp): bit 0: the outputs' TMA stores (d, dh, aw) evict_first;
  // bit 3: the B (weight) loads evict_last. A clear bit: no hint.
  int32_t l2_hints;
  // Where the kernel notes invalid offsets and indices (may be null: they are still handled, not noted).
  common::DeviceCheckRecord* check;
  // Gathered A only (kGatherA): A [a_rows, K] row stride lda; pool row m reads A row a_row_index[m]
  // (-1 reads zeros; any other index outside [0, a_rows) reads zeros too and is noted as invalid).
  const __nv_bfloat16* a;
  int64_t lda;
  const int32_t* a_row_index;
  int32_t a_rows;
  __nv_bfloat16* d;
  int64_t ldd;
  const int32_t* group_offsets;
  int32_t m_total;
  int32_t n;
  int32_t k;
  int32_t num_groups;
  // SwiGLU epilogue only (kSwiGLU): n = I (columns of s); B = w13 [E, 2I, K] with gate rows [0, I) and up rows
  // [I, 2I); d = h [M, 2I] (gate | up pre-activation, bf16; may be null), s [M, I] = silu(gate) * up,
  // with gate <= clamp and |up| <= clamp first when clamp > 0.
  __nv_bfloat16* s;
  int64_t lds;
  float clamp;
  // SwiGLU backward only (swiglu_bwd_pp.cuh, L2 dgrad: A = dy_pool, B = w2 MN-major, n = I): h [M, 2I] (saved
  // gate | up), route weights [num_routes] by route id (pool_src_route; -1 = padding row, weight 0; any other id
  // outside [0, num_routes) also gets weight 0 and is noted as invalid), outputs dh [M, 2I], aw [M, I] (bf16) and
  // dt_part [M, dt_ld] (fp32, one partial per 128 columns of I); d is not written.
  const __nv_bfloat16* h;
  int64_t ldh;
  const int32_t* pool_src_route;
  const float* route_weights;
  int32_t num_routes;
  __nv_bfloat16* dh;
  int64_t lddh;
  __nv_bfloat16* aw;
  int64_t ldaw;
  float* dt_part;
  int32_t dt_ld;
  // SwiGLU epilogue with kMaskedH (a clamp): the bf16 neighbours of clamp below and above it (PackBf16x2ClampMasks),
  // so that the saved h keeps the clamp masks of the fp32 pre-activation (reference F6), as the fused forward's does.
  float clamp_below;
  float clamp_above;
  // Pushing the rows to their routes only (kPushRoutes; expert parallelism over peer memory): row m of the product
  // goes to push_slots[pool_src_rank[m]] + pool_src_route[m] * ld_slots instead of d (rows whose route lies outside
  // [0, num_routes), a plan's padding, go nowhere; ranks are clamped to [0, num_push_ranks)).
  __nv_bfloat16* push_slots[kMaxPushRanks];
  int32_t num_push_ranks;
  int64_t ld_slots;
  const int32_t* pool_src_rank;
  // Second B only (kSecondB): groups >= num_b_groups read chunks of tmap_b2 (see the header): b2_chunks chunks of
  // width I (n for kSwiGLU, k for K-major B, k / 2 for MN-major B) per slab of width b2_inter.
  int32_t num_b_groups;
  int32_t b2_chunks;
  int32_t b2_inter;
};

// Where one group's B tile comes from: the tensor map, its slab (the 3rd coordinate), the rows of the gate (or only)
// and up boxes of a K-major B, and the K coordinate offsets of k-blocks below and from k_split.
struct BTileSource {
  const CUtensorMap* map;
  int slab;
  int row;
  int up_row;
  int k_lo;
  int k_hi;
  int k_split;
  __device__ __forceinline__ int k_coord(int k0) const { return k0 + (k0 < k_split ? k_lo : k_hi); }
};

template <bool kSecondB, bool kSwiGLU, bool kBKMajor>
__device__ __forceinline__ BTileSource b_tile_source(const MGroupedParams& p, const CUtensorMap* tmap_b,
                                                     const CUtensorMap* tmap_b2, int group, int n0) {
  BTileSource src{tmap_b, group, n0, p.n + n0, 0, 0, 0};
  if constexpr (kSecondB) {
    if (group >= p.num_b_groups) {
      const int v = group - p.num_b_groups;
      const int slab = v / p.b2_chunks;
      const int j = v - slab * p.b2_chunks;
      src.map = tmap_b2;
      src.slab = slab;
      if constexpr (kSwiGLU) {
        src.row = j * p.n + n0;
        src.up_row = p.b2_inter + j * p.n + n0;
      } else if constexpr (kBKMajor) {
        src.k_lo = src.k_hi = j * p.k;
      } else {
        const int half = p.k / 2;
        src.k_split = half;
        src.k_lo = j * half;
        src.k_hi = p.b2_inter + j * half - half;
      }
    }
  }
  return src;
}

template <int kBlockN, int kNumStages>
struct MGroupedLayout : StageRingLayout<128, kBlockN, 64, kNumStages> {
  using Ring = StageRingLayout<128, kBlockN, 64, kNumStages>;
  static constexpr int kCOff = Ring::kRingEnd;
  static constexpr int kCBytes = TmaStaging<kBlockN>::kBytes;
  static constexpr int kBarOff = kCOff + kCBytes;
  static constexpr int kOffsOff = kBarOff + (2 * kNumStages + 2) * 8;
  static constexpr int kTileOff = kOffsOff + (kMaxGroups + 1) * 4;
  static constexpr int kEnd = kTileOff + (kMaxGroups + 1) * 4;
  static constexpr int kSmemBytes = kEnd + 1024;
  static_assert(kSmemBytes <= Ring::kSmemLimit, "shared memory budget exceeded");
  static_assert(kBlockN % 128 == 0 && kBlockN <= 256, "kBlockN must be 128 or 256");
};

template <int kBlockN, int kNumStages, bool kBKMajor, bool kGatherA, bool kSwiGLU = false, bool kMaskedH = false,
          bool kPushRoutes = false, bool kSecondB = false>
__global__ void __launch_bounds__(kNumThreads, 1)
    m_grouped_bf16_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a,
                               const __grid_constant__ CUtensorMap tmap_b,
                               const __grid_constant__ CUtensorMap tmap_d, const MGroupedParams p,
                               const __grid_constant__ CUtensorMap tmap_b2) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using L = MGroupedLayout<kBlockN, kNumStages>;
  constexpr int kBlockM = L::kBlockM;
  constexpr int kBlockK = L::kBlockK;
  constexpr int kMnBoxBytes = 64 * kBlockK * 2;  // MN-major B: one 64-column box of one stage
  using Mma = ptx::WgmmaBf16<kBlockN, 0, kBKMajor ? 0 : 1>;
  static_assert(!kSwiGLU || kBKMajor, "SwiGLU: K-major B");
  static_assert(!kMaskedH || kSwiGLU, "the clamp masks are the SwiGLU epilogue's");
  static_assert(!kPushRoutes || (!kSwiGLU && !kGatherA), "rows are pushed by the plain epilogue of a pooled A");
  static_assert(!kSecondB || !kPushRoutes, "the second B is the one-rank layer's");
  constexpr int kTileCols = kSwiGLU ? kBlockN / 2 : kBlockN;  // output columns per n-block (s columns)
  constexpr int kGatherWarps = 4;
  // The gathering producer warp needs more registers; the split keeps 128 * P + 256 * C = 384 * 168.
  constexpr uint32_t kProdRegs = kGatherA ? 56 : kProducerRegs;
  constexpr uint32_t kConsRegs = kGatherA ? 224 : kConsumerRegs;
  static_assert(128 * kProdRegs + 256 * kConsRegs <= 384 * 168, "register split exceeds the launch allocation");

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + L::kBarOff);
  uint64_t* empty_bar = full_bar + kNumStages;
  int32_t* s_offs = reinterpret_cast<int32_t*>(smem + L::kOffsOff);
  int32_t* s_tile = reinterpret_cast<int32_t*>(smem + L::kTileOff);  // per-group start (tiles or m-blocks)

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int num_groups = p.num_groups;
  const int n_blocks = ceil_div(p.n, kTileCols);
  const int num_k_blocks = ceil_div(p.k, kBlockK);

  // ---- prologue: offsets check, barriers, per-group starts. Bad offsets leave the tile list empty (set below), so
  // no role stores anything; every CTA of the grid sees the same offsets. (An early return instead made ptxas spill
  // in the gathering producer.)
  const bool bad_offsets =
      common::group_offsets_invalid(p.group_offsets, num_groups, p.m_total, p.check, common::kCheckMGroupedOffsets);
  // full: + one cp.async arrival per cp.async-gathering thread
  kernel_prologue<kNumStages>(full_bar, empty_bar, kGatherA ? 1 + 32 * kGatherWarps : 1, kNumConsumerThreads / 32,
                              &tmap_a, &tmap_b, &tmap_d);
  load_group_offsets(p.group_offsets, num_groups, s_offs);
  if (warp == 0) m_grouped_tile_starts<kBlockM>(s_offs, s_tile, num_groups, n_blocks, bad_offsets, lane);
  __syncthreads();

  // Work units: one tile each. The gathering kernels read the count again inside each role, after its setmaxnreg:
  // a value held across setmaxnreg is spilled there (the gathering producer has 56 registers).
  const int num_units_prologue = s_tile[num_groups];
  auto num_units_of_cta = [&]() -> int { return kGatherA ? s_tile[num_groups] : num_units_prologue; };
  // first unit of this CTA; re-read inside each role (see ptx::ctaid_x_volatile)
  auto unit_begin_of_cta = [&]() -> int { return (int)ptx::ctaid_x_volatile(); };
  const int unit_step = (int)gridDim.x;

  using Work = MGroupedWork;
  auto locate = [&](int u, int& g) -> Work {
    return m_grouped_locate<kBlockM>(s_offs, s_tile, n_blocks, kTileCols, u, g);
  };

  if (warp < 4) {
    // ================= producer warpgroup =================
    ptx::setmaxnreg_dec<kProdRegs>();
    const int num_units = num_units_of_cta();
    const uint64_t pol_b = l2_policy_reused_loads(p.l2_hints);
    if constexpr (kGatherA) {
      // Gathering producer: warps 0..3 copy A rows; lane 0 of warp 0 also issues B.
      int stage = 0;
      uint32_t phase = 0;
      int g = 0;
      const int my_row = warp * 32 + lane;  // tile row whose source index this lane holds
      const int sub_row = lane >> 3;        // row within a copy instruction's 4 rows
      const int chunk = lane & 7;           // 16-byte chunk of that row
      // The source row, -1 for none (a masked index, or a row past the group), -2 for an index outside
      // [-1, a_rows): read as zeros like -1 (every use tests >= 0) and noted when its tile starts.
      auto row_source = [&](const Work& w_) -> int {
        const int prow = w_.row0 + my_row;
        const int sr = prow < w_.row_end ? __ldg(p.a_row_index + prow) : -1;  // rows past the group: unused
        return (sr >= 0 && sr < p.a_rows) ? sr : (sr == -1 ? -1 : -2);
      };
      int u = unit_begin_of_cta();
      Work w{};
      int src_next = -1;
      if (u < num_units) {
        w = locate(u, g);
        src_next = row_source(w);
      }
      for (; u < num_units; u += unit_step) {
        const int src = src_next;
        if (src == -2) common::note_device_check(p.check, common::kCheckGatherIndex);
        const Work cur = w;
        if (u + unit_step < num_units) {  // next tile's index, loaded while this tile streams
          w = locate(u + unit_step, g);
          src_next = row_source(w);
        }
        for (int kb = 0; kb < num_k_blocks; ++kb) {
          ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
          const int k0 = kb * kBlockK;
          const uint32_t sa_addr = ptx::smem_addr(smem + L::kAOff + stage * L::kABytes);
          const bool k_ok = k0 + chunk * 8 < p.k;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int r = warp * 32 + 4 * i + sub_row;
            const int sr = __shfl_sync(0xffffffffu, src, 4 * i + sub_row);
            const bool ok = k_ok && sr >= 0;
            const __nv_bfloat16* srcp = ok ? p.a + static_cast<int64_t>(sr) * p.lda + k0 + chunk * 8 : p.a;
            ptx::cp_async_16(sa_addr + r * 128 + ((chunk ^ (r & 7)) << 4), srcp, ok ? 16u : 0u);
          }
          ptx::cp_async_mbar_arrive_noinc(&full_bar[stage]);
          if (warp == 0 && lane == 0) {
            uint8_t* sb = smem + L::kBOff + stage * L::kBBytes;
            ptx::mbar_arrive_expect_tx(&full_bar[stage], L::kBBytes);
            const BTileSource bs = b_tile_source<kSecondB, kSwiGLU, kBKMajor>(p, &tmap_b, &tmap_b2, cur.b_group,
                                                                              cur.n0);
            if constexpr (kSwiGLU) {
              ptx::tma_load_3d_hint(sb, bs.map, &full_bar[stage], k0, bs.row, bs.slab, pol_b);
              ptx::tma_load_3d_hint(sb + kTileCols * 128, bs.map, &full_bar[stage], k0, bs.up_row, bs.slab, pol_b);
            } else if constexpr (kBKMajor) {
              ptx::tma_load_3d_hint(sb, bs.map, &full_bar[stage], bs.k_coord(k0), bs.row, bs.slab, pol_b);
            } else {
#pragma unroll
              for (int j = 0; j < kBlockN / 64; ++j)
                ptx::tma_load_3d_hint(sb + j * kMnBoxBytes, bs.map, &full_bar[stage], bs.row + 64 * j,
                                      bs.k_coord(k0), bs.slab, pol_b);
            }
          }
          advance_stage<kNumStages>(stage, phase);
        }
      }
    } else if (warp == 0 && lane == 0) {
      int stage = 0;
      uint32_t phase = 0;
      int g = 0;
      for (int u = unit_begin_of_cta(); u < num_units; u += unit_step) {
        const Work w = locate(u, g);
        for (int kb = 0; kb < num_k_blocks; ++kb) {
          ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
          uint8_t* sa = smem + L::kAOff + stage * L::kABytes;
          uint8_t* sb = smem + L::kBOff + stage * L::kBBytes;
          ptx::mbar_arrive_expect_tx(&full_bar[stage], L::kABytes + L::kBBytes);
          ptx::tma_load_2d(sa, &tmap_a, &full_bar[stage], kb * kBlockK, w.row0);
          const BTileSource bs = b_tile_source<kSecondB, kSwiGLU, kBKMajor>(p, &tmap_b, &tmap_b2, w.b_group, w.n0);
          const int k0 = kb * kBlockK;
          if constexpr (kSwiGLU) {
            ptx::tma_load_3d_hint(sb, bs.map, &full_bar[stage], k0, bs.row, bs.slab, pol_b);
            ptx::tma_load_3d_hint(sb + kTileCols * 128, bs.map, &full_bar[stage], k0, bs.up_row, bs.slab, pol_b);
          } else if constexpr (kBKMajor) {
            ptx::tma_load_3d_hint(sb, bs.map, &full_bar[stage], bs.k_coord(k0), bs.row, bs.slab, pol_b);
          } else {
#pragma unroll
            for (int j = 0; j < kBlockN / 64; ++j)
              ptx::tma_load_3d_hint(sb + j * kMnBoxBytes, bs.map, &full_bar[stage], bs.row + 64 * j, bs.k_coord(k0),
                                    bs.slab, pol_b);
          }
          advance_stage<kNumStages>(stage, phase);
        }
      }
    }
    // Other producer-warpgroup threads have nothing to do (the epilogue is the consumers' TMA store).
  } else {
    // ================= consumer warpgroups =================
    ptx::setmaxnreg_inc<kConsRegs>();
    const int num_units = num_units_of_cta();
    const int wg = (warp >> 2) - 1;  // 0 or 1: rows [64*wg, 64*wg + 64) of the tile
    const int wg_tid = tid - 128 * (wg + 1);
    const uint32_t a_base = ptx::smem_addr(smem + L::kAOff) + wg * (64 * 128);
    const uint32_t b_base = ptx::smem_addr(smem + L::kBOff);
    // Descriptors for stage 0 / k-step 0; other stages and k-steps add a byte offset >> 4 to the low bits.
    const uint64_t desc_a0 = ptx::make_desc_sw128(a_base, 0, 1024);
    const uint64_t desc_b0 =
        kBKMajor ? ptx::make_desc_sw128(b_base, 0, 1024) : ptx::make_desc_sw128(b_base, kMnBoxBytes, 1024);
    constexpr uint32_t kBStepBytes = kBKMajor ? 32 : 16 * 128;  // one k16 step inside a stage
    const uint32_t a_lo0 = static_cast<uint32_t>(desc_a0), a_hi = static_cast<uint32_t>(desc_a0 >> 32);
    const uint32_t b_lo0 = static_cast<uint32_t>(desc_b0), b_hi = static_cast<uint32_t>(desc_b0 >> 32);

    float acc[kBlockN / 2];
    int stage = 0;
    uint32_t phase = 0;
    int g = 0;
    const uint32_t stg_half = ptx::smem_addr(smem + L::kCOff) + wg * TmaStaging<kBlockN>::kHalfBytes;
    for (int u = unit_begin_of_cta(); u < num_units; u += unit_step) {
      const Work w = locate(u, g);
      // A warpgroup whose 64 rows all lie past the group's end (a tail m-block) only keeps the pipeline moving; the
      // other warpgroup then has the tensor cores to itself.
      const bool active = w.row0 + 64 * wg < w.row_end;
      auto release = [&](int s_) {
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(&empty_bar[s_]);
      };
      // cp.async wrote a gathered A through the generic proxy
      consumer_tile_mainloop<Mma, kNumStages, kBlockK, L::kABytes, L::kBBytes, kBStepBytes, kGatherA>(
          acc, active, num_k_blocks, full_bar, stage, phase, a_lo0, a_hi, b_lo0, b_hi, release);

      if constexpr (kSwiGLU) {
        const int hrow0 = w.row0 + 64 * wg;
        if (active) {
          // s from h as saved (reference F3): with a clamp h keeps its masks (F6), else it is saved plainly
          if constexpr (kMaskedH)
            round_acc_as_saved_h<kBlockN>(acc, RoundHMasks{p.clamp, p.clamp_below, p.clamp_above});
          else
            round_acc_as_saved_h<kBlockN>(acc, RoundHPlain{});
          if (p.d != nullptr) {
            if (wg_tid == 0) ptx::bulk_wait_group_read<0>();
            ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
            write_acc_to_swizzled_staging<kBlockN>(acc, stg_half, wg_tid);
            ptx::fence_proxy_async_smem();
            ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
            if (hrow0 + 64 <= w.row_end) {
              if (wg_tid == 0) {
#pragma unroll
                for (int b = 0; b < kBlockN / 64; ++b) {
                  constexpr int kGateBoxes = kBlockN / 128;
                  const int c = w.n0 + 64 * (b % kGateBoxes);  // column within gate (and within up)
                  if (c < p.n)
                    ptx::tma_store_2d_hint(&tmap_d, stg_half + b * TmaStaging<kBlockN>::kBoxBytes,
                                           (b >= kGateBoxes ? p.n : 0) + c, hrow0, l2_policy_store(p.l2_hints, 0));
                }
                ptx::bulk_commit_group();
              }
            } else {
              copy_swizzled_half_to_global<kBlockN, true>(stg_half, wg_tid, w.row_end - hrow0, p.d, p.ldd, hrow0,
                                                          w.n0, p.n);
            }
          }
          store_swiglu_from_acc<kBlockN>(acc, wg_tid, p.s, p.lds, hrow0, w.row_end, w.n0, p.n, p.clamp);
        }
      } else if constexpr (kPushRoutes) {
        if (active) {
          // The rows go to other ranks' memory, row by row, so through the staging half by the warpgroup's threads
          // (a TMA store writes one tensor's boxes); the first barrier keeps the previous tile's copy from reading
          // what this one writes.
          const int hrow0 = w.row0 + 64 * wg;
          ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
          write_acc_to_swizzled_staging<kBlockN>(acc, stg_half, wg_tid);
          ptx::named_bar_sync(kBarEpilogueWg0 + wg, 128);
          copy_swizzled_half_to_routes<kBlockN>(stg_half, wg_tid, min(w.row_end - hrow0, 64), p.pool_src_route,
                                                p.pool_src_rank, p.num_routes, p.push_slots, p.num_push_ranks,
                                                p.ld_slots, hrow0, w.n0, p.n);
        }
      } else {
        if (active)
          store_acc_half_async<kBlockN>(acc, stg_half, wg, wg_tid, &tmap_d, w.row0 + 64 * wg, w.row_end, w.n0, p.n,
                                        p.l2_hints, p.d, p.ldd);
      }
    }
    if (wg_tid == 0) ptx::bulk_wait_group<0>();  // stores complete before the CTA's shared memory goes away
  }
#endif
}

}  // namespace sm90
}  // namespace prime_kernels
