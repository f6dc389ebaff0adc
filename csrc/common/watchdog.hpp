// prime-kernels: host side of the bounded waits (csrc/common/watchdog.cuh): the per-device record and timeout.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/watchdog.cuh"

namespace deep_gemm {

// The guard for kernels launched on the current device: its host-mapped record is allocated on first use.
// Returns cudaSuccess or the error of the allocation.
cudaError_t wait_guard_for_current_device(WaitGuard* guard);

// A device word that stays zero, for the probe (one per device, next to the claim word).
cudaError_t wait_probe_counter_for_current_device(int32_t** counter);

// Launches one CTA that waits on `counter` (never released) under `guard`: it traps after the timeout.
cudaError_t launch_wait_probe(const WaitGuard& guard, const int32_t* counter, cudaStream_t stream);

// The first record a timed-out wait left on any device, formatted; false if there is none.
bool wait_record_message(char* out, size_t out_len);

// Inputs a kernel found invalid on the device (after the launch, without a host synchronisation): the kernel
// writes nothing and sets its flag in host-mapped memory; the next call into the library reports it (and clears
// it: the context is intact). One flag per check.
enum InputCheck : int32_t {
  kInputMegaFwdOffsets = 0,  // the fused forward's expert_offsets are not a plan
  kInputMegaFwdRoutes = 1,   // the fused forward's pool_src_route names a route past its tokens
  kNumInputChecks = 8,
};
// The current device's flags (device pointer of the host-mapped array [kNumInputChecks]).
cudaError_t input_flags_for_current_device(int32_t** flags);
// The first flag set on any device, formatted, and cleared; false if there is none.
bool input_error_message(char* out, size_t out_len);

}  // namespace deep_gemm
