// prime-kernels: host side of the bounded waits (csrc/common/watchdog.cuh): the per-device record and timeout.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/watchdog.cuh"

namespace prime_kernels {

// The guard for kernels launched on the current device: its host-mapped record is allocated on first use.
// Returns cudaSuccess or the error of the allocation.
cudaError_t wait_guard_for_current_device(WaitGuard* guard);
// The same with the bound on waits for another rank (pk_set_peer_wait_timeout; default 60 s).
cudaError_t peer_wait_guard_for_current_device(WaitGuard* guard);

// Launches one CTA that waits on a counter nothing releases, under `guard`: it traps after the timeout.
cudaError_t launch_wait_probe(const WaitGuard& guard, cudaStream_t stream);

// The first record a timed-out wait left on any device, formatted; false if there is none.
bool wait_record_message(char* out, size_t out_len);

}  // namespace prime_kernels
