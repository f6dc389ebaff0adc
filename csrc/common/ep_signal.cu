// prime-kernels: the barrier kernel of expert parallelism over peer memory (ep_signal.hpp).
#include "common/ep_signal.hpp"

namespace prime_kernels::common {
namespace {

__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// CTA b plays rank args.played[b]; lane j (< num_ranks) signals peer j, then waits for peer j's arrival.
__global__ void __launch_bounds__(32) ep_barrier_kernel(const __grid_constant__ EpBarrierArgs args,
                                                         const __grid_constant__ WaitGuard guard) {
  const int rank = args.played[blockIdx.x];
  const int lane = static_cast<int>(threadIdx.x);
  EpSignals* mine = args.signals[rank];
  uint64_t epoch = 0;
  if (lane == 0) {
    epoch = *reinterpret_cast<volatile uint64_t*>(&mine->epoch);
    if (args.kind == kEpEnter) *reinterpret_cast<volatile uint64_t*>(&mine->epoch) = ++epoch;
  }
  epoch = __shfl_sync(0xffffffffu, epoch, 0);
  if (args.phase != kEpWaitOnly) {
    // Every write this rank made before this launch (its staged rows, or the rows its kernels pushed into the
    // peers' buffers) is ordered before the arrival a peer acquires.
    __threadfence_system();
    if (lane < args.num_ranks) st_release_sys_u64(&args.signals[lane]->arrived[args.kind][rank], epoch);
  }
  if (args.phase != kEpArriveOnly && lane < args.num_ranks) {
    const uint64_t* arrived = &mine->arrived[args.kind][lane];
    uint64_t seen = ld_acquire_sys_u64(arrived);
    if (seen < epoch) {
      const uint64_t start = globaltimer_ns();
      for (;;) {
        __nanosleep(256);
        seen = ld_acquire_sys_u64(arrived);
        if (seen >= epoch) break;
        const uint64_t waited = globaltimer_ns() - start;
        if (waited > guard.timeout_ns)
          wait_timed_out_ranks(guard, args.kind == kEpEnter ? kWaitEpEnter : kWaitEpExit, rank, lane,
                               static_cast<int64_t>(epoch), static_cast<int64_t>(seen), waited);
      }
    }
  }
}

}  // namespace

cudaError_t launch_ep_barrier(const EpBarrierArgs& args, const WaitGuard& guard, cudaStream_t stream) {
  ep_barrier_kernel<<<args.num_played, 32, 0, stream>>>(args, guard);
  return cudaGetLastError();
}

}  // namespace prime_kernels::common
