// prime-kernels: a kernel whose only wait can never end, so that the timeout path (record, trap, report) can be
// provoked on purpose by a test.
#include "common/watchdog.hpp"

namespace prime_kernels {
namespace {
__device__ int32_t g_probe_counter = 0;  // nothing ever releases it

__global__ void wait_probe_kernel(const __grid_constant__ WaitGuard guard) {
  if (threadIdx.x == 0) wait_counter_at_least(&g_probe_counter, 1, guard, kWaitKernelProbe, kWaitProbe, 0);
}
}  // namespace

cudaError_t launch_wait_probe(const WaitGuard& guard, cudaStream_t stream) {
  wait_probe_kernel<<<1, 32, 0, stream>>>(guard);
  return cudaGetLastError();
}

}  // namespace prime_kernels
