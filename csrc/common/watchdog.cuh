// prime-kernels: bounded waits on other CTAs' progress, and the record a timed-out wait leaves behind.
//
// A persistent kernel of ours may wait for a counter that another CTA releases. The kernels are written so that
// such a wait always ends (each kernel's header states why), but a bug, corrupted inputs or a GPU fault could
// still leave a counter short, and an unbounded spin would hang the whole job without a word. So every such wait
// is bounded in release builds too: past WaitGuard::timeout_ns it writes a WaitRecord to host-mapped pinned
// memory and traps. The trap ends the kernel (the CUDA context is lost); the host finds the record at the next
// call into the library and reports it (csrc/api/findings_api.cpp).
#pragma once

#include <cstdint>

namespace prime_kernels {

// Which kernel and which of its waits timed out (WaitRecord::kernel / ::wait).
enum WaitKernel : int32_t {
  kWaitKernelMegaFwd = 1,
  kWaitKernelProbe = 2,
  kWaitKernelMegaBwd = 3,
  kWaitKernelMegaFwdFp8 = 4,
  kWaitKernelEpBarrier = 5,  // a rank waits for its peers (common/ep_signal.hpp); cta = the rank, index = the peer
  kWaitKernelMegaBwdFp8 = 6,
};
enum WaitSite : int32_t {
  kWaitMegaFwdDispatch = 1,  // an L1 tile waits until its m-block's rows are dispatched
  kWaitMegaFwdL1 = 2,        // an L2 tile waits until every L1 tile of its m-block is stored
  kWaitProbe = 3,            // the test probe's wait on a counter nobody releases
  kWaitMegaBwdL2Dgrad = 4,   // an L1-dgrad tile waits until every L2-dgrad tile of its m-block is stored
  kWaitMegaBwdExpert = 5,    // a weight-gradient tile waits until every L2-dgrad tile of its expert is stored
  kWaitEpEnter = 6,          // a rank waits until every peer has entered the call
  kWaitEpExit = 7,           // a rank waits until every peer has pushed its rows of the call
};

// Host-mapped pinned memory, one per process; written once by the first wait that times out.
struct WaitRecord {
  int32_t state;  // 0: nothing happened; 2: the fields below are complete
  int32_t device;
  int32_t kernel;
  int32_t wait;
  int32_t cta;
  int32_t thread;
  int32_t index;  // what was waited on (the m-block of a forward wait)
  int64_t expected;
  int64_t observed;
  uint64_t waited_ns;
};

// Handed to a kernel in its parameters.
struct WaitGuard {
  WaitRecord* record;  // device pointer of the host-mapped record (one per process)
  uint64_t timeout_ns;
  int32_t device;      // the launch's device ordinal, for the record
};

#ifdef __CUDACC__
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int32_t ld_acquire_gpu_s32(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Elects the one thread that writes the record (per translation unit; the record's state keeps a second unit's
// thread out): device atomics on host memory would need PCIe atomics, a word in device memory does not.
static __device__ int32_t g_wait_record_claim = 0;

// Cold path: records what was waited for (the first timed-out thread only) and traps. cta: the waiting CTA, or for a
// wait on another rank the waiting rank (WaitKernel says which).
static __device__ __noinline__ void record_wait_and_trap(const WaitGuard& g, int32_t kernel, int32_t wait, int32_t cta,
                                                  int32_t index, int64_t expected, int64_t observed,
                                                  uint64_t waited_ns) {
  volatile WaitRecord* r = g.record;
  if (r != nullptr && atomicCAS(&g_wait_record_claim, 0, 1) == 0 && r->state == 0) {
    r->device = g.device;
    r->kernel = kernel;
    r->wait = wait;
    r->cta = cta;
    r->thread = static_cast<int32_t>(threadIdx.x);
    r->index = index;
    r->expected = expected;
    r->observed = observed;
    r->waited_ns = waited_ns;
    __threadfence_system();  // the fields are visible to the host before the state says they are complete
    r->state = 2;
    __threadfence_system();
  }
  __trap();
}

__device__ __forceinline__ void wait_timed_out(const WaitGuard& g, int32_t kernel, int32_t wait, int32_t index,
                                               int64_t expected, int64_t observed, uint64_t waited_ns) {
  record_wait_and_trap(g, kernel, wait, static_cast<int32_t>(blockIdx.x), index, expected, observed, waited_ns);
}

// A wait on another rank (common/ep_signal.hpp): the record names the waiting rank and the peer.
__device__ __forceinline__ void wait_timed_out_ranks(const WaitGuard& g, int32_t wait, int32_t rank, int32_t peer,
                                                     int64_t expected, int64_t observed, uint64_t waited_ns) {
  record_wait_and_trap(g, kWaitKernelEpBarrier, wait, rank, peer, expected, observed, waited_ns);
}

// Spins until *counter >= target (acquire, GPU scope); traps with a record after g.timeout_ns.
__device__ __forceinline__ void wait_counter_at_least(const int32_t* counter, int32_t target, const WaitGuard& g,
                                                      int32_t kernel, int32_t wait, int32_t index) {
  if (ld_acquire_gpu_s32(counter) >= target) return;
  const uint64_t start = globaltimer_ns();
  for (;;) {
    __nanosleep(64);
    const int32_t seen = ld_acquire_gpu_s32(counter);
    if (seen >= target) return;
    const uint64_t waited = globaltimer_ns() - start;
    if (waited > g.timeout_ns) wait_timed_out(g, kernel, wait, index, target, seen, waited);
  }
}
#endif

}  // namespace prime_kernels
