// prime-kernels: the mbarrier stage ring of the sm90 kernels: its shared-memory layout, the stage position, the
// barrier inits and the kernel prologue that sets them up (no __global__ here).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernel_common.cuh"
#include "ptx.cuh"

namespace prime_kernels {
namespace sm90 {

// The start of every sm90 kernel's shared-memory layout here: the mbarrier ring's kNumStages A tiles
// (kBlockM x kBlockK elements of kElemBytes: 2 for bf16, 1 for e4m3), then its kNumStages B tiles
// (kBlockN x kBlockK); stage s of each at s times its tile's bytes, so the consumers' descriptors step by a
// constant. A layout continues at kRingEnd and ends with kSmemBytes = its end + 1024 (slack for aligning the
// dynamic base), at most kSmemLimit.
template <int kBlockM_, int kBlockN_, int kBlockK_, int kNumStages, int kElemBytes = 2>
struct StageRingLayout {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockK = kBlockK_;
  static constexpr int kABytes = kBlockM * kBlockK * kElemBytes;
  static constexpr int kBBytes = kBlockN * kBlockK * kElemBytes;
  static constexpr int kAOff = 0;
  static constexpr int kBOff = kAOff + kNumStages * kABytes;
  static constexpr int kRingEnd = kBOff + kNumStages * kBBytes;
  static constexpr int kSmemLimit = 232448;  // sm90: 227 KB of dynamic shared memory per block
};

__device__ __forceinline__ uint8_t* align_smem_1024(uint8_t* p) {
  const uint32_t a = ptx::smem_addr(p);
  return p + ((1024 - (a & 1023)) & 1023);
}

// The position in a kNumStages-deep mbarrier ring shared by a producer and its consumers: the stage index and
// the parity its full / empty barriers are waited with (flips at every wrap).
template <int kNumStages>
__device__ __forceinline__ void advance_stage(int& stage, uint32_t& phase) {
  if (++stage == kNumStages) {
    stage = 0;
    phase ^= 1;
  }
}
template <int kNumStages>
__device__ __forceinline__ void skip_stages(int& stage, uint32_t& phase, int n) {
  stage += n;
  while (stage >= kNumStages) {
    stage -= kNumStages;
    phase ^= 1;
  }
}
// One thread: the ring's full barriers (full_arrivals each: the TMA thread's expect-tx, plus any cp.async
// arrivals) and empty barriers (empty_arrivals: the consumer warps that release a stage), then the fence that
// publishes the inits.
__device__ __forceinline__ void init_stage_barriers(uint64_t* full_bar, uint64_t* empty_bar, int num_stages,
                                                    uint32_t full_arrivals, uint32_t empty_arrivals) {
  for (int s = 0; s < num_stages; ++s) {
    ptx::mbar_init(&full_bar[s], full_arrivals);
    ptx::mbar_init(&empty_bar[s], empty_arrivals);
  }
  ptx::fence_mbar_init();
}

// A tensor map for kernel_prologue: the map itself (null: none), or a callable that returns it (or null), called
// by the prefetching thread only: a map whose use depends on a kernel parameter costs the other threads nothing.
__device__ __forceinline__ const void* tensor_map_or_null(const CUtensorMap* map) { return map; }
template <typename MapFn>
__device__ __forceinline__ const void* tensor_map_or_null(const MapFn& map_fn) {
  return map_fn();
}

// The start of every kernel here, for the whole CTA before its roles split: thread 0 initializes the stage ring's
// barriers (init_stage_barriers) while thread 32, in another warp, prefetches the descriptors of the kernel's tensor
// maps in the order given (tensor_map_or_null); a null map (one this launch or instantiation does not use) is
// skipped. Nothing waits here: the caller's next CTA (or cluster) barrier publishes the inits to every thread.
template <int kNumStages, typename... TensorMaps>
__device__ __forceinline__ void kernel_prologue(uint64_t* full_bar, uint64_t* empty_bar, uint32_t full_arrivals,
                                                uint32_t empty_arrivals, const TensorMaps&... tensor_maps) {
  const int tid = threadIdx.x;
  if (tid == 0) init_stage_barriers(full_bar, empty_bar, kNumStages, full_arrivals, empty_arrivals);
  if (tid == 32) {
    auto prefetch = [](const void* map) {
      if (map != nullptr) ptx::tma_prefetch_desc(map);
    };
    (prefetch(tensor_map_or_null(tensor_maps)), ...);
  }
}

}  // namespace sm90
}  // namespace prime_kernels
