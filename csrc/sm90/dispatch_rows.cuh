// prime-kernels: sm90a row dispatch inside the fused forward kernel: three producer warps per CTA copy source rows
// into a pool-ordered buffer while the consumers run tiles, and release one counter per 128-row m-block that the
// TMA producer waits on (ld.acquire) before it loads the m-block's rows. Work is claimed from a counter in global
// memory, never assigned by CTA index: whichever CTAs run, they copy every row between them, and the copy waits
// for nothing, so a tile's wait for its rows always ends (csrc/sm90/mega_moe_fwd.cuh states the whole argument).
#pragma once

#include "kernel_common.cuh"

namespace prime_kernels {
namespace sm90 {

constexpr int kDispatchRunRows = 32;
// The first round hands every dispatch warp of the grid one short run, so the m-blocks the first tiles wait for
// land in about a quarter of a full run's time (the first wave of tiles reads the first ~25 m-blocks).
constexpr int kDispatchHeadRunRows = 8;
constexpr int kDispatchWarps = 3;
// The dispatch warps need more than the GEMM producer's 40 registers; 128 * 56 + 256 * 224 = 384 * 168.
constexpr uint32_t kDispatchProducerRegs = 56;
constexpr uint32_t kDispatchConsumerRegs = 224;

// The next unit of work from a claim counter, uniform over the warp (lane 0 claims).
__device__ __forceinline__ int warp_claim(int32_t* counter, int lane) {
  int v = 0;
  if (lane == 0) v = atomicAdd(counter, 1);
  return __shfl_sync(0xffffffffu, v, 0);
}

// The group g of pool row `row` (s_offs[g] <= row < s_offs[g + 1]): binary search of the group offsets in shared
// memory. Its m-block is s_mb[g] + (row - s_offs[g]) / kBlockM.
__device__ __forceinline__ int pool_row_group(int row, const int32_t* s_offs, int num_groups) {
  int lo = 0, hi = num_groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (s_offs[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// One dispatch piece (at most kSlotBytes of a row) through a warp's shared-memory slot: every lane moves its 16-byte
// parts, lane + 32 k. Load: cp.async from src, or zeros when src is null (cp.async with 0 source bytes zero-fills;
// its address must stay a valid one: zero_src). Store: the landed parts to out with 16-byte generic stores.
template <int kSlotBytes>
__device__ __forceinline__ void dispatch_load_piece(uint32_t slot, const uint8_t* src, const uint8_t* zero_src,
                                                    int bytes, int lane) {
#pragma unroll 1
  for (int k = 0; k < kSlotBytes / 16 / 32; ++k) {
    const int off = (lane + 32 * k) * 16;
    if (off < bytes) ptx::cp_async_16(slot + off, src != nullptr ? src + off : zero_src, src != nullptr ? 16u : 0u);
  }
}
template <int kSlotBytes>
__device__ __forceinline__ void dispatch_store_piece(uint8_t* out, uint32_t slot, int bytes, int lane) {
#pragma unroll 1
  for (int k = 0; k < kSlotBytes / 16 / 32; ++k) {
    const int off = (lane + 32 * k) * 16;
    if (off < bytes) ptx::st_global_v4(out + off, ptx::ld_shared_v4(slot + off));
  }
}

// Pieces (kSlotBytes each) a row of row_bytes is copied in; the counters count landed pieces.
template <int kSlotBytes>
__host__ __device__ __forceinline__ int dispatch_pieces_per_row(int row_bytes) {
  return (row_bytes + kSlotBytes - 1) / kSlotBytes;
}

// One dispatch warp (dwarp = 0..kDispatchWarps-1) of a CTA. Pool rows [0, min(s_offs[num_groups], row_limit)) are
// cut into runs (first one short run per dispatch warp of the grid, so the m-blocks the first tiles wait for land
// in about a quarter of a full run's time, then runs of kDispatchRunRows rows), claimed in order from *run_claim by
// every dispatch warp of every running CTA until none is left. A run is one lane per row: each lane looks up its
// row's source (src_of(row): a pointer to row_bytes bytes, or null for a row of zeros) and m-block once; the run's
// pieces then stream through this warp's kSlotsPerWarp shared-memory slots: every lane cp.asyncs its 16-byte parts
// of a piece kSlotsPerWarp - 1 pieces ahead and stores them to dst once they land (the LSU path: bulk copies would
// queue behind the GEMM's TMA loads). After the run: proxy fence (the rows are read by TMA), and one release per
// m-block the run touches, by the lane holding that m-block's first row. dst rows are row_bytes apart.
// s_mb[g] = first m-block of group g; disp_ctr[mb] gains (rows of mb) * pieces per row in total.
template <int kBlockM, int kSlotsPerWarp, int kSlotBytes, typename SrcOf>
__device__ __forceinline__ void dispatch_rows_role(SrcOf&& src_of, uint8_t* dst, int row_bytes, uint32_t slots_addr,
                                                   int dwarp, int lane, const int32_t* s_offs, const int32_t* s_mb,
                                                   int num_groups, int32_t* disp_ctr, int32_t* run_claim,
                                                   int row_limit) {
  static_assert(kSlotsPerWarp >= 2, "each dispatch warp needs two slots");
  static_assert(kSlotBytes % 512 == 0, "a slot is whole 16-byte parts of every lane");
  const int chunks = dispatch_pieces_per_row<kSlotBytes>(row_bytes);
  const int num_rows = min(s_offs[num_groups], row_limit);
  const uint32_t slot0 = slots_addr + dwarp * kSlotsPerWarp * kSlotBytes;
  const int step = (int)gridDim.x * kDispatchWarps;
  const int head_rows = min(num_rows, step * kDispatchHeadRunRows);
  const int head_runs = ceil_div(head_rows, kDispatchHeadRunRows);
  const int num_runs = head_runs + ceil_div(num_rows - head_rows, kDispatchRunRows);
  for (int run = warp_claim(run_claim, lane); run < num_runs; run = warp_claim(run_claim, lane)) {
    const bool head = run < head_runs;
    const int row0 = head ? run * kDispatchHeadRunRows : head_rows + (run - head_runs) * kDispatchRunRows;
    const int rows = head ? min(kDispatchHeadRunRows, head_rows - row0) : min(kDispatchRunRows, num_rows - row0);
    // this lane's row: source and m-block (binary search of the group offsets in shared memory)
    const int my_row = row0 + min(lane, rows - 1);
    const uint8_t* my_src = reinterpret_cast<const uint8_t*>(src_of(my_row));
    const int g = pool_row_group(my_row, s_offs, num_groups);
    const int my_mb = lane < rows ? s_mb[g] + (my_row - s_offs[g]) / kBlockM : -1;
    // pieces of the run: i = ri * chunks + c
    const int pieces = rows * chunks;
    auto issue = [&](int i) {  // every lane; one commit per piece index, empty past the end
      if (i < pieces) {
        const int ri = i / chunks;  // chunks is small at the layer shapes: cheap
        const int c = i - ri * chunks;
        const uint8_t* row_src = reinterpret_cast<const uint8_t*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(my_src), ri));
        dispatch_load_piece<kSlotBytes>(slot0 + (i % kSlotsPerWarp) * kSlotBytes,
                                        row_src != nullptr ? row_src + c * kSlotBytes : nullptr, dst,
                                        min(kSlotBytes, row_bytes - c * kSlotBytes), lane);
      }
      ptx::cp_async_commit();
    };
    for (int i = 0; i < kSlotsPerWarp - 1; ++i) issue(i);
    for (int i = 0; i < pieces; ++i) {
      issue(i + kSlotsPerWarp - 1);
      ptx::cp_async_wait<kSlotsPerWarp - 1>();  // this lane's parts of piece i have landed
      const int ri = i / chunks;
      const int c = i - ri * chunks;
      dispatch_store_piece<kSlotBytes>(dst + static_cast<int64_t>(row0 + ri) * row_bytes + c * kSlotBytes,
                                       slot0 + (i % kSlotsPerWarp) * kSlotBytes,
                                       min(kSlotBytes, row_bytes - c * kSlotBytes), lane);
    }
    // release the run's rows per m-block: the lane with an m-block's first row in this run adds
    // (its rows in the run) * chunks
    const int prev_mb = __shfl_up_sync(0xffffffffu, my_mb, 1);
    const bool first = my_mb >= 0 && (lane == 0 || prev_mb != my_mb);
    const uint32_t firsts = __ballot_sync(0xffffffffu, first);
    ptx::fence_proxy_async_global();
    __syncwarp();
    if (first) {
      const uint32_t later = firsts & ~((2u << lane) - 1u);  // segment starts after this lane
      const int end = later ? __ffs(later) - 1 : rows;
      ptx::red_release_gpu_add(disp_ctr + my_mb, (end - lane) * chunks);
    }
  }
  ptx::cp_async_wait<0>();
}

}  // namespace sm90
}  // namespace prime_kernels
