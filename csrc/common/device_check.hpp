// prime-kernels: values a kernel reads from device memory and finds out of range (group offsets, row and route
// indices), recorded without a host synchronisation.
//
// Those arrays live on the device, so a host-side check would cost a synchronisation per call. The kernels check
// them instead and handle a bad value safely: group offsets that are not non-decreasing within [0, rows] make the
// GEMM write nothing at all (every CTA checks them in its prologue, before any store, and exits); an index outside
// its range is treated as masked (a zero row, a zero weight, a skipped route). The kernel then notes what it found
// in a DeviceCheckRecord: one per process, in mapped pinned host memory (the same address on every device under
// unified addressing), written with plain stores (device atomics on host memory would need PCIe atomics). The
// host reads it without synchronising: every entry point of the checked ops reads it before it launches anything
// and fails with the finding (then clears it), and pk_device_check reads it on request. A finding therefore
// surfaces at the first such read after the faulty kernel ran: the next call, or pk_device_check after a
// synchronisation.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace prime_kernels::common {

enum DeviceCheck : int {
  kCheckMGroupedOffsets = 0,  // an m-grouped GEMM's group_offsets (bound: m_total); nothing written
  kCheckKGroupedOffsets,      // a k-grouped GEMM's group_offsets (bound: p_total); nothing written
  kCheckGatherIndex,          // a gathered GEMM's a_row_index (bound: a's rows); read as a zero row
  kCheckPoolRoute,            // a SwiGLU backward's pool_src_route (bound: routes with a weight); weight 0
  kCheckCombineRoute,         // combine's route_to_pool (bound: slot rows); route skipped
  kCheckDispatchRoute,        // dispatch_rows' route_to_pool (bound: out rows); nothing written for it
  kCheckMegaFwdOffsets,       // the fused forward's expert_offsets (0 first, bound: m_total); nothing written
  kCheckMegaFwdRoute,         // the fused forward's pool_src_route (bound: num_tokens * top_k); read as zeros
  kCheckKGroupedFp8Offsets,   // the FP8 k-grouped GEMM's group_offsets (bound: p_total; 128-row starts); nothing written
  kCheckDispatchFp8Route,     // dispatch_rows_fp8's route_to_pool (bound: q rows); nothing written for it
  kCheckQuantizeTokensLayout,  // quantize_tokens_fp8's expert_offsets / expert_counts (bound: rows); nothing written
  kCheckSwigluBwdFp8Offsets,  // the FP8 L2 dgrad's group_offsets (bound: m_total; 128-row starts); nothing written
  kCheckQuantizeTokensRoute,  // a gathering quantize_tokens_fp8's pool_src_route (bound: routes); read as zeros
  kCheckMxfp8GroupEnds,       // quantize_mxfp8's group ends (bound: rows or cols), or their padded scale extent
                              // (bound: the scale buffer's bytes); nothing written
  kNumDeviceChecks,
};

struct DeviceCheckRecord {
  int32_t flag[kNumDeviceChecks];   // 0: nothing found; 1: found; 2: found, and the two fields below hold an example
  int64_t value[kNumDeviceChecks];  // the offending value
  int64_t bound[kNumDeviceChecks];  // the size it was checked against
};

#ifdef __CUDACC__
// Notes one offending value (the first writer of a kind wins; concurrent writers may mix their example fields,
// which only the message shows). For kernels with registers to spare (the prologue, the row kernels).
__device__ __forceinline__ void report_device_check(DeviceCheckRecord* rec, int kind, long long value, long long bound) {
  if (rec == nullptr) return;
  volatile DeviceCheckRecord* r = rec;
  if (r->flag[kind] != 0) return;
  r->value[kind] = value;
  r->bound[kind] = bound;
  __threadfence_system();  // the example is visible before the flag that announces it
  r->flag[kind] = 2;
}

// Notes a finding without an example: one store of a constant through the kernel parameter, so a GEMM's tile
// loop keeps its registers.
__device__ __forceinline__ void note_device_check(DeviceCheckRecord* rec, int kind) {
  if (rec != nullptr) reinterpret_cast<volatile int32_t*>(rec->flag)[kind] = 1;
}

// Whole CTA (every thread calls it; ends with a barrier): whether offsets[0..num_groups] fails
// 0 <= offsets[0] <= offsets[1] <= ... <= offsets[num_groups] <= rows, or, with align > 1, has an entry that is
// neither a multiple of align nor rows. CTA 0 records the finding under `kind`.
__device__ __forceinline__ bool group_offsets_invalid(const int32_t* offsets, int num_groups, int rows,
                                                      DeviceCheckRecord* rec, int kind, int align = 1) {
  int bad_value = 0;
  bool bad = false;
  for (int i = threadIdx.x; i <= num_groups; i += blockDim.x) {
    const int v = __ldg(offsets + i);
    const int prev = i > 0 ? __ldg(offsets + i - 1) : 0;
    if (v < prev || v > rows || (align > 1 && v % align != 0 && v != rows)) {
      bad = true;
      bad_value = v;
    }
  }
  const bool any = __syncthreads_or(bad) != 0;
  if (bad && blockIdx.x == 0) report_device_check(rec, kind, bad_value, rows);
  return any;
}
#endif

// The process's record (allocated on first use; null if the allocation failed, and then kernels check their
// values as before but record nothing). Defined once, in csrc/api/findings_api.cpp: every translation unit of
// the core, CUDA or not, reaches the same record.
DeviceCheckRecord* device_check_record();

// The findings recorded so far, formatted into out, and cleared; false (out untouched) if there are none. Never
// allocates or touches the device.
bool take_device_checks(char* out, size_t out_len);

}  // namespace prime_kernels::common
