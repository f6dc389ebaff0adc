// prime-kernels: the task ring of the fused FP8 backward kernel (mega_moe_bwd_fp8.cuh): the CTA's TMA thread claims
// tasks from a global counter in sequence order and announces each to the consumer warps through a ring of
// shared-memory slots, each with a full barrier (one arrival: the TMA thread) and an empty barrier (one arrival per
// consumer warp that reads it). The BF16 fused backward (mega_moe_bwd.cuh) spells the same ring out: written with
// these helpers its SASS differs from the build its GPU verification ran on.
#pragma once

#include <cstdint>

#include "ptx.cuh"

namespace prime_kernels {
namespace sm90 {

template <int kSlots>
struct TaskRing {
  int32_t* slot;
  uint64_t* full;
  uint64_t* empty;

  // The TMA thread's j-th announcement: task u, or -1 (none left).
  __device__ __forceinline__ void announce(int j, int u) const {
    const int s = j % kSlots;
    ptx::mbar_wait(&empty[s], ((j / kSlots) & 1) ^ 1);
    ptx::st_shared_handoff(&slot[s], u);
    ptx::mbar_arrive(&full[s]);
  }

  // A consumer warp's j-th task: read by the lane that frees the slot, and broadcast.
  __device__ __forceinline__ int receive(int j, int lane) const {
    const int s = j % kSlots;
    ptx::mbar_wait(&full[s], (j / kSlots) & 1);
    const int u = __shfl_sync(0xffffffffu, lane == 0 ? ptx::ld_shared_handoff(&slot[s]) : 0, 0);
    if (lane == 0) ptx::mbar_arrive(&empty[s]);
    return u;
  }
};

// The TMA thread's loop: claims tasks one ahead from *task_claim and runs load(u) for each of num_tasks in claim
// order; the next task is announced once this one's loads are issued, before its own wait (in load), so every
// task's consumers learn their stages without waiting on anything but lower tasks; -1 closes the ring.
template <int kSlots, typename LoadFn>
__device__ __forceinline__ void produce_claimed_tasks(int32_t* task_claim, int num_tasks, const TaskRing<kSlots>& ring,
                                                      LoadFn&& load) {
  int j = 0;  // this CTA's tasks announced so far
  int u = atomicAdd(task_claim, 1);
  if (u < num_tasks) ring.announce(j++, u);
  while (u < num_tasks) {
    const int next = atomicAdd(task_claim, 1);
    load(u);
    if (next < num_tasks) ring.announce(j++, next);
    u = next;
  }
  ring.announce(j, -1);
}

}  // namespace sm90
}  // namespace prime_kernels
